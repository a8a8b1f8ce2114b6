package identity

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// AsUser runs fn with u's filesystem credentials, so the kernel itself
// applies u's permissions to every path fn touches and new files and
// directories belong to u. The agent stays root; only one OS thread
// changes, and only for the duration of fn.
//
// It works because fsuid, fsgid and the supplementary groups are
// per-thread in Linux (the raw syscalls, not the all-threads wrappers Go's
// syscall package uses), and because switching fsuid away from 0 drops the
// filesystem capabilities (CAP_DAC_OVERRIDE, CAP_FOWNER, ...) from that
// thread's effective set; switching back restores them.
//
// fn runs on a dedicated goroutine locked to its thread. fn must do its
// filesystem calls itself, not hand them to other goroutines: only this
// thread carries the identity. File descriptors it opens keep working
// anywhere afterwards (permissions are checked at open). If the thread
// cannot be switched back, it is left locked and the Go runtime discards it
// when the goroutine ends, so no other goroutine ever runs with u's
// identity.
func AsUser(u *User, fn func() error) error {
	if u == nil {
		return fmt.Errorf("no user: %w", errdefs.ErrUnauthenticated)
	}
	euid, egid := os.Geteuid(), os.Getegid()
	if int(u.UID) == euid && int(u.GID) == egid {
		return fn()
	}
	if euid != 0 {
		return fmt.Errorf("agent runs as uid %d and cannot act as %s (uid %d): %w", euid, u.Name, u.UID, errdefs.ErrPermissionDenied)
	}
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		restore, err := switchThread(u)
		if err != nil {
			if restore() == nil {
				runtime.UnlockOSThread()
			}
			done <- err
			return
		}
		ferr := fn()
		if rerr := restore(); rerr != nil {
			// Stay locked: the runtime kills this thread on return.
			done <- fmt.Errorf("restore thread credentials: %w", rerr)
			return
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}

// switchThread gives the calling (locked) thread u's filesystem identity and
// returns the function that puts the original one back.
func switchThread(u *User) (restore func() error, err error) {
	origGroups, err := unix.Getgroups()
	if err != nil {
		return func() error { return nil }, fmt.Errorf("getgroups: %w", err)
	}
	origUID, origGID := os.Geteuid(), os.Getegid()
	restore = func() error {
		// Order matters: regain fsuid 0 (and with it the capabilities)
		// before changing groups and fsgid back.
		_, _ = unix.SetfsuidRetUid(origUID) // checked below by reading it back
		if cur, _ := unix.SetfsuidRetUid(-1); cur != origUID {
			return fmt.Errorf("fsuid is %d, want %d", cur, origUID)
		}
		if err := unix.Setgroups(origGroups); err != nil {
			return fmt.Errorf("setgroups: %w", err)
		}
		_, _ = unix.SetfsgidRetGid(origGID) // checked below by reading it back
		if cur, _ := unix.SetfsgidRetGid(-1); cur != origGID {
			return fmt.Errorf("fsgid is %d, want %d", cur, origGID)
		}
		return nil
	}
	groups := make([]int, 0, len(u.Groups))
	for _, g := range u.Groups {
		groups = append(groups, int(g))
	}
	if err := unix.Setgroups(groups); err != nil {
		return restore, fmt.Errorf("setgroups for %s: %w", u.Name, err)
	}
	if cur, _ := unix.SetfsgidRetGid(-1); cur == -1 {
		// No fsuid/fsgid (gVisor's sentry answers ENOSYS): switch the
		// thread's effective IDs instead, which also drops and regains
		// the capabilities, the saved IDs staying root.
		return switchThreadEffective(u, func() error { return unix.Setgroups(origGroups) })
	}
	_, _ = unix.SetfsgidRetGid(int(u.GID)) // checked below by reading it back
	if cur, _ := unix.SetfsgidRetGid(-1); cur != int(u.GID) {
		return restore, fmt.Errorf("setfsgid %d for %s did not take (is %d)", u.GID, u.Name, cur)
	}
	_, _ = unix.SetfsuidRetUid(int(u.UID)) // checked below by reading it back
	if cur, _ := unix.SetfsuidRetUid(-1); cur != int(u.UID) {
		return restore, fmt.Errorf("setfsuid %d for %s did not take (is %d)", u.UID, u.Name, cur)
	}
	return restore, nil
}

// switchThreadEffective is switchThread for kernels without setfsuid: the
// thread's effective uid and gid become u's (setresuid/setresgid on this
// thread only: the raw syscalls, not Go's all-threads wrappers), real and
// saved stay root so the restore can take them back. groupsRestore puts
// the supplementary groups back once the IDs are root again.
func switchThreadEffective(u *User, groupsRestore func() error) (func() error, error) {
	origUID, origGID := os.Geteuid(), os.Getegid()
	restore := func() error {
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), uintptr(origUID), ^uintptr(0)); e != 0 {
			return fmt.Errorf("setresuid back to %d: %w", origUID, e)
		}
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, ^uintptr(0), uintptr(origGID), ^uintptr(0)); e != 0 {
			return fmt.Errorf("setresgid back to %d: %w", origGID, e)
		}
		if cur := unix.Geteuid(); cur != origUID {
			return fmt.Errorf("euid is %d, want %d", cur, origUID)
		}
		return groupsRestore()
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESGID, ^uintptr(0), uintptr(u.GID), ^uintptr(0)); e != 0 {
		return restore, fmt.Errorf("setresgid %d for %s: %w", u.GID, u.Name, e)
	}
	if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), uintptr(u.UID), ^uintptr(0)); e != 0 {
		return restore, fmt.Errorf("setresuid %d for %s: %w", u.UID, u.Name, e)
	}
	return restore, nil
}
