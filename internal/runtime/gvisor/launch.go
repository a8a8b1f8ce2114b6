package gvisor

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// launchBound caps one `runsc run|restore --detach` and one rollback of
// a failed launch; both outlive the caller's context.
const launchBound = 2 * time.Minute

// netnsShim runs runsc in a private mount namespace with an empty tmpfs
// over /proc/sys/net.
//
// Why: runsc (this Debian version) decides that the namespace it is
// asked to take over is the host's root network namespace when
// /proc/sys/net/core/rmem_default exists, and then refuses --network=
// sandbox ("cannot run with network enabled in root network namespace").
// Since Linux 6.x that file exists in every network namespace, so on
// these kernels the check always fires. Hiding /proc/sys/net from runsc
// (only from runsc: the mount namespace is private and dies with the
// sandbox processes that inherit it) makes the check answer "not root";
// runsc needs nothing else under /proc/sys/net. Only run and restore set
// up the network, so only they go through the shim.
const netnsShim = `mount -t tmpfs -o size=4k,mode=555 cube-runsc-netns /proc/sys/net && exec "$0" "$@"`

// runDetached runs `runsc run --detach` (image == "") or `runsc restore
// --detach` as runsc ID rid and returns once runsc has exited, the sandbox left
// running in the background. It does not use go-runc because the
// command may have to be wrapped in unshare (netnsShim), which go-runc
// cannot express. Stdout and stderr are console (a file), stdin is
// /dev/null: runsc hands them to the sandbox.
func (d *Driver) runDetached(ctx context.Context, rid, bundle, network, logFile, image string, console *os.File) error {
	args := []string{"--root", d.root, "--log", logFile, "--log-format", "json",
		"--platform=" + d.platform, "--network=" + network}
	if d.debug {
		args = append(args, "--debug", "--debug-log="+filepath.Join(bundle, "debug")+"/")
	}
	if image == "" {
		args = append(args, "run", "--detach", "--bundle", bundle, rid)
	} else {
		args = append(args, "restore", "--image-path", image, "--detach", "--bundle", bundle, rid)
	}
	// Not cut off by the caller's cancel: runsc killed between forking
	// the sandbox and gofer and recording them in its state leaves
	// processes its delete cannot find. A detached start returns quickly,
	// so a cancelled caller waits for it (within launchBound) and the
	// launch's rollback then removes the sandbox whole.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), launchBound)
	defer cancel()
	var cmd *exec.Cmd
	if network == "sandbox" {
		shim := append([]string{"--mount", "--propagation", "private", "/bin/sh", "-c", netnsShim, d.bin}, args...)
		cmd = exec.CommandContext(ctx, "unshare", shim...)
	} else {
		cmd = exec.CommandContext(ctx, d.bin, args...)
	}
	cmd.Stdout, cmd.Stderr = console, console
	// Own process group: a signal to cubelet's group must not reach
	// runsc while it is between fork and detach.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd.Run()
}
