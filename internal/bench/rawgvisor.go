package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/runtime/gvisor"
)

// runsc-restore: the floor under a gVisor create from a warm template.
// Setup (untimed) creates a sandbox from the warmed template through
// cubelet, which gives it what a sandbox has — its disk (a clone of the
// warm snapshot's), network slot, bundle — then removes its runsc
// sandbox with a bare `runsc delete --force` and gives the slot's
// namespace back the addresses runsc took (as the driver's Stop). Timed: the bare `runsc
// restore --detach` of the warm checkpoint image on that bundle (through
// the same netns shim as the driver), the wake-up of the quiesced agent
// (`runsc kill <id> USR2`, re-sent every second as cubelet does) and the
// first /health answer at the slot's address. Cleanup deletes the
// sandbox through cubelet. Left out of a create: disk clone, rootfs mount,
// slot, state store, reinit.

const runscBinary = "runsc"

// runscPlatform is what the bench's private node runs runsc with (the
// [gvisor] default); the raw restore must use the same.
const runscPlatform = "ptrace"

func runRunscRestore(ctx context.Context, e *Env, p Params) (*Result, error) {
	mem, _, err := e.warmSnapshotFiles(ctx)
	if err != nil {
		return nil, err
	}
	w, err := e.warm(ctx)
	if err != nil {
		return nil, err
	}
	root := filepath.Join(e.node.RunDir, "runsc")
	e.Progress.Start("runsc-restore", p.N)
	d := drive(ctx, e.Progress, p.N, 1, func(ctx context.Context, _ int) (time.Duration, error) {
		resp, err := e.Client.CreateSandbox(ctx, &pb.CreateSandboxRequest{
			TemplateId: w.id, Runtime: "gvisor", Labels: map[string]string{LabelKey: e.RunID},
		})
		if err != nil {
			return 0, fmt.Errorf("setup create: %w", err)
		}
		took, err := rawRunscRestore(ctx, root, mem, resp.Sandbox)
		return took, errors.Join(err, e.deleteAll(ctx, "", []string{resp.Sandbox.Id}, 1))
	})
	e.Progress.Finish()
	return d.result("runsc-restore", KindBaseline, p)
}

// rawRunscRestore replaces sandbox sb's runsc sandbox by a bare restore
// of the image in mem and times it to the agent's first /health.
func rawRunscRestore(ctx context.Context, root, mem string, sb *pb.Sandbox) (time.Duration, error) {
	if sb.Network == nil || sb.Network.HostIp == "" {
		return 0, fmt.Errorf("sandbox %s has no network slot address", sb.Id)
	}
	rid := gvisor.RunscID(sb.Id)
	out, err := exec.CommandContext(ctx, runscBinary, "--root", root, "state", rid).Output()
	if err != nil {
		return 0, fmt.Errorf("runsc state %s: %w", rid, err)
	}
	var st struct {
		Bundle string `json:"bundle"`
	}
	if err := json.Unmarshal(out, &st); err != nil || st.Bundle == "" {
		return 0, fmt.Errorf("runsc state %s: no bundle in %q: %v", rid, out, err)
	}
	if out, err := exec.CommandContext(ctx, runscBinary, "--root", root, "delete", "--force", rid).CombinedOutput(); err != nil {
		return 0, fmt.Errorf("runsc delete %s: %w: %s", rid, err, out)
	}
	// As the driver's Stop does: runsc took the slot's addresses.
	if err := gvisor.RawGiveBackNet(st.Bundle); err != nil {
		return 0, fmt.Errorf("give the netns of %s its addresses back: %w", sb.Id, err)
	}
	logFile := filepath.Join(st.Bundle, "runsc-raw.log")
	bin, args, err := gvisor.RawRestore(runscBinary, root, runscPlatform, st.Bundle, mem, sb.Id, logFile)
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
		return 0, fmt.Errorf("runsc restore %s: %w: %s", rid, err, tail(logFile))
	}
	wake := append(gvisor.RawGlobal(root, runscPlatform, st.Bundle, ""), gvisor.RawWake(sb.Id)...)
	url := "http://" + net.JoinHostPort(sb.Network.HostIp, strconv.Itoa(agentproto.Port)) + "/health"
	c := &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}
	deadline := time.Now().Add(60 * time.Second)
	var lastWake time.Time
	var last error
	for time.Now().Before(deadline) {
		if time.Since(lastWake) >= time.Second {
			if out, err := exec.CommandContext(ctx, runscBinary, wake...).CombinedOutput(); err != nil {
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
	return 0, fmt.Errorf("agent of %s did not answer /health within 60s: %v", sb.Id, last)
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
