package e2bapi_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/process"
	"github.com/cubesandbox/cube/api/envd/process/processconnect"
	"github.com/cubesandbox/cube/internal/master/mastertest"
)

type logEntryResp struct {
	Timestamp time.Time         `json:"timestamp"`
	Level     string            `json:"level"`
	Message   string            `json:"message"`
	Fields    map[string]string `json:"fields"`
}

// TestSandboxLogs: the E2B logs endpoints carry the output of commands run
// through envd (stdout at info, stderr at warn, with stream, PID and
// command) beside the lifecycle events, and page: v2 by cursor in both
// directions with level and search filters, v1 by start and limit.
func TestSandboxLogs(t *testing.T) {
	m := mastertest.StartMaster(t, "")
	node := mastertest.StartNode(t, m, "busybox")
	m.WaitHealthy(t, node)
	c := m.API(m.APIKey(t))
	var sb sandboxResp
	if r := c.Do(t, "POST", "/v2/sandboxes", map[string]any{"templateID": "busybox", "timeout": 300}, &sb); r.StatusCode != http.StatusCreated {
		t.Fatalf("create: %d %s", r.StatusCode, r.Body)
	}
	t.Cleanup(func() { c.Do(t, "DELETE", "/sandboxes/"+sb.SandboxID, nil, nil) })

	envd := processconnect.NewProcessClient(&http.Client{Transport: routeTransport{id: sb.SandboxID, token: sb.EnvdAccessToken}},
		"http://"+m.Server.ProxyAddr)
	s, err := envd.Start(context.Background(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "/bin/sh",
		Args: []string{"-c", "for i in $(seq 1 40); do echo line $i; sleep 0.005; done; echo oops >&2"}}}))
	if err != nil {
		t.Fatal(err)
	}
	var pid uint32
	for s.Receive() {
		if st := s.Msg().GetEvent().GetStart(); st != nil {
			pid = st.GetPid()
		}
	}
	s.Close()

	v2 := func(t *testing.T, q url.Values) []logEntryResp {
		t.Helper()
		var out struct {
			Logs []logEntryResp `json:"logs"`
		}
		if r := c.Do(t, "GET", "/v2/sandboxes/"+sb.SandboxID+"/logs?"+q.Encode(), nil, &out); r.StatusCode != 200 {
			t.Fatalf("v2 logs: %d %s", r.StatusCode, r.Body)
		}
		return out.Logs
	}
	all := v2(t, url.Values{})
	var lines []string
	created, oops := false, false
	for _, e := range all {
		created = created || e.Message == "sandbox created"
		if e.Fields["source"] == "process" {
			if e.Fields["pid"] != fmt.Sprint(pid) || e.Fields["cmd"] != "/bin/sh" {
				t.Errorf("process line %+v, want pid %d", e, pid)
			}
			if e.Fields["stream"] == "stderr" {
				oops = e.Message == "oops" && e.Level == "warn"
			} else {
				lines = append(lines, e.Message)
				if e.Level != "info" {
					t.Errorf("stdout line at level %s", e.Level)
				}
			}
		}
	}
	t.Logf("%d entries; %d stdout lines of the command", len(all), len(lines))
	for _, e := range all {
		if e.Fields["source"] == "agent" {
			t.Logf("agent line: %s %s %q", e.Timestamp.Format("15:04:05.000"), e.Level, e.Message)
			if strings.HasPrefix(e.Message, "time=") || strings.Contains(e.Message, "level=") {
				t.Errorf("agent line keeps its slog prefix: %q", e.Message)
			}
		}
	}
	if !created || !oops || len(lines) != 40 || lines[0] != "line 1" || lines[39] != "line 40" {
		t.Fatalf("created %v, stderr %v, stdout %q", created, oops, lines)
	}
	for i := 1; i < len(all); i++ {
		if all[i].Timestamp.Before(all[i-1].Timestamp) {
			t.Fatalf("out of order at %d: %v after %v", i, all[i].Timestamp, all[i-1].Timestamp)
		}
	}

	t.Run("create trace", func(t *testing.T) {
		var tr map[string]string
		for _, e := range all {
			if e.Message == "sandbox created" {
				tr = e.Fields
			}
		}
		if tr == nil {
			t.Fatal("no sandbox created event in the log")
		}
		num := func(k string) float64 {
			var v float64
			if _, err := fmt.Sscan(tr[k], &v); err != nil {
				t.Fatalf("trace field %s=%q: %v", k, tr[k], err)
			}
			return v
		}
		// Actions of one step run in parallel: a step takes its longest.
		steps := map[string]float64{}
		var actions []string
		for k := range tr {
			if strings.HasPrefix(k, "trace.action.") {
				actions = append(actions, k)
				step := strings.Split(k, ".")[2]
				steps[step] = max(steps[step], num(k))
			}
		}
		var sum float64
		for _, d := range steps {
			sum += d
		}
		sort.Strings(actions)
		t.Logf("trace: total %sms = placement %sms + node call %sms (actions %.3fms: %v) + agent init %sms", tr["trace.total"],
			tr["trace.placement"], tr["trace.node_call"], sum, actions, tr["trace.agent_init"])
		if len(actions) < 3 || tr["trace.flow"] != "create" || sum > num("trace.node_call") ||
			num("trace.placement")+num("trace.node_call")+num("trace.agent_init") > num("trace.total") {
			t.Fatalf("trace %v", tr)
		}
	})

	t.Run("v2 pages forward and backward", func(t *testing.T) {
		for _, dir := range []string{"forward", "backward"} {
			// The cursor is a millisecond timestamp, inclusive: each page
			// starts at the last one's last millisecond, and the entries of
			// that millisecond already read come again.
			seen := map[string]bool{}
			var order []string
			cursor := all[0].Timestamp.UnixMilli()
			if dir == "backward" {
				cursor = all[len(all)-1].Timestamp.UnixMilli()
			}
			for pages := 0; pages < 100; pages++ {
				page := v2(t, url.Values{"cursor": {fmt.Sprint(cursor)}, "limit": {"8"}, "direction": {dir}})
				fresh := 0
				for _, e := range page {
					k := e.Timestamp.String() + e.Message + e.Fields["seq"]
					if !seen[k] {
						seen[k] = true
						fresh++
						if strings.HasPrefix(e.Message, "line ") {
							order = append(order, e.Message)
						}
					}
				}
				if fresh == 0 {
					break
				}
				cursor = page[len(page)-1].Timestamp.UnixMilli()
			}
			if len(order) != 40 {
				t.Fatalf("%s: paged through %d of the 40 lines", dir, len(order))
			}
			first, last := "line 1", "line 40"
			if dir == "backward" {
				first, last = last, first
			}
			if order[0] != first || order[39] != last {
				t.Fatalf("%s: %s..%s", dir, order[0], order[39])
			}
			t.Logf("%s: %d entries in pages of 8", dir, len(seen))
		}
	})

	t.Run("v2 filters", func(t *testing.T) {
		warn := v2(t, url.Values{"level": {"warn"}})
		for _, e := range warn {
			if e.Level != "warn" && e.Level != "error" {
				t.Errorf("level=warn gave %+v", e)
			}
		}
		found := false
		for _, e := range warn {
			found = found || e.Message == "oops"
		}
		if !found {
			t.Errorf("level=warn lacks the stderr line: %+v", warn)
		}
		if got := v2(t, url.Values{"search": {"line 3"}}); len(got) != 11 { // line 3 and 30-39
			t.Errorf("search 'line 3': %d entries", len(got))
		}
	})

	t.Run("v1 pages by start and limit", func(t *testing.T) {
		var out struct {
			Logs []struct {
				Timestamp time.Time `json:"timestamp"`
				Line      string    `json:"line"`
			} `json:"logs"`
		}
		r := c.Do(t, "GET", fmt.Sprintf("/sandboxes/%s/logs?start=%d&limit=5", sb.SandboxID, all[0].Timestamp.UnixMilli()), nil, &out)
		if r.StatusCode != 200 || len(out.Logs) != 5 || out.Logs[0].Line != all[0].Message {
			t.Fatalf("v1: %d %s", r.StatusCode, r.Body)
		}
	})
}
