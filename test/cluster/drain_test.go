package cluster_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cli"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore"
	cluster "github.com/cubesandbox/cube/test/cluster/clusterenv"
)

// storeList lists the snapshots in the cluster's object store.
func storeList(t *testing.T, c *cluster.Cluster) []string {
	t.Helper()
	srv := c.Store.Server
	st, err := objstore.Open(objstore.Config{Endpoint: srv.Endpoint, Bucket: srv.Bucket, AccessKeyFile: srv.AccessKeyFile, SecretKeyFile: srv.SecretKeyFile})
	if err != nil {
		t.Fatal(err)
	}
	ids, err := st.List(context.Background())
	if err != nil {
		t.Fatalf("list the object store: %v", err)
	}
	return ids
}

// envdClient reaches sandbox id's envd through proxy p with its token.
func envdClient(c *cluster.Cluster, p *cluster.Proxy, id, token string) processconnect.ProcessClient {
	hc := &http.Client{Timeout: 30 * time.Second, Transport: headerTransport{id: id, port: "49983", token: token, rt: &http.Transport{TLSClientConfig: c.ServerTLS()}}}
	return processconnect.NewProcessClient(hc, p.URL)
}

// sh runs a shell script in the sandbox through envd and returns its
// standard output.
func sh(ctx context.Context, pc processconnect.ProcessClient, script string) (string, error) {
	s, err := pc.Start(ctx, connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}}))
	if err != nil {
		return "", err
	}
	defer s.Close()
	var out, errOut bytes.Buffer
	status := ""
	for s.Receive() {
		ev := s.Msg().GetEvent()
		if d := ev.GetData(); d != nil {
			out.Write(d.GetStdout())
			errOut.Write(d.GetStderr())
		}
		if e := ev.GetEnd(); e != nil && e.GetExitCode() != 0 {
			status = e.GetStatus()
		}
	}
	if err := s.Err(); err != nil {
		return out.String(), err
	}
	if status != "" {
		return out.String(), fmt.Errorf("%q: %s: %s", script, status, strings.TrimSpace(errOut.String()))
	}
	return out.String(), nil
}

// drainN is how many sandboxes the drain case puts on the node it drains:
// CUBE_CLUSTER_DRAIN_N (the long form: 20), else 6.
func drainN(t *testing.T) int {
	if v := os.Getenv("CUBE_CLUSTER_DRAIN_N"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 2 {
			t.Fatalf("CUBE_CLUSTER_DRAIN_N=%q: want a number of sandboxes >= 2", v)
		}
		return n
	}
	return 6
}

// drainVMs is how many VM sandboxes the drain case adds when the nodes
// run the vm runtime: CUBE_CLUSTER_DRAIN_VM, else 2 (one running, one
// paused: every other one is paused). QEMU runs TCG here, so each VM
// costs seconds of both cores to boot, snapshot and restore.
func drainVMs(t *testing.T, c *cluster.Cluster) int {
	if !c.VM {
		t.Logf("the nodes run no vm runtime: the drain moves no VM")
		return 0
	}
	if v := os.Getenv("CUBE_CLUSTER_DRAIN_VM"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			t.Fatalf("CUBE_CLUSTER_DRAIN_VM=%q: want a number of VM sandboxes >= 0", v)
		}
		return n
	}
	return 2
}

// drained is one sandbox of the drain case and what its client saw.
type drained struct {
	id, token, runtime, state string
	// pid is a process started before the drain: it runs after the move
	// where the runtime moves memory (gVisor, VM), not where only the
	// disk moves (runc).
	pid string

	ok, failed atomic.Int64
	mu         sync.Mutex
	gap        time.Duration
	lastErr    string
	// cut are the reads answered 502: a request cut where the sandbox
	// was (the move waits for those in flight before it freezes).
	cut []string
}

// drain fills node 1 with drainN sandboxes, half runc and half gVisor
// (gVisor with memory snapshots: [gvisor] checkpoint on the nodes; runc
// only where runsc is missing), a third of them paused, plus drainVMs VM
// sandboxes (every other one paused) where the nodes run the vm runtime,
// each with a file written and a process started through proxy p1. Then node 1 is drained
// with `cubecli node drain` (in-process, against a replica's admin
// socket) while a client per running sandbox reads its file through p1
// every 250 ms. Every sandbox must end on another node under the same ID,
// in the state it had, its file read through proxy p2 at the same URL
// (a paused one after an E2B connect resumes it there); a gVisor or VM
// one's process still runs (its memory moved), a runc one's does not (the
// disk alone moves: the control that shows the process probe can fail). Node
// 1 must hold no sandbox, in the catalog or on its cubelet. Each client's
// failed reads and longest gap between good reads are logged: what its
// users saw of the move.
func drain(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	n1 := c.Nodes[0]
	n := drainN(t)
	runtimes := []string{"runc"}
	if _, err := exec.LookPath("runsc"); err == nil {
		runtimes = append(runtimes, "gvisor")
	} else {
		t.Logf("runsc not found: the drain moves runc sandboxes only")
	}
	var sbs []*drained
	began := time.Now()
	for i, rt := range runtimes {
		count := n / len(runtimes)
		if i == 0 {
			count += n % len(runtimes)
		}
		ids, tokens := onNodeN(t, c, apis[0], n1, cluster.Template, `,"runtime":"`+rt+`"`, count)
		for j, id := range ids {
			t.Cleanup(func() { kill(t, apis[0], id) })
			sbs = append(sbs, &drained{id: id, token: tokens[j], runtime: rt, state: "running"})
		}
	}
	for i, d := range sbs {
		if i%3 == 2 {
			d.state = "paused"
		}
	}
	if vms := drainVMs(t, c); vms > 0 {
		ids, tokens := onNodeN(t, c, apis[0], n1, cluster.Template, `,"runtime":"vm"`, vms)
		for j, id := range ids {
			t.Cleanup(func() { kill(t, apis[0], id) })
			d := &drained{id: id, token: tokens[j], runtime: "vm", state: "running"}
			if j%2 == 1 {
				d.state = "paused"
			}
			sbs = append(sbs, d)
		}
	}
	t.Logf("%d sandboxes on %s in %s", len(sbs), n1.ID, time.Since(began).Round(time.Millisecond))
	ctx := context.Background()
	t.Cleanup(func() {
		if _, err := c.AdminOf(t).SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: n1.ID, Schedulable: true}); err != nil {
			t.Errorf("uncordon %s: %v", n1.ID, err)
		}
	})
	note := func(d *drained) string { return "written before the drain in " + d.id }
	// probe says whether d's process runs: its whole command line must be
	// the sleep's (the probe's own processes, which may reuse the PID
	// after a cold start, differ).
	probe := func(pc processconnect.ProcessClient, d *drained) (string, error) {
		out, err := sh(ctx, pc, `case "$(cat /proc/`+d.pid+`/cmdline 2>/dev/null | tr '\0' ' ')" in "sleep 864""00 ") echo alive;; *) echo gone;; esac`)
		return strings.TrimSpace(out), err
	}
	for _, d := range sbs {
		out, err := sh(ctx, envdClient(c, c.Proxies[0], d.id, d.token),
			"echo '"+note(d)+"' > $HOME/note && sync && (sleep 86400 >/dev/null 2>&1 & echo $!)")
		if err != nil {
			t.Fatalf("%s sandbox %s: write the file and start a process through %s: %v", d.runtime, d.id, c.Proxies[0].Host.Name, err)
		}
		d.pid = strings.TrimSpace(out)
		if alive, err := probe(envdClient(c, c.Proxies[0], d.id, d.token), d); err != nil || alive != "alive" {
			t.Fatalf("%s sandbox %s: the probe does not see process %s before the drain: %q %v", d.runtime, d.id, d.pid, alive, err)
		}
		if d.state == "paused" {
			if r := apis[0].Do(t, http.MethodPost, "/sandboxes/"+d.id+"/pause", nil, nil); r.StatusCode/100 != 2 {
				t.Fatalf("pause %s: %s %s", d.id, r.Status, r.Body)
			}
		}
	}

	// A client per running sandbox reads its file through the route all
	// along.
	stop := make(chan struct{})
	var clients sync.WaitGroup
	for _, d := range sbs {
		if d.state != "running" {
			continue
		}
		clients.Add(1)
		go func() {
			defer clients.Done()
			pc := envdClient(c, c.Proxies[0], d.id, d.token)
			last := time.Now()
			for {
				select {
				case <-stop:
					return
				case <-time.After(250 * time.Millisecond):
				}
				rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				out, err := sh(rctx, pc, "cat $HOME/note")
				cancel()
				d.mu.Lock()
				if err == nil && strings.TrimSpace(out) == note(d) {
					d.ok.Add(1)
					d.gap = max(d.gap, time.Since(last))
					last = time.Now()
				} else {
					d.failed.Add(1)
					if err != nil {
						d.lastErr = err.Error()
						if strings.Contains(err.Error(), "502") {
							d.cut = append(d.cut, time.Now().Format("15:04:05.000")+" "+err.Error())
						}
					} else {
						d.lastErr = "read " + out
					}
				}
				d.mu.Unlock()
			}
		}()
	}
	time.Sleep(time.Second)

	var out bytes.Buffer
	root := cli.NewRoot(&out)
	args := []string{"--master", c.Masters[0].Socket, "node", "drain", n1.ID}
	if p := os.Getenv("CUBE_CLUSTER_DRAIN_PARALLEL"); p != "" {
		args = append(args, "--parallel", p)
	}
	root.SetArgs(args)
	began = time.Now()
	err := root.Execute()
	took := time.Since(began)
	time.Sleep(time.Second) // the clients read from the new nodes a few times
	close(stop)
	clients.Wait()
	t.Logf("cubecli node drain %s of %d sandboxes (%d runc, %d gVisor, %d VM; %d paused): %s:\n%s", n1.ID, len(sbs),
		countOf(sbs, func(d *drained) bool { return d.runtime == "runc" }), countOf(sbs, func(d *drained) bool { return d.runtime == "gvisor" }),
		countOf(sbs, func(d *drained) bool { return d.runtime == "vm" }),
		countOf(sbs, func(d *drained) bool { return d.state == "paused" }), took.Round(time.Millisecond), out.String())
	if err != nil {
		// The clients' view and every sandbox's fate are still worth
		// reporting: the checks below name the ones left.
		t.Errorf("cubecli node drain: %v", err)
	}
	if !strings.Contains(out.String(), "moved") || (err == nil && !strings.Contains(out.String(), "drained")) {
		t.Errorf("drain output shows no move or no end")
	}
	var worst time.Duration
	for _, d := range sbs {
		if d.state != "running" {
			continue
		}
		d.mu.Lock()
		t.Logf("client of %s sandbox %s through %s: %d reads ok, %d failed (last: %s), longest gap between good reads %s",
			d.runtime, d.id, c.Proxies[0].Host.Name, d.ok.Load(), d.failed.Load(), d.lastErr, d.gap.Round(time.Millisecond))
		worst = max(worst, d.gap)
		if d.ok.Load() == 0 {
			t.Errorf("the client of sandbox %s never read its file during the drain", d.id)
		}
		// Each read is an envd Process/Start (a POST the proxy does not
		// send again once its headers went out): one in flight at the
		// freeze would be cut (502) had the move not waited for it.
		if len(d.cut) > 0 {
			t.Errorf("the client of %s sandbox %s had %d reads answered 502 (cut by the move): %s", d.runtime, d.id, len(d.cut), strings.Join(d.cut, "; "))
		}
		d.mu.Unlock()
	}
	t.Logf("longest gap any client saw: %s", worst.Round(time.Millisecond))

	rows := map[string]*masterpb.Sandbox{}
	per := map[string]int{}
	for _, sb := range c.Sandboxes(t) {
		rows[sb.SandboxId] = sb
		if sb.NodeId == n1.ID {
			t.Errorf("catalog: sandbox %s (%s) still on drained node %s", sb.SandboxId, sb.State, n1.ID)
		}
	}
	for _, d := range sbs {
		sb := rows[d.id]
		if sb == nil {
			t.Errorf("sandbox %s gone after the drain", d.id)
			continue
		}
		per[sb.NodeId]++
		if sb.State != d.state || sb.NodeId == n1.ID {
			t.Errorf("%s sandbox %s is %s on %s after the drain, want %s on another node", d.runtime, d.id, sb.State, sb.NodeId, d.state)
		}
	}
	t.Logf("the sandboxes went to %v", per)
	if left := n1.SandboxIDs(t); len(left) != 0 {
		t.Errorf("drained node %s's cubelet holds %v", n1.ID, left)
	}
	// The masters export at pause: the store ends with the paused
	// sandboxes' exports from their new nodes, nothing of the moves (their
	// snapshots go once each move answered).
	paused := countOf(sbs, func(d *drained) bool { return d.state == "paused" })
	mastertest.WaitFor(t, 30*time.Second, "the store to hold the paused sandboxes' exports only", func() bool { return len(storeList(t, c)) == paused })

	for _, d := range sbs {
		if d.state == "paused" {
			began := time.Now()
			if r := apis[1].Do(t, http.MethodPost, "/sandboxes/"+d.id+"/connect", `{"timeout":600}`, nil); r.StatusCode/100 != 2 {
				t.Errorf("connect to paused %s sandbox %s after the drain: %s %s", d.runtime, d.id, r.Status, r.Body)
				continue
			}
			t.Logf("paused %s sandbox %s resumed on its new node by an E2B connect in %s", d.runtime, d.id, time.Since(began).Round(time.Millisecond))
		}
		pc := envdClient(c, c.Proxies[1], d.id, d.token)
		got, err := sh(ctx, pc, "cat $HOME/note")
		if err != nil || strings.TrimSpace(got) != note(d) {
			t.Errorf("%s sandbox %s: the file through %s after the move: %q %v", d.runtime, d.id, c.Proxies[1].Host.Name, got, err)
			continue
		}
		alive, err := probe(pc, d)
		switch {
		case err != nil:
			t.Errorf("%s sandbox %s: probe process %s: %v", d.runtime, d.id, d.pid, err)
		case (d.runtime == "gvisor" || d.runtime == "vm") && alive != "alive":
			t.Errorf("%s sandbox %s: process %s started before the move is %s after it: its memory did not move", d.runtime, d.id, d.pid, alive)
		case d.runtime == "runc" && alive != "gone":
			t.Errorf("runc sandbox %s: process %s started before the move is %s after it; a runc move carries the disk only", d.id, d.pid, alive)
		default:
			t.Logf("%s sandbox %s (%s before the drain) on %s: file read through %s, process %s %s", d.runtime, d.id, d.state, rows[d.id].NodeId, c.Proxies[1].Host.Name, d.pid, alive)
		}
	}
}

func countOf(sbs []*drained, f func(*drained) bool) int {
	n := 0
	for _, d := range sbs {
		if f(d) {
			n++
		}
	}
	return n
}

// sdkDrain: the unmodified E2B JS SDK (test/e2e/node/move.test.mjs) makes
// a sandbox through replica m1 and proxy p1, writes a file and pauses it;
// the sandbox's node is drained through replica m2's admin API; then, in
// a second run through m2 and proxy p2, Sandbox.connect resumes it on the
// node it moved to, under the same ID, with its file.
func sdkDrain(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client, key string) {
	node, dir := nodeSDK(t)
	idFile := filepath.Join(t.TempDir(), "id")
	run := func(api int, p *cluster.Proxy, env ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, node, "--test", "--test-concurrency=1", "--test-reporter=spec", "move.test.mjs")
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), append(env,
			"E2B_API_URL="+apis[api].Base, "E2B_SANDBOX_URL="+p.URL, "E2B_API_KEY="+key, "E2B_DOMAIN="+cluster.Domain,
			"CUBE_E2E_TEMPLATE="+cluster.Template, "CUBE_MOVE_OUT="+idFile,
			"NODE_EXTRA_CA_CERTS="+c.CAFile(), "NODE_OPTIONS=--import="+c.NodeResolver(t, p))...)
		began := time.Now()
		out, err := cmd.CombinedOutput()
		t.Logf("move.test.mjs %v against %s and %s in %s:\n%s", env, apis[api].Base, p.URL, time.Since(began).Round(time.Millisecond), out)
		if err != nil {
			t.Fatalf("move.test.mjs %v: %v", env, err)
		}
	}
	run(0, c.Proxies[0], "CUBE_MOVE_PHASE=pause")
	b, err := os.ReadFile(idFile)
	if err != nil {
		t.Fatal(err)
	}
	id := string(b)
	t.Cleanup(func() { kill(t, apis[0], id) })
	from := ""
	for _, sb := range c.Sandboxes(t) {
		if sb.SandboxId == id {
			from = sb.NodeId
		}
	}
	if from == "" {
		t.Fatalf("sandbox %s not in the catalog", id)
	}
	ctx := context.Background()
	t.Cleanup(func() {
		if _, err := c.AdminOf(t).SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: from, Schedulable: true}); err != nil {
			t.Errorf("uncordon %s: %v", from, err)
		}
	})
	began := time.Now()
	st, err := c.Masters[1].Admin.DrainNode(ctx, &masterpb.DrainNodeRequest{NodeId: from})
	if err != nil {
		t.Fatal(err)
	}
	for {
		p, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("drain %s through %s: %v", from, c.Masters[1].Replica, err)
		}
		t.Logf("drain %s: %s %s %s -> %s %s %s", from, p.SandboxId, p.State, p.Phase, p.ToNode, p.Took.AsDuration().Round(time.Millisecond), p.Error)
	}
	t.Logf("node %s drained through %s in %s", from, c.Masters[1].Replica, time.Since(began).Round(time.Millisecond))
	var now *masterpb.Sandbox
	for _, sb := range c.Sandboxes(t) {
		if sb.SandboxId == id {
			now = sb
		}
	}
	if now == nil || now.State != "paused" || now.NodeId == from {
		t.Fatalf("after the drain, sandbox %s: %v, want paused on another node than %s", id, now, from)
	}
	run(1, c.Proxies[1], "CUBE_MOVE_PHASE=connect", "CUBE_MOVE_ID="+id)
	t.Logf("the SDK's sandbox %s paused on %s, drained to %s, resumed there by Sandbox.connect with its file", id, from, now.NodeId)
}

// nodeLoss (masters with store.export_on_pause): a running sandbox and a
// paused one (a file written, its snapshot exported as it paused) on
// node 2, whose host is then lost (daemons SIGKILLed, link cut). The
// running one is reported failed through the E2B API, and connecting to
// it answers 409 naming the lost node; the paused one stays paused, and
// an E2B connect resumes it on another node under the same ID, its file
// read through a proxy at the same URL. When the host comes back, its
// copy of the moved sandbox is destroyed and the failed one runs again.
func nodeLoss(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	victim := c.Nodes[1]
	running, _ := onNode(t, c, apis[0], victim, "")
	t.Cleanup(func() { kill(t, apis[0], running) })
	paused, token := onNode(t, c, apis[0], victim, "")
	t.Cleanup(func() { kill(t, apis[0], paused) })
	ctx := context.Background()
	const note = "written before the node was lost"
	if _, err := sh(ctx, envdClient(c, c.Proxies[0], paused, token), "echo '"+note+"' > $HOME/note && sync"); err != nil {
		t.Fatal(err)
	}
	before := storeList(t, c)
	began := time.Now()
	if r := apis[0].Do(t, http.MethodPost, "/sandboxes/"+paused+"/pause", nil, nil); r.StatusCode/100 != 2 {
		t.Fatalf("pause: %s %s", r.Status, r.Body)
	}
	t.Logf("pause with export at pause: %s", time.Since(began).Round(time.Millisecond))
	after := storeList(t, c)
	if len(after) != len(before)+1 {
		t.Fatalf("store after the pause: %v, before %v: want one more, the pause's export", after, before)
	}

	lost := time.Now()
	victim.Lose(t)
	state := func(id string) string {
		var got struct {
			State string `json:"state"`
		}
		r := apis[1].Do(t, http.MethodGet, "/sandboxes/"+id, nil, &got)
		if r.StatusCode != http.StatusOK {
			return r.Status
		}
		return got.State
	}
	mastertest.WaitFor(t, 30*time.Second, "the lost node's running sandbox to leave running", func() bool { return state(running) != "running" })
	t.Logf("host %s lost: its running sandbox is %q (E2B GET) %s later", victim.ID, state(running), time.Since(lost).Round(time.Millisecond))
	time.Sleep(time.Second)
	if s := state(paused); s != "paused" {
		t.Fatalf("the lost node's exported paused sandbox is %q, want paused", s)
	}
	r := apis[1].Do(t, http.MethodPost, "/sandboxes/"+running+"/connect", `{"timeout":60}`, nil)
	t.Logf("E2B connect to the lost running sandbox: %s %s", r.Status, r.Body)
	if r.StatusCode != http.StatusConflict || !strings.Contains(string(r.Body), "lost") {
		t.Errorf("connect to the lost running sandbox: %s %s, want 409 naming the lost node", r.Status, r.Body)
	}

	began = time.Now()
	r = apis[1].Do(t, http.MethodPost, "/sandboxes/"+paused+"/connect", `{"timeout":600}`, nil)
	if r.StatusCode != http.StatusCreated {
		t.Fatalf("connect to the paused sandbox of the lost node: %s %s", r.Status, r.Body)
	}
	restored := time.Since(began)
	var now *masterpb.Sandbox
	for _, sb := range c.Sandboxes(t) {
		if sb.SandboxId == paused {
			now = sb
		}
	}
	if now == nil || now.State != "running" || now.NodeId == victim.ID {
		t.Fatalf("after the restore: %v", now)
	}
	got, err := sh(ctx, envdClient(c, c.Proxies[1], paused, token), "cat $HOME/note")
	if err != nil || strings.TrimSpace(got) != note {
		t.Fatalf("file through %s after the restore: %q %v", c.Proxies[1].Host.Name, got, err)
	}
	t.Logf("sandbox %s restored from %s (lost) on %s by an E2B connect in %s; its file read through %s",
		paused, victim.ID, now.NodeId, restored.Round(time.Millisecond), c.Proxies[1].Host.Name)
	if ids := storeList(t, c); len(ids) != len(before) {
		t.Errorf("store after the restore: %v, want as before the pause: %v", ids, before)
	}

	victim.Return(t)
	mastertest.WaitFor(t, 30*time.Second, "the returned node to drop its copy of the restored sandbox and run the other again", func() bool {
		for _, id := range victim.SandboxIDs(t) {
			if id == paused {
				return false
			}
		}
		return state(running) == "running"
	})
	t.Logf("host %s back: its copy of %s destroyed, %s running again", victim.ID, paused, running)
}
