package cluster_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/test/cluster"
)

type created struct {
	SandboxID string `json:"sandboxID"`
}

// create makes a sandbox through the E2B API of one replica.
func create(c *mastertest.Client) (string, *mastertest.Response, error) {
	req, err := http.NewRequest(http.MethodPost, c.Base+"/sandboxes", strings.NewReader(`{"templateID":"`+cluster.Template+`","timeout":600}`))
	if err != nil {
		return "", nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	var out created
	r, err := c.Try(req, &out)
	if err != nil {
		return "", nil, err
	}
	if r.StatusCode/100 != 2 {
		return "", r, errors.New(r.Status + ": " + string(r.Body))
	}
	return out.SandboxID, r, nil
}

func kill(t *testing.T, c *mastertest.Client, id string) {
	t.Helper()
	r := c.Do(t, http.MethodDelete, "/sandboxes/"+id, nil, nil)
	if r.StatusCode/100 != 2 && r.StatusCode != http.StatusNotFound {
		t.Errorf("kill %s: %s %s", id, r.Status, r.Body)
	}
}

// TestCluster builds a cluster of three node hosts, a MariaDB host, two
// cubemaster hosts and two cubeproxy hosts on a bridge, and runs the
// cluster cases on it in order (one cluster: building it is most of the
// time).
func TestCluster(t *testing.T) {
	start := time.Now()
	c := cluster.Start(t, cluster.Options{})
	t.Logf("cluster %s up in %s: bridge %s, db %s, masters %s, proxies %d, nodes %d",
		c.ID, time.Since(start).Round(time.Millisecond), c.Bridge, c.DB.Host.IP, c.MasterAddrs(), len(c.Proxies), len(c.Nodes))
	key := c.APIKey(t)
	apis := []*mastertest.Client{c.Masters[0].API(key), c.Masters[1].API(key)}

	t.Run("register", func(t *testing.T) {
		// Every replica knows every node over TCP with mTLS, whichever
		// replica the node reports to.
		for _, m := range c.Masters {
			resp, err := m.Admin.ListNodes(context.Background(), &masterpb.ListNodesRequest{})
			if err != nil {
				t.Fatal(err)
			}
			have := map[string]string{}
			for _, n := range resp.Nodes {
				if n.Healthy {
					have[n.Report.NodeId] = n.Report.Address
				}
			}
			for _, n := range c.Nodes {
				addr, ok := have[n.ID]
				if !ok || !strings.HasPrefix(addr, n.Host.IP+":") {
					t.Errorf("replica %s: node %s healthy at %q, want at %s", m.Replica, n.ID, addr, n.Host.IP)
				}
			}
			t.Logf("replica %s: nodes %v", m.Replica, have)
		}
	})

	t.Run("spread", func(t *testing.T) {
		// Creates through either replica's E2B API land on every node.
		const n = 6
		var ids []string
		t.Cleanup(func() {
			for _, id := range ids {
				kill(t, apis[0], id)
			}
		})
		began := time.Now()
		for i := 0; i < n; i++ {
			id, _, err := create(apis[i%2])
			if err != nil {
				t.Fatalf("create %d through %s: %v", i, c.Masters[i%2].Replica, err)
			}
			ids = append(ids, id)
		}
		t.Logf("%d creates in %s", n, time.Since(began).Round(time.Millisecond))
		per := map[string]int{}
		for _, sb := range c.Sandboxes(t, "running") {
			for _, id := range ids {
				if sb.SandboxId == id {
					per[sb.NodeId]++
				}
			}
		}
		t.Logf("placement: %v", per)
		for _, node := range c.Nodes {
			if per[node.ID] == 0 {
				t.Errorf("no sandbox on node %s (placement %v)", node.ID, per)
			}
		}
		// Each replica answers for every sandbox, whichever made it.
		for _, id := range ids {
			for i, api := range apis {
				if r := api.Do(t, http.MethodGet, "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusOK {
					t.Errorf("GET %s through %s: %s", id, c.Masters[i].Replica, r.Status)
				}
			}
		}
	})

	t.Run("leader-kill", func(t *testing.T) {
		leaderKill(t, c, apis)
	})

	t.Run("host-loss", func(t *testing.T) {
		hostLoss(t, c, apis)
	})
}

// leaderKill SIGKILLs the replica holding the loops' lease while three
// clients create sandboxes, alternating replicas and trying the other
// when theirs does not answer (as an SDK behind a load balancer would).
// No create the survivor answered may fail; the lease must move within
// about lease_ttl × 4/3; the window (kill to the first create the
// survivor acknowledged, and kill to the lease taken) is logged.
func leaderKill(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	holder := ""
	mastertest.WaitFor(t, 10*time.Second, "a lease holder", func() bool { holder = c.LeaseHolder(t); return holder != "" })
	li := 0
	if c.Masters[1].Replica == holder {
		li = 1
	}
	leader, survivor := c.Masters[li], c.Masters[1-li]
	t.Logf("lease held by %s", holder)

	var (
		mu       sync.Mutex
		ids      []string
		failures []string
		acked    atomic.Int64
		retried  atomic.Int64
		firstOK  atomic.Int64 // unix nanos of the first survivor ack after the kill
		killedAt atomic.Int64
	)
	t.Cleanup(func() {
		for _, id := range ids {
			kill(t, apis[1-li], id)
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; ctx.Err() == nil; i++ {
				for try := 0; try < 2; try++ {
					k := (i + try) % 2
					id, r, err := create(apis[k])
					var ne net.Error
					if err != nil && r == nil && (errors.As(err, &ne) || strings.Contains(err.Error(), "connection") || errors.Is(err, context.DeadlineExceeded)) {
						retried.Add(1)
						continue // that replica is gone: the other
					}
					mu.Lock()
					if err != nil {
						failures = append(failures, c.Masters[k].Replica+": "+err.Error())
					} else {
						ids = append(ids, id)
						acked.Add(1)
						if k == 1-li && killedAt.Load() != 0 && firstOK.Load() == 0 {
							firstOK.Store(time.Now().UnixNano())
						}
					}
					mu.Unlock()
					break
				}
			}
		}(w)
	}
	time.Sleep(2 * time.Second)
	before := acked.Load()
	kill := time.Now()
	killedAt.Store(kill.UnixNano())
	leader.Proc.Kill()
	var handover time.Duration
	mastertest.WaitFor(t, 15*time.Second, "the survivor to take the lease", func() bool {
		if c.LeaseHolder(t) == survivor.Replica {
			handover = time.Since(kill)
			return true
		}
		return false
	})
	time.Sleep(3 * time.Second)
	cancel()
	wg.Wait()
	firstAck := time.Duration(0)
	if f := firstOK.Load(); f != 0 {
		firstAck = time.Duration(f - kill.UnixNano())
	}
	t.Logf("SIGKILL of leader %s: lease taken by %s after %s; first create acknowledged by the survivor %s after the kill; creates acknowledged %d (%d before the kill), sent to the dead replica and retried %d, failed %d",
		leader.Replica, survivor.Replica, handover.Round(time.Millisecond), firstAck.Round(time.Millisecond), acked.Load(), before, retried.Load(), len(failures))
	for _, f := range failures {
		t.Errorf("create failed: %s", f)
	}
	if handover > 3*time.Second {
		t.Errorf("handover took %s, want within lease_ttl × 4/3 plus a renewal (< 3s)", handover)
	}
	if acked.Load() == before {
		t.Errorf("no create acknowledged after the kill")
	}
	// The dead replica comes back (for the cases after this one).
	leader.Start(t)
}

// hostLoss takes a node host away (its daemons SIGKILLed, its link
// gone) and checks that the catalog stops calling its sandboxes running
// within the masters' unhealthy window, while the other nodes' stay.
func hostLoss(t *testing.T, c *cluster.Cluster, apis []*mastertest.Client) {
	victim := c.Nodes[len(c.Nodes)-1]
	var ids []string
	t.Cleanup(func() {
		for _, id := range ids {
			kill(t, apis[0], id)
		}
	})
	on := map[string]string{}
	mastertest.WaitFor(t, 60*time.Second, "a sandbox on "+victim.ID+" and one elsewhere", func() bool {
		id, _, err := create(apis[len(ids)%2])
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		ids = append(ids, id)
		for _, sb := range c.Sandboxes(t, "running") {
			on[sb.SandboxId] = sb.NodeId
		}
		var victims, others int
		for _, id := range ids {
			if on[id] == victim.ID {
				victims++
			} else {
				others++
			}
		}
		return victims >= 1 && others >= 1
	})
	lost := time.Now()
	victim.Lose(t)
	states := func() map[string]string {
		out := map[string]string{}
		for _, sb := range c.Sandboxes(t) {
			out[sb.SandboxId] = sb.State
		}
		return out
	}
	var after time.Duration
	mastertest.WaitFor(t, 30*time.Second, "the lost node's sandboxes to leave running", func() bool {
		st := states()
		for _, id := range ids {
			if on[id] == victim.ID && st[id] == "running" {
				return false
			}
		}
		after = time.Since(lost)
		return true
	})
	st := states()
	var report []string
	for _, id := range ids {
		report = append(report, on[id]+"/"+id+"="+st[id])
		if on[id] != victim.ID && st[id] != "running" {
			t.Errorf("sandbox %s on healthy node %s is %q", id, on[id], st[id])
		}
	}
	sort.Strings(report)
	t.Logf("host %s lost: its sandboxes left running %s later; states: %v", victim.ID, after.Round(time.Millisecond), report)
	// The E2B API says so too.
	for _, id := range ids {
		if on[id] != victim.ID {
			continue
		}
		var got struct {
			State string `json:"state"`
		}
		r := apis[1].Do(t, http.MethodGet, "/sandboxes/"+id, nil, &got)
		if r.StatusCode == http.StatusOK && got.State == "running" {
			t.Errorf("E2B GET %s: still running", id)
		}
		t.Logf("E2B GET %s (lost host): %s %s", id, r.Status, got.State)
	}
}
