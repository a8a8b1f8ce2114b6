// Package chaos soaks a whole single-node system (`cube up`, in process)
// with E2B clients while a driver SIGKILLs its daemons, then checks that
// nothing a client was told about was lost or changed and that nothing
// else exists.
package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// soak is one run's size.
type soak struct {
	clients, ops, kills int
	// spacing: the least time between a daemon's restart and its next
	// kill. The supervisor doubles a daemon's restart backoff when it dies
	// within a minute of its start.
	spacing time.Duration
}

// TestChaos: N E2B clients create, write, read and exec, pause, resume,
// snapshot, create from snapshots, fork and kill sandboxes through the
// E2B API and the route while a driver SIGKILLs cubelet, network-agent and
// cubemaster at random points (cube up's supervisor restarts them). Client
// operations may fail while a daemon is down; at the end every sandbox a
// client believes exists exists in the state it believes, with its file
// byte-exact, nothing else exists (E2B API, cubelet, snapshots) and the
// leak checker finds nothing once it is all killed.
//
// The short form (CI) runs a few dozen operations with one kill of each
// daemon on runc. CUBE_CHAOS_LONG=1 runs 1,000 operations with 24 kills on
// runc and gVisor; CUBE_CHAOS_RUNTIMES (comma-separated) and
// CUBE_CHAOS_OPS / CUBE_CHAOS_KILLS / CUBE_CHAOS_CLIENTS override.
func TestChaos(t *testing.T) {
	sz := soak{clients: 4, ops: 40, kills: 3, spacing: 0}
	runtimes := []string{"runc"}
	if os.Getenv("CUBE_CHAOS_LONG") == "1" {
		sz = soak{clients: 8, ops: 1000, kills: 24, spacing: 65 * time.Second}
		runtimes = []string{"runc", "gvisor"}
	}
	if v := os.Getenv("CUBE_CHAOS_RUNTIMES"); v != "" {
		runtimes = strings.Split(v, ",")
	}
	for _, e := range []struct {
		name string
		to   *int
	}{{"CUBE_CHAOS_OPS", &sz.ops}, {"CUBE_CHAOS_KILLS", &sz.kills}, {"CUBE_CHAOS_CLIENTS", &sz.clients}} {
		if n, err := strconv.Atoi(os.Getenv(e.name)); err == nil && n > 0 {
			*e.to = n
		}
	}
	for _, rt := range runtimes {
		t.Run(rt, func(t *testing.T) { chaos(t, rt, sz) })
	}
}

// kill is one SIGKILL the driver sent.
type kill struct {
	Daemon string
	At     float64 // seconds into the soak
	// Back: seconds until the daemon served again and the master saw the
	// node healthy.
	Back float64
}

func chaos(t *testing.T, runtime string, sz soak) {
	s := startSystem(t, runtime)
	run := "chaos" + randHex(3)
	l := newLedger()
	clients := make([]*client, sz.clients)
	for i := range clients {
		clients[i] = newClient(i, run, s, l)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// The driver kills at random operation counts (the clients are busy
	// then), a random moment after each, one daemon at a time, and waits
	// for the system to be back before the next.
	var kills []kill
	killsDone := make(chan struct{})
	go func() {
		defer close(killsDone)
		rng := mrand.New(mrand.NewPCG(uint64(time.Now().UnixNano()), 7))
		order := slices.Clone(daemons)
		rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		lastBack := map[string]time.Time{}
		for i := range sz.kills {
			at := sz.ops * (i + 1) / (sz.kills + 1)
			at += rng.IntN(max(1, sz.ops/(sz.kills+1)/2)) - sz.ops/(sz.kills+1)/4
			for l.count() < at {
				if ctx.Err() != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
			time.Sleep(time.Duration(rng.IntN(500)) * time.Millisecond)
			name := order[i%len(order)]
			if i >= len(order) {
				// A daemon that has run long enough for the supervisor to
				// restart it within a second (it doubles the backoff of
				// one that dies within a minute of its start).
				var rested []string
				for len(rested) == 0 {
					for _, d := range daemons {
						if time.Since(lastBack[d]) > sz.spacing {
							rested = append(rested, d)
						}
					}
					if len(rested) == 0 {
						if ctx.Err() != nil {
							return
						}
						time.Sleep(100 * time.Millisecond)
					}
				}
				name = rested[rng.IntN(len(rested))]
			}
			k := kill{Daemon: name, At: time.Since(l.begin).Seconds()}
			pid, err := s.kill(name)
			if err != nil {
				t.Errorf("kill %d: %v", i, err)
				return
			}
			t.Logf("chaos: SIGKILL %s (pid %d) after %d operations", name, pid, l.count())
			back, err := s.waitUp(ctx, 3*time.Minute)
			if err != nil {
				t.Errorf("after killing %s: %v", name, err)
				return
			}
			k.Back = back.Seconds()
			lastBack[name] = time.Now()
			kills = append(kills, k)
		}
	}()

	var wg sync.WaitGroup
	for _, c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-killsDone:
					if l.count() >= sz.ops {
						return
					}
				default:
				}
				c.step()
				c.pace()
			}
		}()
	}
	wg.Wait()
	soakTime := time.Since(l.begin)
	if t.Failed() {
		return
	}

	// The end state: the system is whole again, and what the clients
	// believe is what exists.
	if _, err := s.waitUp(context.Background(), 3*time.Minute); err != nil {
		t.Fatal(err)
	}
	for _, c := range clients {
		for _, sb := range slices.Clone(c.sbs) {
			deadline := time.Now().Add(2 * time.Minute)
			for sb.uncertain && !c.resolve(sb) {
				if time.Now().After(deadline) {
					t.Fatalf("%s: state still unknown after 2m", sb.id)
				}
			}
		}
	}
	final(t, s, clients, l)
	// The findings of the soak: every byte mismatch and lost sandbox.
	for _, f := range l.findings {
		t.Errorf("finding: %s", f)
	}

	figures, _ := json.MarshalIndent(map[string]any{
		"runtime": runtime, "clients": sz.clients, "operations": l.count(), "seconds": soakTime.Seconds(),
		"kills": kills, "ops": l.ops, "late kills": l.lateKills, "findings": len(l.findings),
	}, "", "  ")
	t.Logf("chaos figures:\n%s", figures)
}

// view is what the system holds: sandboxes (E2B API and cubelet) and
// snapshots (E2B API), by ID.
type view struct {
	api      map[string]string // sandbox ID -> its metadata tag
	node     map[string]*cubeletpb.Sandbox
	snaps    map[string]string // snapshot ID -> name
	nodeSnap int
	onlyNode []string // snapshot IDs cubelet holds and the API does not list
}

func (s *system) look(c *client) (*view, error) {
	v := &view{api: map[string]string{}, node: map[string]*cubeletpb.Sandbox{}, snaps: map[string]string{}}
	code, body, err := c.api("GET", "/v2/sandboxes?limit=100&state=running,paused", nil)
	if err != nil || code != 200 {
		return nil, fmt.Errorf("list sandboxes: %d %s %v", code, body, err)
	}
	var page []struct {
		SandboxID string            `json:"sandboxID"`
		Metadata  map[string]string `json:"metadata"`
	}
	if err := json.Unmarshal(body, &page); err != nil {
		return nil, err
	}
	if len(page) == 100 {
		return nil, fmt.Errorf("a full page of sandboxes: the clients keep far fewer")
	}
	for _, p := range page {
		v.api[p.SandboxID] = p.Metadata["tag"]
	}
	resp, err := s.node.ListSandboxes(context.Background(), &cubeletpb.ListSandboxesRequest{})
	if err != nil {
		return nil, err
	}
	for _, sb := range resp.Sandboxes {
		v.node[sb.Id] = sb
	}
	code, body, err = c.api("GET", "/snapshots?limit=100", nil)
	if err != nil || code != 200 {
		return nil, fmt.Errorf("list snapshots: %d %s %v", code, body, err)
	}
	var snaps []struct {
		SnapshotID string   `json:"snapshotID"`
		Names      []string `json:"names"`
	}
	if err := json.Unmarshal(body, &snaps); err != nil {
		return nil, err
	}
	for _, sn := range snaps {
		v.snaps[sn.SnapshotID] = strings.Join(sn.Names, ",")
	}
	sresp, err := s.node.ListSnapshots(context.Background(), &cubeletpb.ListSnapshotsRequest{})
	if err != nil {
		return nil, err
	}
	v.nodeSnap = len(sresp.Snapshots)
	for _, sn := range sresp.Snapshots {
		if _, ok := v.snaps[sn.Id]; !ok {
			v.onlyNode = append(v.onlyNode, sn.Id)
		}
	}
	return v, nil
}

// diff lists where the system and the clients' beliefs differ. A
// sandbox (or snapshot) whose create, fork or snapshot never got an answer
// may exist: an SDK user finds it by its metadata (or name), so it is
// adopted. One answered with an error must not exist. A sandbox whose
// kill was answered with an error may be gone.
func diff(v *view, known map[string]*sbx, knownSnaps map[string]*snap, l *ledger) (problems, adopted []string) {
	for id, tag := range v.api {
		if known[id] != nil || l.dead[id] {
			continue
		}
		switch {
		case l.ambiguous[tag]:
			adopted = append(adopted, id)
		case l.refused[tag] != "":
			problems = append(problems, fmt.Sprintf("%s (%s): exists though its create was answered with an error: %s", id, tag, l.refused[tag]))
		default:
			problems = append(problems, fmt.Sprintf("%s (%s): exists and no client knows of it", id, tag))
		}
	}
	for id, sb := range known {
		if _, ok := v.api[id]; !ok && !sb.killSent {
			problems = append(problems, fmt.Sprintf("%s (%s): a client believes it exists; the API does not list it", id, sb.tag))
		}
		if _, ok := v.node[id]; !ok && !sb.killSent {
			problems = append(problems, fmt.Sprintf("%s (%s): a client believes it exists; cubelet does not hold it", id, sb.tag))
		}
	}
	for id, sb := range v.node {
		if _, ok := v.api[id]; !ok && known[id] == nil && !l.dead[id] {
			problems = append(problems, fmt.Sprintf("cubelet holds %s (%s, state %s, labels %v) that the API does not list", id, sb.Runtime, sb.State, sb.Labels))
		}
	}
	byName := map[string]string{}
	for id, name := range v.snaps {
		byName[name] = id
		if knownSnaps[name] != nil {
			continue
		}
		switch {
		case l.ambiguous[name]:
			adopted = append(adopted, id)
		case l.refused[name] != "":
			problems = append(problems, fmt.Sprintf("snapshot %s (%s): exists though it was answered with an error: %s", id, name, l.refused[name]))
		default:
			problems = append(problems, fmt.Sprintf("snapshot %s (%q): exists and no client knows of it", id, name))
		}
	}
	for name, sn := range knownSnaps {
		if byName[name] != sn.id {
			problems = append(problems, fmt.Sprintf("snapshot %s (%s): a client believes it exists; the API lists %q", sn.id, name, byName[name]))
		}
	}
	for _, id := range v.onlyNode {
		problems = append(problems, fmt.Sprintf("cubelet holds snapshot %s that the API does not list", id))
	}
	sort.Strings(problems)
	return problems, adopted
}

// final compares the clients' beliefs with the system, then kills
// everything through the API and checks that the node is empty (the
// system's cleanup runs the leak checker after cube up stops).
func final(t *testing.T, s *system, clients []*client, l *ledger) {
	t.Helper()
	c0 := clients[0]
	known := map[string]*sbx{}
	owner := map[string]*client{}
	knownSnaps := map[string]*snap{}
	for _, c := range clients {
		for _, sb := range c.sbs {
			known[sb.id], owner[sb.id] = sb, c
		}
		for _, sn := range c.snaps {
			knownSnaps[sn.name] = sn
		}
	}

	// The master and cubelet converge after restarts (reconcile, the
	// journal's pending destroys): allow them a moment.
	var v *view
	var problems, adopted []string
	deadline := time.Now().Add(30 * time.Second)
	for {
		var err error
		if v, err = s.look(c0); err != nil {
			t.Fatal(err)
		}
		problems, adopted = diff(v, known, knownSnaps, l)
		if len(problems) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Second)
	}
	for _, p := range problems {
		t.Errorf("end state: %s", p)
	}
	for _, id := range adopted {
		t.Logf("%s: exists after a verb that got no answer; adopted", id)
	}

	// Every sandbox a client believes exists: in that state, then (resumed
	// if paused) with its payload byte-exact.
	for _, id := range sortedKeys(known) {
		sb, c := known[id], owner[id]
		if _, ok := v.api[id]; !ok {
			t.Logf("%s (%s): gone after a kill answered with an error", id, sb.tag)
			continue
		}
		code, body, err := c.api("GET", "/sandboxes/"+id, nil)
		var d struct {
			State string `json:"state"`
		}
		_ = json.Unmarshal(body, &d)
		if err != nil || code != 200 || d.State != sb.state {
			t.Errorf("%s (%s): GET %d %s %v, want state %s", id, sb.tag, code, body, err, sb.state)
			continue
		}
		if sb.state == "paused" {
			c.resume(sb)
			if sb.state != "running" {
				t.Errorf("%s: resume after the soak failed", id)
				continue
			}
		}
		for try := 0; sb.payload == nil && try < 3; try++ {
			c.write(sb) // its last write failed: its content is unknown
		}
		if sb.payload == nil {
			t.Errorf("%s (%s): writes through the route fail after the soak: %+v", id, sb.tag, l.ops["write file"])
			continue
		}
		before := len(l.findings)
		c.verify(sb)
		if len(l.findings) == before {
			t.Logf("%s (%s): %d bytes byte-exact", id, sb.tag, len(sb.payload))
		}
	}

	// Everything goes through the API (a failed sandbox too, which the
	// list leaves out); then the node holds nothing.
	for id := range v.node {
		if _, ok := v.api[id]; !ok {
			v.api[id] = ""
		}
	}
	for id := range v.api {
		if code, body, err := c0.api("DELETE", "/sandboxes/"+id, nil); err != nil || (code != 204 && code != 404) {
			t.Errorf("kill %s: %d %s %v", id, code, body, err)
		}
	}
	for id := range v.snaps {
		if code, body, err := c0.api("DELETE", "/templates/"+id, nil); err != nil || (code != 204 && code != 404) {
			t.Errorf("delete snapshot %s: %d %s %v", id, code, body, err)
		}
	}
	// What only cubelet holds goes through cubelet (reported above).
	for _, id := range v.onlyNode {
		if _, err := s.node.DeleteSnapshot(context.Background(), &cubeletpb.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
			t.Errorf("delete snapshot %s on cubelet: %v", id, err)
		}
	}
	deadline = time.Now().Add(time.Minute)
	for {
		v, err := s.look(c0)
		if err == nil && len(v.api)+len(v.node)+len(v.snaps)+v.nodeSnap == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("a minute after deleting everything the system still holds: %+v %v", v, err)
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
}
