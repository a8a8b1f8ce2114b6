package integration

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/cubelet/usage"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// TestSandboxUsage: a runc sandbox in a network slot is sampled from its
// cgroup, disk and veth — bytes sent into the sandbox and out of it show
// in the network counters — a paused sandbox keeps its history without
// new samples, and a restarted cubelet samples the sandbox it adopted
// afresh (history starts over, the cumulative CPU and network counters
// carry on).
func TestSandboxUsage(t *testing.T) {
	cubelettest.RequireRoot(t)
	const interval = 250 * time.Millisecond
	env := cubelettest.New(t, "[usage]\ninterval = \"250ms\"\n")
	env.StartNetworkAgent(t, nettest.Options{})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	sb := mustCreate(t, svc, cubelet.CreateRequest{Runtime: "runc"})
	restarted := false
	t.Cleanup(func() {
		if !restarted { // else svc2's cleanup deletes it
			_, _ = svc.Delete(ctx, sb.ID)
		}
	})

	latest := func(t *testing.T, svc *cubelet.Service, after time.Time) usage.Sample {
		t.Helper()
		deadline := time.Now().Add(4 * interval)
		for {
			h, err := svc.Usage(ctx, sb.ID, after, time.Time{})
			if err != nil {
				t.Fatal(err)
			}
			if len(h) > 0 {
				return h[len(h)-1]
			}
			if time.Now().After(deadline) {
				t.Fatalf("no sample after %s within %s", after.Format("15:04:05.000"), 4*interval)
			}
			time.Sleep(interval / 5)
		}
	}
	before := latest(t, svc, time.Time{})
	t.Logf("first sample: %+v", before)
	if before.MemLimit != sb.Resources.MemoryMiB<<20 || before.Pids < 1 || before.DiskTotal == 0 || before.DiskUsed == 0 {
		t.Fatalf("first sample: %+v (record resources %+v)", before, sb.Resources)
	}

	// 1 MiB into the sandbox (an upload) and 3 MB out of it (a
	// command's output).
	resp, err := http.Post(fmt.Sprintf("http://%s:%d/files?path=/tmp/in.bin", sb.Network.HostIP, agentproto.Port),
		"application/octet-stream", bytes.NewReader(make([]byte, 1<<20)))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("upload: %s", resp.Status)
	}
	out, code := shIn(t, sb, "head -c 3000000 /dev/urandom") // random: the stream is compressed
	if code != 0 || len(out) != 3000000 {
		t.Fatalf("exit %d, %d bytes out", code, len(out))
	}
	sent := time.Now()
	after := latest(t, svc, sent)
	rx, tx := after.NetRx-before.NetRx, after.NetTx-before.NetTx
	t.Logf("through the slot: %d bytes in, %d bytes out", rx, tx)
	if rx < 1<<20 || tx < 3000000 {
		t.Errorf("network counters moved %d in, %d out; want >= 1 MiB in and 3 MB out", rx, tx)
	}

	if _, err := svc.Pause(ctx, sb.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	paused := time.Now()
	time.Sleep(3 * interval)
	if h, _ := svc.Usage(ctx, sb.ID, paused.Add(interval), time.Time{}); len(h) != 0 {
		t.Errorf("%d samples of a paused sandbox", len(h))
	}
	if h, _ := svc.Usage(ctx, sb.ID, time.Time{}, time.Time{}); len(h) == 0 {
		t.Error("the paused sandbox lost its history")
	}
	if _, err := svc.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}

	restarted = true
	if err := svc.Close(); err != nil {
		t.Fatal(err)
	}
	svc2 := env.Start(t)
	cleanupDelete(t, svc2, sb.ID) // before svc2's close, which Start's cleanup does
	restartedAt := time.Now()
	if h, _ := svc2.Usage(ctx, sb.ID, time.Time{}, restartedAt); len(h) != 0 {
		t.Errorf("%d samples from before the restart", len(h))
	}
	again := latest(t, svc2, restartedAt)
	t.Logf("after the restart: %+v", again)
	if again.CPU < after.CPU || again.NetTx < after.NetTx {
		t.Errorf("counters went back across the restart: CPU %s -> %s, out %d -> %d", after.CPU, again.CPU, after.NetTx, again.NetTx)
	}
}
