package integration

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agent/agenttest"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/network/nettest"
)

// TestRepeatedRounds checks that pause/resume and snapshot/rollback keep a
// sandbox byte-exact, round after round, on every runtime (runc, gVisor,
// VM): 2 rounds of each (CUBE_ROUNDS=100 for the long form;
// CUBE_ROUNDS_RUNTIMES=gvisor,vm picks runtimes).
//
// Each round writes a random file through the agent's /files and starts a
// process that holds a random buffer only in its memory (generated in the
// sandbox, its digest noted when it starts); the agent's memory holds the
// round's value too.
//   - pause/resume: after the resume the file reads back byte-exact (over
//     /files and by sha256sum in the sandbox), the process still holds its
//     buffer (the digest it computes now is the one it noted at start), and
//     the agent its value.
//   - snapshot/rollback: the round's state is snapshotted, then file,
//     buffer and agent memory are all changed; after the rollback the file
//     is the snapshot's, and where the snapshot holds memory (gVisor, VM)
//     the snapshot's process is back with the snapshot's buffer and the
//     agent with the snapshot's value. runc snapshots are disk-only: the
//     file is checked.
func TestRepeatedRounds(t *testing.T) {
	cubelettest.RequireRoot(t)
	rounds := 2
	if v, err := strconv.Atoi(os.Getenv("CUBE_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	runtimes := []string{"runc", "gvisor", "vm"}
	if v := os.Getenv("CUBE_ROUNDS_RUNTIMES"); v != "" {
		runtimes = strings.Split(v, ",")
	}
	for _, rt := range runtimes {
		t.Run(rt, func(t *testing.T) { repeatedRounds(t, rt, rounds) })
	}
}

func repeatedRounds(t *testing.T, runtime string, rounds int) {
	ctx := context.Background()
	var env *cubelettest.Env
	var svc *cubelet.Service
	switch runtime {
	case "vm":
		env, svc = vmEnv(t, "")
	case "gvisor":
		requireRunsc(t)
		fallthrough
	default:
		env = cubelettest.New(t, "")
		env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
		svc = env.Start(t)
		env.ImportBusybox(t, svc, "busybox")
	}
	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "rr-" + runtime, Runtime: runtime})
	defer func() {
		if _, err := svc.Delete(ctx, a.ID); err != nil {
			t.Error(err)
		}
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
		assertSnapshotFiles(t, env, svc)
		env.AssertNoLeaks(t)
	}()

	begin := time.Now()
	for i := range rounds {
		v := fmt.Sprintf("pause-%d", i)
		file := writePayload(t, svc, a.ID)
		buf := holdBuffer(t, svc, a.ID)
		setMemory(t, svc, a.ID, map[string]string{"SECRET": v})
		if _, err := svc.Pause(ctx, a.ID); err != nil {
			t.Fatalf("round %d: pause: %v", i, err)
		}
		mustState(t, svc, a.ID, lifecycle.Paused)
		if _, err := svc.Resume(ctx, a.ID); err != nil {
			t.Fatalf("round %d: resume: %v", i, err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		agentReady(t, svc, a.ID)
		checkPayload(t, svc, a.ID, file)
		checkBuffer(t, svc, a.ID, buf)
		wantMemory(t, svc, a.ID, map[string]string{"SECRET": v})
	}
	t.Logf("%s: %d pause/resume rounds took %s", runtime, rounds, time.Since(begin).Round(time.Millisecond))

	begin = time.Now()
	prev := ""
	for i := range rounds {
		v := fmt.Sprintf("snap-%d", i)
		file := writePayload(t, svc, a.ID)
		buf := holdBuffer(t, svc, a.ID)
		setMemory(t, svc, a.ID, map[string]string{"SECRET": v})
		sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: a.ID, SnapshotID: fmt.Sprintf("rr-%s-%d", runtime, i)})
		if want := runtime != "runc"; sn.HasMemory != want {
			t.Fatalf("round %d: snapshot has memory %v, want %v", i, sn.HasMemory, want)
		}
		// Dirty everything the rollback must undo.
		writePayload(t, svc, a.ID)
		holdBuffer(t, svc, a.ID)
		setMemory(t, svc, a.ID, map[string]string{"SECRET": "dirty"})
		if _, err := svc.Rollback(ctx, cubelet.RollbackRequest{SandboxID: a.ID, SnapshotID: sn.ID}); err != nil {
			t.Fatalf("round %d: rollback: %v", i, err)
		}
		mustState(t, svc, a.ID, lifecycle.Running)
		agentReady(t, svc, a.ID)
		checkPayload(t, svc, a.ID, file)
		if sn.HasMemory {
			checkBuffer(t, svc, a.ID, buf)
			wantMemory(t, svc, a.ID, map[string]string{"SECRET": v})
		}
		// The previous round's snapshot is no longer the sandbox's source.
		if prev != "" {
			if err := svc.DeleteSnapshot(ctx, prev); err != nil {
				t.Fatalf("round %d: delete snapshot %s: %v", i, prev, err)
			}
		}
		prev = sn.ID
	}
	t.Logf("%s: %d snapshot/rollback rounds took %s", runtime, rounds, time.Since(begin).Round(time.Millisecond))
}

const payloadFile = "/root/payload.bin"

// agentReady waits (up to 3 minutes: a TCG VM under load is slow) for the
// agent to answer /health at the sandbox's slot address, on any runtime.
func agentReady(t *testing.T, svc *cubelet.Service, id string) {
	t.Helper()
	c := agentClient()
	defer c.CloseIdleConnections()
	if err := agenttest.WaitHealthy(context.Background(), c, agentURL(t, svc, id, ""), 3*time.Minute); err != nil {
		t.Fatalf("agent of %s: %v", id, err)
	}
}

// writePayload uploads 64 KiB of random bytes to payloadFile through the
// agent's /files and returns them.
func writePayload(t *testing.T, svc *cubelet.Service, id string) []byte {
	t.Helper()
	p := make([]byte, 64<<10)
	_, _ = rand.Read(p)
	c := agentClient()
	defer c.CloseIdleConnections()
	req, _ := http.NewRequest(http.MethodPost, agentURL(t, svc, id, "/files?username=root&path="+payloadFile), bytes.NewReader(p))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("upload to %s: %v", id, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("upload to %s: %d %s", id, resp.StatusCode, body)
	}
	return p
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// checkPayload reads payloadFile back over /files and has the sandbox
// digest it: both must be want, byte for byte.
func checkPayload(t *testing.T, svc *cubelet.Service, id string, want []byte) {
	t.Helper()
	c := agentClient()
	defer c.CloseIdleConnections()
	resp, err := c.Get(agentURL(t, svc, id, "/files?username=root&path="+payloadFile))
	if err != nil {
		t.Fatalf("download from %s: %v", id, err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !bytes.Equal(got, want) {
		t.Fatalf("%s: %s holds %d bytes (sha256 %s, status %d), want %d (sha256 %s)", id, payloadFile, len(got), sha(got), resp.StatusCode, len(want), sha(want))
	}
	if sum, _, _ := strings.Cut(shell(t, svc, id, "sha256sum "+payloadFile), " "); sum != sha(want) {
		t.Fatalf("%s: sha256sum in the sandbox says %s, want %s", id, sum, sha(want))
	}
}

// holdBuffer replaces the sandbox's buffer holder: a process that fills a
// shell variable with 256 KiB of random bytes (hex, 512 KiB), notes its
// digest, and on request (/tmp/ask) digests it again into /tmp/m. It
// returns the noted digest; only the process's memory holds the buffer.
func holdBuffer(t *testing.T, svc *cubelet.Service, id string) string {
	t.Helper()
	// The marker tells the holder from any other sh (a pid noted before a
	// disk-only rollback may be anyone's now).
	script := `for p in $(cat /root/holder.pid 2>/dev/null); do grep -q cube-holder /proc/$p/cmdline 2>/dev/null && kill $p; done
rm -f /tmp/m /tmp/ask /tmp/m0
(: cube-holder; v=$(head -c 262144 /dev/urandom | od -An -vtx1 | tr -d ' \n'); echo "$v" | sha256sum > /tmp/m0
 while :; do if [ -e /tmp/ask ]; then echo "$v" | sha256sum > /tmp/m.new && mv /tmp/m.new /tmp/m && rm -f /tmp/ask; fi; sleep 0.1; done) </dev/null >/dev/null 2>&1 &
echo $! > /root/holder.pid
for i in $(seq 600); do [ -s /tmp/m0 ] && break; sleep 0.1; done; cat /tmp/m0`
	sum, _, _ := strings.Cut(shell(t, svc, id, script), " ")
	if len(sum) != 64 {
		t.Fatalf("%s: the buffer holder did not start: %q", id, sum)
	}
	return sum
}

// checkBuffer asks the holder to digest its buffer again.
func checkBuffer(t *testing.T, svc *cubelet.Service, id, want string) {
	t.Helper()
	out := shell(t, svc, id, `rm -f /tmp/m; touch /tmp/ask; for i in $(seq 300); do [ -s /tmp/m ] && break; sleep 0.1; done; cat /tmp/m 2>/dev/null; true`)
	if sum, _, _ := strings.Cut(out, " "); sum != want {
		t.Fatalf("%s: the process's in-memory buffer digests to %q, want %s", id, out, want)
	}
}
