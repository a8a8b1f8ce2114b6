package gvisor

import (
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/testenv"
)

// vethNetns makes a network namespace joined to the host by a veth pair
// (host side a.b.c.1/30, namespace side a.b.c.2/30 — the shape of a
// cubelet network slot) and returns its path and the namespace side's
// address. Both go when t ends.
func vethNetns(t *testing.T) (path, addr string) {
	t.Helper()
	b := make([]byte, 2)
	_, _ = rand.Read(b)
	tag := fmt.Sprintf("%02x%02x", b[0], b[1])
	ns, host, peer := "cube-gvtr-"+tag, "cgvh"+tag, "cgvp"+tag
	// 10.231.x.y/30: one /30 of a range nothing else here uses.
	x, y := int(b[0]), int(b[1])&0xfc
	hostIP, nsIP := fmt.Sprintf("10.231.%d.%d", x, y+1), fmt.Sprintf("10.231.%d.%d", x, y+2)
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			testenv.Missing(t, "ip %v: %v: %s", args, err, out)
		}
	}
	run("netns", "add", ns)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns).Run() })
	run("link", "add", host, "type", "veth", "peer", "name", peer)
	t.Cleanup(func() { _ = exec.Command("ip", "link", "del", host).Run() })
	run("link", "set", peer, "netns", ns)
	run("addr", "add", hostIP+"/30", "dev", host)
	run("link", "set", host, "up")
	run("-n", ns, "addr", "add", nsIP+"/30", "dev", peer)
	run("-n", ns, "link", "set", peer, "up")
	run("-n", ns, "link", "set", "lo", "up")
	run("-n", ns, "route", "add", "default", "via", hostIP)
	return "/run/netns/" + ns, nsIP
}

// trafficRounds is how many checkpoints TestCheckpointUnderTraffic takes:
// 10, or CUBE_GVISOR_TRAFFIC_ROUNDS.
func trafficRounds() int {
	if n, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_TRAFFIC_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return 10
}

// TestCheckpointUnderTraffic is a drain's view of one gVisor sandbox:
// clients keep dialling it over its veth (as a proxy does, to a port
// nothing listens on any more: a quiesced agent) while it is checkpointed
// again and again, each time restored in place. Every checkpoint must
// succeed and leave the sandbox running with its memory.
func TestCheckpointUnderTraffic(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	nsPath, addr := vethNetns(t)
	spec := shellSpec(t, parent, "traffic-sb", counterScript)
	spec.NetNSPath = nsPath
	stopAtEnd(t, d, spec.ID)
	if _, err := d.Start(t.Context(), spec); err != nil {
		t.Fatalf("Start in a netns: %v", err)
	}
	prev := readState(t, d, spec.ID)

	// The clients: each dials the sandbox's port in a loop; the sandbox's
	// netstack answers every SYN with a RST (no listener).
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var dials, refused atomic.Int64
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dl := net.Dialer{Timeout: 200 * time.Millisecond}
			for ctx.Err() == nil {
				dials.Add(1)
				c, err := dl.DialContext(ctx, "tcp", net.JoinHostPort(addr, "49983"))
				if err == nil {
					_ = c.Close()
				} else {
					refused.Add(1)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}()
	}
	t.Cleanup(func() { cancel(); wg.Wait() })

	failed := 0
	for r := range trafficRounds() {
		dir := filepath.Join(t.TempDir(), "img")
		begin := time.Now()
		err := d.Checkpoint(t.Context(), spec.ID, dir, true)
		if err != nil {
			failed++
			t.Errorf("round %d: Checkpoint under traffic (%d dials so far): %v", r, dials.Load(), err)
			st, serr := d.State(t.Context(), spec.ID)
			t.Logf("round %d: state after the failure: %+v %v", r, st, serr)
			if serr != nil || st.Status != runtime.StatusRunning {
				break
			}
			continue
		}
		t.Logf("round %d: checkpoint+restore in %s (%d dials so far, %d refused)", r, time.Since(begin).Round(time.Millisecond), dials.Load(), refused.Load())
		if st, err := d.State(t.Context(), spec.ID); err != nil || st.Status != runtime.StatusRunning {
			t.Fatalf("round %d: after checkpoint: %+v, %v; want running", r, st, err)
		}
		prev = wantContinued(t, d, spec.ID, prev)
	}
	if failed > 0 {
		t.Errorf("%d of %d checkpoints failed under traffic", failed, trafficRounds())
	}
}

// TestParallelCheckpoints checkpoints several sandboxes at once, as a
// drain moving several sandboxes of a node does, and restores each in
// place: every checkpoint must succeed and each sandbox keep its memory
// (CUBE_GVISOR_PARALLEL sandboxes, default 3; CUBE_GVISOR_PARALLEL_ROUNDS
// rounds, default 3; CUBE_GVISOR_MILLICPU a CPU quota per sandbox). Under
// load this is where runsc loses the sentry's reply to a checkpoint now
// and then; the count is logged.
func TestParallelCheckpoints(t *testing.T) {
	requireRunsc(t)
	d, parent := newTestDriver(t), cgroupParent(t)
	n, rounds := 3, 3
	if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_PARALLEL")); err == nil && v > 0 {
		n = v
	}
	if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_PARALLEL_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	lost := LostCheckpointReplies()
	defer func() {
		t.Logf("%d checkpoints of %d sandboxes: %d runsc lost the reply of a whole save", n*rounds, n, LostCheckpointReplies()-lost)
	}()
	ids := make([]string, n)
	prev := make([]memState, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("par-%d", i)
		spec := shellSpec(t, parent, ids[i], counterScript)
		if v, err := strconv.Atoi(os.Getenv("CUBE_GVISOR_MILLICPU")); err == nil && v > 0 {
			spec.Limits.MilliCPU = int64(v)
		}
		stopAtEnd(t, d, ids[i])
		if _, err := d.Start(t.Context(), spec); err != nil {
			t.Fatalf("Start: %v", err)
		}
	}
	for i, id := range ids {
		prev[i] = readState(t, d, id)
	}
	failed := 0
	for r := range rounds {
		var wg sync.WaitGroup
		errs := make([]error, n)
		took := make([]time.Duration, n)
		for i, id := range ids {
			wg.Add(1)
			go func() {
				defer wg.Done()
				begin := time.Now()
				errs[i] = d.Checkpoint(t.Context(), id, filepath.Join(t.TempDir(), "img"), true)
				took[i] = time.Since(begin)
			}()
		}
		wg.Wait()
		for i, id := range ids {
			if errs[i] != nil {
				failed++
				t.Errorf("round %d: %s: Checkpoint: %v", r, id, errs[i])
				continue
			}
			t.Logf("round %d: %s checkpointed and restored in %s", r, id, took[i].Round(time.Millisecond))
			prev[i] = wantContinued(t, d, id, prev[i])
		}
		if failed > 0 {
			break
		}
	}
}
