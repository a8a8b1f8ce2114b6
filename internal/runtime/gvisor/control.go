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

// controlBound bounds each half of a call to a sentry's control socket:
// the dial and write (or ctx's deadline, when earlier), and the wait for
// the answer. Pause and resume answer in well under a millisecond.
const controlBound = 10 * time.Second

// maxControlAnswer bounds what is read of a control call's answer; a
// pause or resume answers with a few dozen bytes.
const maxControlAnswer = 64 << 10

// maxControlError bounds how much of a sentry's error message goes into
// an error of ours.
const maxControlError = 256

// The sentry's control methods runsc's pause and resume call.
const (
	methodPause  = "Lifecycle.Pause"
	methodResume = "Lifecycle.Resume"
)

// controlAddr is the abstract unix socket the sandbox process of slot rid
// serves its control server on (runsc binds it, with the terminating NUL
// counted in the address, in runsc's own network namespace).
func controlAddr(rid string) string { return "@runsc-sandbox." + rid + "\x00" }

// errNoControl means the sentry's control socket could not be reached and
// nothing was sent (or the sentry refused the call): the caller falls back
// to runsc, which may know another way to it.
var errNoControl = errors.New("sentry control socket not usable")

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
// opposite status.
//
// The file never says paused while the sentry runs, whatever happens in
// between (a cubelet killed mid-call, a sentry that does not answer): a
// pause is recorded after the sentry paused, a resume before the call is
// sent, and put back only when the call certainly did nothing. The worst
// outcome is a sandbox that stays paused while the file says running,
// never a resume sent to a running sentry. Once the call is sent, its
// answer is awaited for controlBound whatever ctx says, for the same
// reason.
//
// errStateFormat or errNoControl: the caller falls back to runsc.
func (d *Driver) setPaused(ctx context.Context, id, rid string, paused bool) error {
	verb, method, from := "resume", methodResume, "paused"
	if paused {
		verb, method, from = "pause", methodPause, "running"
	}
	unlock, err := d.lockSlot(ctx, rid)
	if errors.Is(err, os.ErrNotExist) {
		if _, serr := os.Stat(d.statePath(rid)); serr == nil {
			return errStateFormat // a state file without its lock file
		}
		return fmt.Errorf("gvisor %s %s: container %q does not exist: %w", verb, id, rid, errdefs.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	defer unlock()
	st, err := d.loadStateFile(rid)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("gvisor %s %s: container %q does not exist: %w", verb, id, rid, errdefs.ErrNotFound)
	}
	if err != nil {
		return err
	}
	if st.Status != from {
		return fmt.Errorf("gvisor %s %s: sandbox is %s, not %s: %w", verb, id, st.Status, from, errdefs.ErrFailedPrecondition)
	}
	notSent := func(err error) error {
		if live, aerr := procstate.Alive(st.pid, st.cgroup); aerr == nil && !live {
			return fmt.Errorf("gvisor %s %s: sandbox is stopped: %w: %v", verb, id, errdefs.ErrFailedPrecondition, err)
		}
		return fmt.Errorf("gvisor %s %s: %w: %w", verb, id, errNoControl, err)
	}
	if paused {
		if sent, err := sentryCall(ctx, rid, method); err != nil {
			if !sent {
				return notSent(err)
			}
			// The file still says running; the sentry may be paused.
			return fmt.Errorf("gvisor %s %s: %w", verb, id, err)
		}
		if err := d.writeStatus(rid, st.raw, "paused"); err != nil {
			// The sentry is paused and the file says running: resume it
			// so that the two agree again.
			if _, uerr := sentryCall(context.WithoutCancel(ctx), rid, methodResume); uerr != nil {
				err = errors.Join(err, fmt.Errorf("undo: %w", uerr))
			}
			return fmt.Errorf("gvisor %s %s: record status: %w", verb, id, err)
		}
		return nil
	}
	if err := d.writeStatus(rid, st.raw, "running"); err != nil {
		return fmt.Errorf("gvisor %s %s: record status: %w", verb, id, err)
	}
	if sent, err := sentryCall(ctx, rid, method); err != nil {
		if !sent {
			if werr := d.writeStatus(rid, st.raw, "paused"); werr != nil {
				return fmt.Errorf("gvisor %s %s: %w; record status back: %w", verb, id, err, werr)
			}
			return notSent(err)
		}
		// The file says running; the sentry may still be paused.
		return fmt.Errorf("gvisor %s %s: %w", verb, id, err)
	}
	return nil
}

// lockSlot takes runsc's exclusive lock on slot rid, as runsc does for
// every verb that rewrites the state file. A lock file replaced while we
// waited (the slot deleted and created again) is locked anew: the lock
// held must be the one at the path.
func (d *Driver) lockSlot(ctx context.Context, rid string) (func(), error) {
	path := d.lockPath(rid)
	for {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			return nil, err
		}
		if err := flockWait(ctx, f, syscall.LOCK_EX); err != nil {
			f.Close()
			return nil, err
		}
		held, herr := f.Stat()
		now, nerr := os.Stat(path)
		if herr == nil && nerr == nil && os.SameFile(held, now) {
			return func() { f.Close() }, nil // closing drops the lock
		}
		f.Close()
		if nerr != nil {
			return nil, nerr
		}
		if herr != nil {
			return nil, herr
		}
	}
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
	// A runsc that records a control socket path serves its control
	// server there, not at controlAddr: leave it to runsc.
	if st.Sandbox.ControlSocketPath != "" {
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
		_ = os.Remove(tmp)
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
// sent is false when the sentry certainly did not act on it: the socket
// could not be reached, or the sentry answered with an error. ctx bounds
// the dial and the write; once the request is written the answer is
// awaited for controlBound regardless (the sentry may already have acted:
// the caller must learn whether it did).
func sentryCall(ctx context.Context, rid, method string) (sent bool, err error) {
	dctx, cancel := context.WithTimeout(ctx, controlBound)
	defer cancel()
	var dialer net.Dialer
	conn, err := dialer.DialContext(dctx, "unix", controlAddr(rid))
	if err != nil {
		return false, fmt.Errorf("sentry %s: %w", method, err)
	}
	defer conn.Close()
	deadline, _ := dctx.Deadline()
	_ = conn.SetDeadline(deadline)
	req, err := json.Marshal(struct {
		Method string `json:"method"`
		Arg    any    `json:"arg"`
	}{method, nil})
	if err != nil {
		return false, err
	}
	if n, err := conn.Write(req); err != nil {
		return n > 0, fmt.Errorf("sentry %s: %w: %v", method, errdefs.ErrUnavailable, err)
	}
	_ = conn.SetDeadline(time.Now().Add(controlBound))
	var res struct {
		Success bool   `json:"success"`
		Err     string `json:"err"`
	}
	// The sentry is on the sandbox's side of the boundary: its answer is
	// read with a bound on size as well as time, and quoted, cut short.
	if err := json.NewDecoder(io.LimitReader(conn, maxControlAnswer)).Decode(&res); err != nil {
		return true, fmt.Errorf("sentry %s: no answer: %w: %v", method, errdefs.ErrUnavailable, err)
	}
	if !res.Success {
		msg := res.Err
		if len(msg) > maxControlError {
			msg = msg[:maxControlError] + "..."
		}
		return false, fmt.Errorf("sentry %s: refused: %q", method, msg)
	}
	return true, nil
}
