package raw

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/runtime/gvisor"
)

// runsc-restore: the floor under a gVisor create from a warm template.
// Setup (untimed, package bench) creates a sandbox from the warmed template through
// cubelet, which gives it what a sandbox has — its disk (a clone of the
// warm snapshot's), network slot, bundle — then pauses it to disk
// through cubelet (its runsc process stops and cubelet's runtime watch
// lets go of it), removes what is left with a bare `runsc delete
// --force` and gives the slot's
// namespace back the addresses runsc took (as the driver's Stop). Timed: the bare `runsc
// restore --detach` of the warm checkpoint image on that bundle (through
// the same netns shim as the driver), the wake-up of the quiesced agent
// (`runsc kill <id> USR2`, re-sent every second as cubelet does) and the
// first /health answer at the slot's address. Cleanup deletes the
// sandbox through cubelet. Left out of a create: disk clone, rootfs mount,
// slot, state store, reinit.

// RunscBinary is the runsc the raw restore runs.
const RunscBinary = "runsc"

// RunscPlatform is what the bench's private node runs runsc with (the
// [gvisor] default); the raw restore must use the same.
const RunscPlatform = "ptrace"

// RunscRestore replaces the runsc sandbox of cubelet's sandbox id (under
// runsc root root, reachable at hostIP, its network slot's address) by a
// bare restore of the image in mem and times it to the agent's first
// /health. release, called once the bundle is known, makes cubelet let go
// of the sandbox's runsc process (the bench pauses it to disk).
func RunscRestore(ctx context.Context, root, mem, id, hostIP string, release func(context.Context) error) (time.Duration, error) {
	if hostIP == "" {
		return 0, fmt.Errorf("sandbox %s has no network slot address", id)
	}
	rid := gvisor.RunscID(id)
	out, err := exec.CommandContext(ctx, RunscBinary, "--root", root, "state", rid).Output()
	if err != nil {
		return 0, fmt.Errorf("runsc state %s: %w", rid, err)
	}
	var st struct {
		Bundle string `json:"bundle"`
	}
	if err := json.Unmarshal(out, &st); err != nil || st.Bundle == "" {
		return 0, fmt.Errorf("runsc state %s: no bundle in %q: %v", rid, out, err)
	}
	if err := release(ctx); err != nil {
		return 0, fmt.Errorf("release %s from cubelet: %w", id, err)
	}
	// Gone already when release stopped it; --force takes whatever is left.
	if out, err := exec.CommandContext(ctx, RunscBinary, "--root", root, "delete", "--force", rid).CombinedOutput(); err != nil && !strings.Contains(string(out), "does not exist") {
		return 0, fmt.Errorf("runsc delete %s: %w: %s", rid, err, out)
	}
	// As the driver's Stop does: runsc took the slot's addresses.
	if err := gvisor.RawGiveBackNet(st.Bundle); err != nil {
		return 0, fmt.Errorf("give the netns of %s its addresses back: %w", id, err)
	}
	logFile := filepath.Join(st.Bundle, "runsc-raw.log")
	bin, args, err := gvisor.RawRestore(RunscBinary, root, RunscPlatform, st.Bundle, mem, id, logFile)
	if err != nil {
		return 0, err
	}
	console, err := os.OpenFile(filepath.Join(st.Bundle, "console.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return 0, err
	}
	defer console.Close()
	start := time.Now()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stdout, cmd.Stderr = console, console
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("runsc restore %s: %w: %s", rid, err, Tail(logFile))
	}
	wake := append(gvisor.RawGlobal(root, RunscPlatform, st.Bundle, ""), gvisor.RawWake(id)...)
	url := "http://" + net.JoinHostPort(hostIP, strconv.Itoa(agentproto.Port)) + "/health"
	c := &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	deadline := time.Now().Add(60 * time.Second)
	var lastWake time.Time
	var last error
	for time.Now().Before(deadline) {
		if time.Since(lastWake) >= time.Second {
			if out, err := exec.CommandContext(ctx, RunscBinary, wake...).CombinedOutput(); err != nil {
				return 0, fmt.Errorf("wake agent: %w: %s", err, out)
			}
			lastWake = time.Now()
		}
		if last = getOK(ctx, c, url); last == nil {
			return time.Since(start), nil
		}
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		time.Sleep(2 * time.Millisecond)
	}
	return 0, fmt.Errorf("agent of %s did not answer /health within 60s: %v", id, last)
}

func getOK(ctx context.Context, c *http.Client, url string) error {
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(rctx, http.MethodGet, url, nil)
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("status %s", resp.Status)
	}
	return nil
}
