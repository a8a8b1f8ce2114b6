package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/proxy"
)

// cluster-resume-move times the resume of a paused sandbox on another
// node (the cluster's object store host in between): per sample a sandbox
// is created through the E2B API, paused, its node cordoned (which makes
// the master move it on resume), then POST /sandboxes/{id}/connect plus
// the first envd request through a proxy host is timed: the node
// snapshots and exports it, another node imports it and starts it under
// the same ID. cluster-resume-move-exported is the same with the pause
// through master m2, which exports the sandbox's snapshot as it pauses
// (store.export_on_pause): the move imports that export and starts it,
// nothing is taken or uploaded on the connect's path. Their baseline,
// cluster-resume-local, is the same sequence without the cordon: the
// resume in place, run interleaved with them.

func init() {
	probe := func(ctx context.Context, e *Env) error {
		if _, ok := objstoretest.Lookup(); !ok {
			return skipf("it needs SeaweedFS's weed for the cluster's object store (hack/s3/weed.sh)")
		}
		return nil
	}
	Register(Scenario{
		Name: "cluster-resume-local", Kind: report.KindCube, Explicit: true,
		Help:   "cluster: E2B connect of a paused sandbox on its own node + first envd request through a proxy host (the baseline of cluster-resume-move)",
		Params: func(o report.Options) report.Params { return report.Params{N: min(o.N1, 20), Concurrency: 1} },
		Probe:  probe,
		Run:    runClusterResume("cluster-resume-local", false),
		Finish: finishClusterResume(false),
	})
	Register(Scenario{
		Name: "cluster-resume-move", Kind: report.KindCube, Explicit: true,
		Help:      "cluster: E2B connect of a paused sandbox whose node is cordoned (snapshot, export, import and start on another node under the same ID) + first envd request through a proxy host; vs cluster-resume-local",
		Baselines: []string{"cluster-resume-local"},
		Params:    func(o report.Options) report.Params { return report.Params{N: min(o.N1, 20), Concurrency: 1} },
		Probe:     probe,
		Run:       runClusterResume("cluster-resume-move", true),
		Finish:    finishClusterResume(true),
	})
	Register(Scenario{
		Name: "cluster-resume-move-exported", Kind: report.KindCube, Explicit: true,
		Help:      "cluster: cluster-resume-move with the sandbox paused through master m2, which exports its snapshot as it pauses (store.export_on_pause): the move imports that export and starts it; vs cluster-resume-local",
		Baselines: []string{"cluster-resume-local"},
		Params:    func(o report.Options) report.Params { return report.Params{N: min(o.N1, 20), Concurrency: 1} },
		Probe:     probe,
		Run:       runClusterResume("cluster-resume-move-exported", true),
		Finish:    finishClusterResume(true),
	})
}

func runClusterResume(name string, move bool) func(context.Context, *Env, report.Params) (*report.Result, error) {
	return func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
		bc, err := e.cluster(ctx)
		if err != nil {
			return nil, err
		}
		if bc.c.Store == nil {
			return nil, skipf("the cluster has no object store")
		}
		hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: bc.c.ServerTLS()}}
		agg := bc.agg(name)
		var d driveResult
		e.Progress.Start(name, p.N)
		defer e.Progress.Finish()
		begin := time.Now()
		for i := 0; i < p.N && ctx.Err() == nil; i++ {
			connect, first, moved, err := bc.resumeOnce(ctx, hc, bc.c.Proxies[i%len(bc.c.Proxies)].URL, move, strings.HasSuffix(name, "-exported"))
			if err == nil && move && !moved {
				err = errors.New("the sandbox resumed on its cordoned node")
			}
			if err == nil {
				d.samples = append(d.samples, connect+first)
				agg.creates = append(agg.creates, connect)
				agg.firsts = append(agg.firsts, first)
			} else {
				d.failed++
				if len(d.errs) < report.KeepErrors {
					d.errs = append(d.errs, err)
				}
			}
			e.Progress.Step(err == nil)
		}
		d.wall = time.Since(begin)
		return d.result(name, report.KindCube, p)
	}
}

func finishClusterResume(move bool) func(*Env, *report.Result) {
	return func(e *Env, r *report.Result) {
		a := e.clus.agg(r.Scenario)
		what := "on its own node"
		if move {
			what = "on another node (its own cordoned)"
		}
		paused := "paused through master m1's E2B API (no export at pause)"
		if strings.HasSuffix(r.Scenario, "-exported") {
			paused = "paused through master m2's E2B API, which exports its snapshot as it pauses (untimed)"
		}
		r.Notes = append(r.Notes,
			"a busybox runc sandbox of the E2B test image, "+paused+"; latency: POST /sandboxes/{id}/connect through m1 (resume "+what+") + the first envd /health through a proxy host",
			summary("E2B connect alone", a.creates),
			summary("first envd /health through a proxy host after it", a.firsts))
	}
}

// resumeOnce creates a sandbox, pauses it (through m2, which exports it
// as it pauses, when exported), cordons its node when move, and times the
// E2B connect that resumes it and the first envd request through the
// proxy at base; moved says whether it ended on another node. The sandbox
// is killed and the node uncordoned before it returns.
func (bc *benchCluster) resumeOnce(ctx context.Context, hc *http.Client, base string, move, exported bool) (connect, first time.Duration, moved bool, err error) {
	call := func(method, path, body string) error {
		api := bc.api
		if exported && strings.HasSuffix(path, "/pause") {
			api = bc.api2
		}
		req, err := http.NewRequestWithContext(ctx, method, api.Base+path, strings.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		r, err := api.Try(req, nil)
		if err != nil {
			return fmt.Errorf("%s %s: %w", method, path, err)
		}
		if r.StatusCode/100 != 2 {
			return fmt.Errorf("%s %s: %s %s", method, path, r.Status, bytes.TrimSpace(r.Body))
		}
		return nil
	}
	s, err := bc.createFirst(ctx, hc, base)
	if s.id != "" {
		defer func() {
			if kerr := bc.killAll(context.WithoutCancel(ctx), []string{s.id}, 1, nodeSpread{}); kerr != nil {
				err = errors.Join(err, kerr)
			}
		}()
	}
	if err != nil {
		return 0, 0, false, err
	}
	from := bc.nodeOf(ctx, s.id)
	if err := call(http.MethodPost, "/sandboxes/"+s.id+"/pause", ""); err != nil {
		return 0, 0, false, err
	}
	admin := bc.c.Masters[0].Admin
	if move {
		if _, err := admin.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: from, Schedulable: false}); err != nil {
			return 0, 0, false, err
		}
		defer func() {
			if _, uerr := admin.SetNodeSchedulable(context.WithoutCancel(ctx), &masterpb.SetNodeSchedulableRequest{NodeId: from, Schedulable: true}); uerr != nil {
				err = errors.Join(err, uerr)
			}
		}()
	}
	start := time.Now()
	if err := call(http.MethodPost, "/sandboxes/"+s.id+"/connect", `{"timeout":600}`); err != nil {
		return 0, 0, false, err
	}
	connect = time.Since(start)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/health", nil)
	if err != nil {
		return 0, 0, false, err
	}
	req.Header.Set(proxy.HeaderSandboxID, s.id)
	req.Header.Set(proxy.HeaderSandboxPort, clusterEnvdPort)
	start = time.Now()
	resp, err := hc.Do(req)
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode/100 != 2 {
			err = errors.New(resp.Status)
		}
	}
	first = time.Since(start)
	if err != nil {
		return 0, 0, false, fmt.Errorf("first envd request to %s after the resume: %w", s.id, err)
	}
	return connect, first, bc.nodeOf(ctx, s.id) != from, nil
}

// nodeOf is the node the catalog places sandbox id on ("" if unknown).
func (bc *benchCluster) nodeOf(ctx context.Context, id string) string {
	resp, err := bc.c.Masters[0].Admin.ListSandboxes(ctx, &masterpb.ListSandboxesRequest{})
	if err != nil {
		return ""
	}
	for _, sb := range resp.Sandboxes {
		if sb.SandboxId == id {
			return sb.NodeId
		}
	}
	return ""
}
