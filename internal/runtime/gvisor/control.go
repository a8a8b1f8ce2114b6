package gvisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime/procstate"
)

// controlBound bounds one call to a sentry's control socket when ctx has
// no earlier deadline. Pause and resume answer in well under a millisecond.
const controlBound = 10 * time.Second

// maxControlAnswer bounds what is read of a control call's answer; a
// pause or resume answers with a few dozen bytes.
const maxControlAnswer = 64 << 10

// The sentry's control methods runsc's pause and resume call.
const (
	methodPause  = "Lifecycle.Pause"
	methodResume = "Lifecycle.Resume"
)

// controlAddr is the abstract unix socket the sandbox process of slot rid
// serves its control server on (runsc binds it, with the terminating NUL
// counted in the address, in runsc's own network namespace).
func controlAddr(rid string) string { return "@runsc-sandbox." + rid + "\x00" }

// setPaused pauses (paused) or resumes slot rid of sandbox id the way
// `runsc pause`/`resume` does, without runsc: under runsc's exclusive
// lock on the slot it reads the state file, asks the sentry over its
// control socket and records the new status.
//
// Why: `runsc resume` costs ~25 ms here (the runsc binary starting,
// loading and locking its state) around a call the sentry answers in
// ~0.5 ms, and a claim from the warm pool is a resume. The state file is
// the guard that makes the direct call safe: the sentry panics on a resume
// it receives while it is not paused (the sandbox dies), and runsc refuses
// or mishandles every later verb against a status that is not the truth,
// so the call is made only when the file, read under the lock, says the
// opposite status, and the file is rewritten before the lock is let go.
//
// errStateFormat means the files are not in the layout this knows; the
// caller falls back to runsc.
func (d *Driver) setPaused(ctx context.Context, id, rid string, paused bool) error {
	verb, method, from, to := "resume", methodResume, "paused", "running"
	if paused {
		verb, method, from, to = "pause", methodPause, "running", "paused"
	}
	lock, err := os.OpenFile(d.lockPath(rid), os.O_RDWR, 0)
	if errors.Is(err, os.ErrNotExist) {
		if _, serr := os.Stat(d.statePath(rid)); serr == nil {
			return errStateFormat
		}
		return fmt.Errorf("gvisor %s %s: container %q does not exist: %w", verb, id, rid, errdefs.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	defer lock.Close() // drops the lock
	if err := flockWait(ctx, lock, syscall.LOCK_EX); err != nil {
		return fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	st, err := d.loadStateFile(rid)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("gvisor %s %s: container %q does not exist: %w", verb, id, rid, errdefs.ErrNotFound)
		}
		return err
	}
	if st.Status != from {
		return fmt.Errorf("gvisor %s %s: sandbox is %s, not %s: %w", verb, id, st.Status, from, errdefs.ErrFailedPrecondition)
	}
	if err := sentryCall(ctx, rid, method); err != nil {
		if live, _ := procstate.Alive(st.pid, st.cgroup); !live {
			return fmt.Errorf("gvisor %s %s: sandbox is stopped: %w: %v", verb, id, errdefs.ErrFailedPrecondition, err)
		}
		return fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	if err := d.writeStatus(rid, st.raw, to); err != nil {
		// Put the sentry back where the file, which runsc trusts, says it is.
		back := methodResume
		if !paused {
			back = methodPause
		}
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), controlBound)
		defer cancel()
		if uerr := sentryCall(uctx, rid, back); uerr != nil {
			err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
		}
		return fmt.Errorf("gvisor %s %s: record status: %w", verb, id, err)
	}
	return nil
}

// stateFile is runsc's state file of one slot: its status and sandbox
// process, and the whole document for a rewrite that changes only the
// status.
type stateFile struct {
	Status string
	pid    int
	cgroup string
	raw    map[string]json.RawMessage
}

// loadStateFile reads slot rid's state file; the caller holds its lock.
func (d *Driver) loadStateFile(rid string) (*stateFile, error) {
	b, err := os.ReadFile(d.statePath(rid))
	if err != nil {
		return nil, err
	}
	var st runscState
	var raw map[string]json.RawMessage
	if json.Unmarshal(b, &st) != nil || json.Unmarshal(b, &raw) != nil || st.ID != rid || st.Status == "" || st.Sandbox == nil {
		return nil, errStateFormat
	}
	f := &stateFile{Status: st.Status, pid: st.Sandbox.PID, raw: raw}
	if st.Spec != nil && st.Spec.Linux != nil {
		f.cgroup = st.Spec.Linux.CgroupsPath
	}
	return f, nil
}

// writeStatus replaces slot rid's state file with raw whose status is
// status; everything else is kept as runsc wrote it. The file is
// replaced by a rename, so a reader never sees half of it.
func (d *Driver) writeStatus(rid string, raw map[string]json.RawMessage, status string) error {
	v, err := json.Marshal(status)
	if err != nil {
		return err
	}
	raw["status"] = v
	out, err := json.Marshal(raw)
	if err != nil {
		return err
	}
	path := d.statePath(rid)
	tmp := path + ".cube-tmp"
	if err := os.WriteFile(tmp, out, 0o640); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return nil
}

// sentryCall makes one urpc call without argument to slot rid's control
// server: a JSON request on a stream socket, answered by one JSON result.
func sentryCall(ctx context.Context, rid, method string) error {
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "unix", controlAddr(rid))
	if err != nil {
		return fmt.Errorf("sentry %s: %w", method, err)
	}
	defer conn.Close()
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(controlBound)
	}
	_ = conn.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Now()) })
	defer stop()
	if err := json.NewEncoder(conn).Encode(struct {
		Method string `json:"method"`
		Arg    any    `json:"arg"`
	}{method, nil}); err != nil {
		return fmt.Errorf("sentry %s: %w", method, err)
	}
	var res struct {
		Success bool   `json:"success"`
		Err     string `json:"err"`
	}
	// The sentry is on the sandbox's side of the boundary: its answer is
	// read with a bound on size as well as time.
	if err := json.NewDecoder(io.LimitReader(conn, maxControlAnswer)).Decode(&res); err != nil {
		if cerr := ctx.Err(); cerr != nil {
			return fmt.Errorf("sentry %s: %w", method, cerr)
		}
		return fmt.Errorf("sentry %s: %w: %v", method, errdefs.ErrUnavailable, err)
	}
	if !res.Success {
		return fmt.Errorf("sentry %s: %w: %s", method, errdefs.ErrInternal, res.Err)
	}
	return nil
}
