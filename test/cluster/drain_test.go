package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
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
	cluster "github.com/cubesandbox/cube/test/cluster/clusterenv"
)

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

// drain makes a sandbox on node 1 and writes a file in it through proxy
// p1, then drains node 1 with `cubecli node drain` (in-process, against a
// replica's admin socket) while a client reads the file through p1 every
// 100 ms. The sandbox must end on another node under the same ID, with its
// file, reached through proxy p2 at the same URL; node 1 must hold no
// sandbox, in the catalog or on its cubelet. The client's failed reads
// and its longest gap are logged: what its users saw of the move.
func drain(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	n1 := c.Nodes[0]
	id, token := onNode(t, c, apis[0], n1, "")
	t.Cleanup(func() { kill(t, apis[0], id) })
	ctx := context.Background()
	t.Cleanup(func() {
		if _, err := c.AdminOf(t).SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: n1.ID, Schedulable: true}); err != nil {
			t.Errorf("uncordon %s: %v", n1.ID, err)
		}
	})
	const note = "written before the drain"
	if _, err := sh(ctx, envdClient(c, c.Proxies[0], id, token), "echo '"+note+"' > $HOME/note && sync"); err != nil {
		t.Fatalf("write the file through %s: %v", c.Proxies[0].Host.Name, err)
	}

	// A client reading the file through the route all along.
	var ok, failed atomic.Int64
	var mu sync.Mutex
	var gap time.Duration
	var lastErr string
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		pc := envdClient(c, c.Proxies[0], id, token)
		last := time.Now()
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			out, err := sh(rctx, pc, "cat $HOME/note")
			cancel()
			if err == nil && strings.TrimSpace(out) == note {
				ok.Add(1)
				mu.Lock()
				gap = max(gap, time.Since(last))
				mu.Unlock()
				last = time.Now()
				continue
			}
			failed.Add(1)
			mu.Lock()
			if err != nil {
				lastErr = err.Error()
			} else {
				lastErr = "read " + out
			}
			mu.Unlock()
		}
	}()
	time.Sleep(500 * time.Millisecond)

	var out bytes.Buffer
	root := cli.NewRoot(&out)
	root.SetArgs([]string{"--master", c.Masters[0].Socket, "node", "drain", n1.ID})
	began := time.Now()
	err := root.Execute()
	took := time.Since(began)
	time.Sleep(time.Second) // the client reads from the new node a few times
	close(stop)
	<-done
	t.Logf("cubecli node drain %s (%s):\n%s", n1.ID, took.Round(time.Millisecond), out.String())
	if err != nil {
		t.Fatalf("cubecli node drain: %v", err)
	}
	mu.Lock()
	t.Logf("client reading through %s during the drain: %d reads ok, %d failed (last: %s), longest gap between good reads %s",
		c.Proxies[0].Host.Name, ok.Load(), failed.Load(), lastErr, gap.Round(time.Millisecond))
	mu.Unlock()
	if !strings.Contains(out.String(), "moved") || !strings.Contains(out.String(), "drained") {
		t.Errorf("drain output shows no move or no end")
	}

	var now *masterpb.Sandbox
	for _, sb := range c.Sandboxes(t) {
		if sb.NodeId == n1.ID {
			t.Errorf("catalog: sandbox %s (%s) still on drained node %s", sb.SandboxId, sb.State, n1.ID)
		}
		if sb.SandboxId == id {
			now = sb
		}
	}
	if now == nil || now.State != "running" || now.NodeId == n1.ID {
		t.Fatalf("after the drain, sandbox %s: %v", id, now)
	}
	if left := n1.SandboxIDs(t); len(left) != 0 {
		t.Errorf("drained node %s's cubelet holds %v", n1.ID, left)
	}
	got, err := sh(ctx, envdClient(c, c.Proxies[1], id, token), "cat $HOME/note")
	if err != nil || strings.TrimSpace(got) != note {
		t.Fatalf("the file through %s after the move: %q %v", c.Proxies[1].Host.Name, got, err)
	}
	t.Logf("sandbox %s moved %s -> %s; its file read through %s at the same URL", id, n1.ID, now.NodeId, c.Proxies[1].Host.Name)
	if ok.Load() == 0 {
		t.Errorf("the client never read the file during the drain")
	}
}
