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

// runsc-checkpoint-restore: the floor under a gVisor memory snapshot that
// keeps the sandbox running (cube's snapshot scenario). Setup (untimed)
// is runsc-restore's — a sandbox from the warmed template through cubelet,
// paused to disk, its runsc remains deleted, the slot's addresses given
// back — and then a bare `runsc restore --detach` of the warm image under
// the sandbox's first runsc ID, left unwoken: its agent is quiesced, as
// cubelet quiesces it before a checkpoint. Timed: a bare `runsc
// checkpoint` of it, SIGKILL to its processes (it does not exit by itself
// soon, and its netstack, still on the slot's interface, resets the
// restored copy's connections), the slot's addresses given back (runsc
// took them),
// a bare `runsc restore --detach` of that image under the sandbox's
// second runsc ID (a fresh ID: no `runsc delete` in between, which is the
// floor), the wake of its agent and the first /health answer at the
// slot's address. Left out of a cube snapshot: the quiesce, the disk
// copy, the snapshot's record. Cleanup deletes the sandbox through
// cubelet, whose gVisor driver removes both runsc IDs.

// RunscCheckpointRestore times that sequence for cubelet's sandbox id
// (runsc root root, slot address hostIP), restoring the warm image mem
// first and checkpointing into dir (empty, on the pool's filesystem).
// release is as for RunscRestore.
func RunscCheckpointRestore(ctx context.Context, root, mem, dir, id, hostIP string, release func(context.Context) error) (time.Duration, error) {
	if hostIP == "" {
		return 0, fmt.Errorf("sandbox %s has no network slot address", id)
	}
	slots := gvisor.RunscSlots(id)
	bundle, err := runscBundle(ctx, root, slots[0])
	if err != nil {
		return 0, err
	}
	if err := release(ctx); err != nil {
		return 0, fmt.Errorf("release %s from cubelet: %w", id, err)
	}
	if out, err := exec.CommandContext(ctx, RunscBinary, "--root", root, "delete", "--force", slots[0]).CombinedOutput(); err != nil && !strings.Contains(string(out), "does not exist") {
		return 0, fmt.Errorf("runsc delete %s: %w: %s", slots[0], err, out)
	}
	if err := gvisor.RawGiveBackNet(bundle); err != nil {
		return 0, fmt.Errorf("give the netns of %s its addresses back: %w", id, err)
	}
	console, err := os.OpenFile(filepath.Join(bundle, "console.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return 0, err
	}
	defer console.Close()
	logFile := filepath.Join(bundle, "runsc-raw.log")
	run := func(bin string, args ...string) error {
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Stdout, cmd.Stderr = console, console
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("%s %v: %w: %s", bin, args, err, Tail(logFile))
		}
		return nil
	}
	restore := func(image, rid string) error {
		bin, args, err := gvisor.RawRestoreAs(RunscBinary, root, RunscPlatform, bundle, image, rid, logFile)
		if err != nil {
			return err
		}
		return run(bin, args...)
	}
	// Untimed: the sandbox to checkpoint, its agent quiesced (the
	// namespace's addresses recorded first: runsc takes them).
	if err := gvisor.RawSaveNet(bundle); err != nil {
		return 0, err
	}
	if err := restore(mem, slots[0]); err != nil {
		return 0, err
	}
	start := time.Now()
	if err := run(RunscBinary, append(gvisor.RawGlobal(root, RunscPlatform, bundle, logFile), gvisor.RawCheckpoint(slots[0], dir)...)...); err != nil {
		return 0, err
	}
	if err := gvisor.RawKillCheckpointed(bundle); err != nil {
		return 0, err
	}
	if err := gvisor.RawGiveBackNet(bundle); err != nil {
		return 0, fmt.Errorf("give the netns of %s its addresses back: %w", id, err)
	}
	if err := restore(dir, slots[1]); err != nil {
		return 0, err
	}
	if err := wakeUntilHealthy(ctx, root, bundle, slots[1], hostIP); err != nil {
		return 0, fmt.Errorf("%w (console: %s)", err, Tail(filepath.Join(bundle, "console.log")))
	}
	return time.Since(start), nil
}

// runscBundle asks runsc for the bundle of the sandbox under runsc ID rid.
func runscBundle(ctx context.Context, root, rid string) (string, error) {
	out, err := exec.CommandContext(ctx, RunscBinary, "--root", root, "state", rid).Output()
	if err != nil {
		return "", fmt.Errorf("runsc state %s: %w", rid, err)
	}
	var st struct {
		Bundle string `json:"bundle"`
	}
	if err := json.Unmarshal(out, &st); err != nil || st.Bundle == "" {
		return "", fmt.Errorf("runsc state %s: no bundle in %q: %v", rid, out, err)
	}
	return st.Bundle, nil
}

// wakeUntilHealthy wakes the quiesced agent of the sandbox under runsc ID
// rid (re-sent every second, as cubelet does) until it answers /health at
// hostIP, within 60 s.
func wakeUntilHealthy(ctx context.Context, root, bundle, rid, hostIP string) error {
	wake := append(gvisor.RawGlobal(root, RunscPlatform, bundle, ""), gvisor.RawWakeAs(rid)...)
	url := "http://" + net.JoinHostPort(hostIP, strconv.Itoa(agentproto.Port)) + "/health"
	c := &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	deadline := time.Now().Add(60 * time.Second)
	var lastWake time.Time
	var last error
	for time.Now().Before(deadline) {
		if time.Since(lastWake) >= time.Second {
			if out, err := exec.CommandContext(ctx, RunscBinary, wake...).CombinedOutput(); err != nil {
				return fmt.Errorf("wake agent: %w: %s", err, out)
			}
			lastWake = time.Now()
		}
		if last = getOK(ctx, c, url); last == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(2 * time.Millisecond)
	}
	return fmt.Errorf("agent of %s did not answer /health within 60s: %v", rid, last)
}
