package master_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

// killCase is what a SIGKILL of cubemaster at one failpoint must leave,
// once the restarted master has reconciled the node, for the client whose
// call died with the master.
type killCase struct {
	verb string // create, kill, pause, resume, snapshot, fork
	// The target sandbox's state afterwards ("" = gone); create: unused.
	target string
	// New sandboxes (create, fork's clones) and new snapshots (the
	// client's snapshot) that exist afterwards: 0 or 1.
	newSandboxes, newSnapshots int
}

// killCases holds one case per failpoint in failpoint.Registered("master/").
// Crash points before the catalog records the verb's outcome leave the
// old state (or, past the node, the node's, which reconcile takes);
// points after it leave the new state. A create or clone the master did
// not mark running is destroyed; one it did is kept and listed (the
// client finds it by the metadata it sent).
var killCases = map[string]killCase{
	"master/create/row":       {verb: "create", newSandboxes: 0},
	"master/create/assigned":  {verb: "create", newSandboxes: 0},
	"master/create/placed":    {verb: "create", newSandboxes: 0},
	"master/create/ready":     {verb: "create", newSandboxes: 0},
	"master/create/done":      {verb: "create", newSandboxes: 1},
	"master/kill/begin":       {verb: "kill", target: "running"},
	"master/kill/deleted":     {verb: "kill", target: ""},
	"master/kill/done":        {verb: "kill", target: ""},
	"master/pause/begin":      {verb: "pause", target: "running"},
	"master/pause/paused":     {verb: "pause", target: "paused"},
	"master/pause/done":       {verb: "pause", target: "paused"},
	"master/resume/begin":     {verb: "resume", target: "paused"},
	"master/resume/resumed":   {verb: "resume", target: "running"},
	"master/resume/done":      {verb: "resume", target: "running"},
	"master/snapshot/begin":   {verb: "snapshot", target: "running"},
	"master/snapshot/taken":   {verb: "snapshot", target: "running"},
	"master/snapshot/done":    {verb: "snapshot", target: "running", newSnapshots: 1},
	"master/fork/snapshotted": {verb: "fork", target: "running"},
	"master/clone/rows":       {verb: "fork", target: "running"},
	"master/clone/made":       {verb: "fork", target: "running"},
	"master/clone/done":       {verb: "fork", target: "running", newSandboxes: 1},
	"master/fork/done":        {verb: "fork", target: "running", newSandboxes: 1},
}

// TestMasterKilledCoversEveryFailpoint: a failpoint added to the master
// without a case in killCases fails here (and a case whose point is gone).
func TestMasterKilledCoversEveryFailpoint(t *testing.T) {
	points := failpoint.Registered("master/")
	if len(points) == 0 {
		t.Fatal("no master failpoints registered")
	}
	for _, p := range points {
		if _, ok := killCases[p]; !ok {
			t.Errorf("failpoint %s has no case in killCases", p)
		}
	}
	for p := range killCases {
		if !slices.Contains(points, p) {
			t.Errorf("killCases has %s, which is not a registered failpoint", p)
		}
	}
	// A point evaluated by name (failpoint.Eval) instead of registered
	// would escape the list above.
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if bytes.Contains(src, []byte("failpoint.Eval(")) {
			t.Errorf("%s calls failpoint.Eval: declare the point with failpoint.Register in failpoints.go and add its case", path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestMasterKilled SIGKILLs a real cubemaster process (built with -tags
// failpoints, armed through $CUBE_FAILPOINTS with "kill") at every one of
// its failpoints while a client drives the verb through the E2B API
// against a real cubelet, restarts it on the same catalog, and checks
// once the node is reconciled:
//
//   - every sandbox and snapshot the client was told of is still there,
//     in the state it was told (no row lost, no sandbox destroyed);
//   - the target of the call that died is in the state the crash point
//     implies (killCases), the same in the catalog and on the node;
//   - nothing exists that no client knows of: every managed sandbox and
//     snapshot on the node has its row, no row is left "creating", no
//     fork's snapshot is left; a sandbox made on the node without the
//     master is left alone; at the end the node's leak checker is clean.
func TestMasterKilled(t *testing.T) {
	m := mastertest.StartMasterProcess(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	api := m.API(m.APIKey(t))
	ctx := context.Background()

	// A sandbox made with cubecli, not the master's: never touched.
	if _, err := node.Client.CreateSandbox(ctx, &cubeletpb.CreateSandboxRequest{SandboxId: "by-hand", TemplateId: "busybox"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = node.Client.DeleteSandbox(context.Background(), &cubeletpb.DeleteSandboxRequest{SandboxId: "by-hand"})
	})

	known := map[string]string{} // sandbox -> state the client was told
	snaps := map[string]bool{}   // snapshots the client was told of
	create := func(t *testing.T, md map[string]string) string {
		t.Helper()
		var sb struct {
			SandboxID string `json:"sandboxID"`
		}
		r := api.Do(t, "POST", "/sandboxes", map[string]any{"templateID": "busybox", "timeout": 3600, "metadata": md}, &sb)
		if r.StatusCode != http.StatusCreated {
			t.Fatalf("create: %d %s", r.StatusCode, r.Body)
		}
		known[sb.SandboxID] = "running"
		return sb.SandboxID
	}
	// A witness the client holds through every crash.
	create(t, map[string]string{"role": "witness"})

	points := failpoint.Registered("master/")
	for _, point := range points {
		c, ok := killCases[point]
		if !ok {
			t.Errorf("%s: no case (TestMasterKilledCoversEveryFailpoint)", point)
			continue
		}
		t.Run(strings.ReplaceAll(point, "/", "_"), func(t *testing.T) {
			m.Stop()
			m.Failpoints = point + "=kill"
			m.Start()
			m.WaitHealthy(t, node)

			// Set up the target with the point armed: no setup verb
			// passes through a point of the verb under test.
			target := ""
			switch c.verb {
			case "kill", "pause", "snapshot", "fork":
				target = create(t, map[string]string{"role": "target", "case": point})
			case "resume":
				target = create(t, map[string]string{"role": "target", "case": point})
				if r := api.Do(t, "POST", "/sandboxes/"+target+"/pause", nil, nil); r.StatusCode != http.StatusNoContent {
					t.Fatalf("pause for the resume case: %d %s", r.StatusCode, r.Body)
				}
				known[target] = "paused"
			}
			beforeRows := adminRows(t, m)

			var method, path string
			var body any
			switch c.verb {
			case "create":
				method, path, body = "POST", "/sandboxes", map[string]any{"templateID": "busybox", "timeout": 3600, "metadata": map[string]string{"case": point}}
			case "kill":
				method, path = "DELETE", "/sandboxes/"+target
			case "pause":
				method, path = "POST", "/sandboxes/"+target+"/pause"
			case "resume":
				method, path, body = "POST", "/sandboxes/"+target+"/resume", map[string]any{"timeout": 3600}
			case "snapshot":
				method, path, body = "POST", "/sandboxes/"+target+"/snapshots", map[string]any{"name": "snap-" + strings.ReplaceAll(point, "/", "-")}
			case "fork":
				method, path, body = "POST", "/sandboxes/"+target+"/fork", map[string]any{"count": 1, "timeout": 3600}
			}
			var rd *bytes.Reader
			if body != nil {
				b, _ := json.Marshal(body)
				rd = bytes.NewReader(b)
			} else {
				rd = bytes.NewReader(nil)
			}
			req, err := http.NewRequest(method, api.Base+path, rd)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", "application/json")
			resp, err := api.Try(req, nil)
			if err == nil {
				t.Fatalf("%s %s answered %d %s: the master should have died at %s", method, path, resp.StatusCode, resp.Body, point)
			}
			t.Logf("client: %s %s: %v", method, path, err)
			st := m.WaitExit(30 * time.Second)
			if st == nil {
				t.Fatalf("cubemaster still runs after the call through %s", point)
			}
			if ws, ok := st.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Fatalf("cubemaster ended with %v, want SIGKILL by the failpoint", st)
			}

			m.Failpoints = ""
			m.Start()
			rows := waitReconciled(t, m, node, api)

			// The call that died: the state its crash point implies.
			if target != "" {
				if c.target == "" {
					delete(known, target)
				} else {
					known[target] = c.target
				}
			}
			// What it made, the client finds by listing (its metadata).
			var made []string
			for id := range rows {
				if _, was := beforeRows[id]; !was {
					made = append(made, id)
				}
			}
			if len(made) != c.newSandboxes {
				t.Errorf("%d new sandbox(es) %v after the crash, want %d", len(made), made, c.newSandboxes)
			}
			for _, id := range made {
				known[id] = "running"
			}
			for id, want := range known {
				if got, ok := rows[id]; !ok {
					t.Errorf("sandbox %s (client was told %s) is gone", id, want)
				} else if got != want {
					t.Errorf("sandbox %s is %s, want %s", id, got, want)
				}
			}
			for id := range rows {
				if _, ok := known[id]; !ok {
					t.Errorf("sandbox %s exists but no client knows of it", id)
				}
			}
			// The client's own view through the API: the target of its
			// failed call, and what a failed create made, found by the
			// metadata it sent.
			if target != "" {
				var got struct {
					State string `json:"state"`
				}
				r := api.Do(t, "GET", "/sandboxes/"+target, nil, &got)
				if c.target == "" && r.StatusCode != http.StatusNotFound ||
					c.target != "" && (r.StatusCode != http.StatusOK || got.State != c.target) {
					t.Errorf("GET /sandboxes/%s: %d %q, want state %q (\"\" = 404)", target, r.StatusCode, got.State, c.target)
				}
			}
			if c.verb == "create" {
				var found []struct {
					SandboxID string `json:"sandboxID"`
				}
				md := url.QueryEscape("case=" + url.QueryEscape(point))
				if r := api.Do(t, "GET", "/v2/sandboxes?metadata="+md, nil, &found); r.StatusCode != http.StatusOK || len(found) != c.newSandboxes {
					t.Errorf("list by the failed create's metadata: %d %s, want %d sandbox(es)", r.StatusCode, r.Body, c.newSandboxes)
				}
			}
			newSnaps := 0
			listed := listSnapshots(t, api)
			for id := range snaps {
				if !listed[id] {
					t.Errorf("snapshot %s (client was told of it) is gone", id)
				}
			}
			for id := range listed {
				if !snaps[id] {
					newSnaps++
					snaps[id] = true
				}
			}
			if newSnaps != c.newSnapshots {
				t.Errorf("%d new snapshot(s), want %d", newSnaps, c.newSnapshots)
			}
			if !onNode(ctx, node, "by-hand") {
				t.Error("reconcile destroyed the sandbox made without the master")
			}
		})
	}
	if t.Failed() {
		return
	}
	// Everything the client knows goes away through the API; then the
	// node holds nothing of it.
	for id := range known {
		if r := api.Do(t, "DELETE", "/sandboxes/"+id, nil, nil); r.StatusCode != http.StatusNoContent {
			t.Errorf("kill %s: %d %s", id, r.StatusCode, r.Body)
		}
	}
	resp, err := node.Client.ListSnapshots(ctx, &cubeletpb.ListSnapshotsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, sn := range resp.Snapshots {
		if !snaps[sn.Id] {
			t.Errorf("snapshot %s on the node that no client knows of", sn.Id)
		}
		if _, err := node.Client.DeleteSnapshot(ctx, &cubeletpb.DeleteSnapshotRequest{SnapshotId: sn.Id}); err != nil {
			t.Error(err)
		}
	}
	if _, err := node.Client.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{SandboxId: "by-hand"}); err != nil {
		t.Fatal(err)
	}
	node.Env.AssertNoLeaks(t)
}

func onNode(ctx context.Context, node *mastertest.Node, id string) bool {
	_, err := node.Client.GetSandbox(ctx, &cubeletpb.GetSandboxRequest{SandboxId: id})
	return err == nil
}

// adminRows is every catalog row (creating ones included): id -> state.
func adminRows(t *testing.T, m *mastertest.Master) map[string]string {
	t.Helper()
	resp, err := m.Admin.ListSandboxes(context.Background(), &masterpb.ListSandboxesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, sb := range resp.Sandboxes {
		out[sb.SandboxId] = sb.State
	}
	return out
}

func listSnapshots(t *testing.T, api *mastertest.Client) map[string]bool {
	t.Helper()
	var list []struct {
		SnapshotID string `json:"snapshotID"`
	}
	if r := api.Do(t, "GET", "/snapshots", nil, &list); r.StatusCode != http.StatusOK {
		t.Fatalf("list snapshots: %d %s", r.StatusCode, r.Body)
	}
	out := map[string]bool{}
	for _, s := range list {
		out[s.SnapshotID] = true
	}
	return out
}

// waitReconciled waits until the catalog and the node agree: no row
// creating, every row on the node in the row's state, every managed
// sandbox on the node with a row, the node's managed snapshots exactly
// the listed ones and none of them a fork's. It returns the rows.
func waitReconciled(t *testing.T, m *mastertest.Master, node *mastertest.Node, api *mastertest.Client) map[string]string {
	t.Helper()
	ctx := context.Background()
	var rows map[string]string
	var why string
	agree := func() bool {
		rows = adminRows(t, m)
		resp, err := node.Client.ListSandboxes(ctx, &cubeletpb.ListSandboxesRequest{})
		if err != nil {
			why = err.Error()
			return false
		}
		managed := map[string]string{}
		for _, sb := range resp.Sandboxes {
			if sb.Labels[master.ManagedLabel] != master.ManagedValue {
				continue
			}
			switch sb.State {
			case cubeletpb.SandboxState_SANDBOX_STATE_RUNNING:
				managed[sb.Id] = "running"
			case cubeletpb.SandboxState_SANDBOX_STATE_PAUSED:
				managed[sb.Id] = "paused"
			default:
				managed[sb.Id] = sb.State.String()
			}
		}
		for id, st := range rows {
			if managed[id] != st {
				why = fmt.Sprintf("row %s is %s, node has %q", id, st, managed[id])
				return false
			}
		}
		for id := range managed {
			if _, ok := rows[id]; !ok {
				why = fmt.Sprintf("node has managed sandbox %s without a row", id)
				return false
			}
		}
		sresp, err := node.Client.ListSnapshots(ctx, &cubeletpb.ListSnapshotsRequest{})
		if err != nil {
			why = err.Error()
			return false
		}
		listed := listSnapshots(t, api)
		for _, sn := range sresp.Snapshots {
			if sn.Labels[master.ManagedLabel] != master.ManagedValue {
				continue
			}
			if sn.Labels["cube.fork"] != "" {
				why = fmt.Sprintf("fork snapshot %s left on the node", sn.Id)
				return false
			}
			if !listed[sn.Id] {
				why = fmt.Sprintf("node has snapshot %s without a row", sn.Id)
				return false
			}
			delete(listed, sn.Id)
		}
		if len(listed) > 0 {
			why = fmt.Sprintf("listed snapshots %v are not on the node", listed)
			return false
		}
		return true
	}
	deadline := time.Now().Add(30 * time.Second)
	for !agree() {
		if time.Now().After(deadline) {
			t.Fatalf("catalog and node do not agree 30s after the restart: %s", why)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return rows
}
