package bench

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/proxy"
	"github.com/cubesandbox/cube/internal/testbin"
	"github.com/cubesandbox/cube/internal/testimage"
	"github.com/cubesandbox/cube/test/cluster/clusterenv"
)

// The cluster scenarios drive a real multi-host cluster the bench builds
// itself with the cluster test harness (test/cluster/clusterenv: hosts in
// network namespaces on a bridge, MariaDB, two cubemasters, three nodes,
// two cubeproxies, mutual TLS from a cluster CA), once per run, shared by
// them and torn down (and checked for leaks) when the run ends.
//
// cluster-create-c1 and -c50 time, per sandbox, POST /sandboxes on the E2B
// API of one master (which schedules it on a node host and creates it
// there over mutual TLS) plus the first request to the sandbox's envd
// through a proxy host (the route resolves the sandbox to its node and
// forwards over the node's data-plane listener): the figure a user of
// the cluster waits for before the sandbox answers. Each is compared with
// the single-node create scenario of the same concurrency, run
// interleaved with it on the bench's private node. cluster-template and
// cluster-template-32m time template distribution: ImportTemplate once
// through a master until that master reports every node holding it.
// cluster-resume-move (clustermove.go) times a paused sandbox's resume on
// another node through the object store host.

// clusterEnvdPort is envd's port in a sandbox (the route's port header).
const clusterEnvdPort = "49983"

func init() {
	probe := func(context.Context, *Env) error {
		if os.Geteuid() != 0 {
			return skipf("it builds a cluster of network namespaces (root)")
		}
		if testbin.Root() == "" {
			return skipf("it builds the daemons from source: run it from the repository")
		}
		return nil
	}
	Register(Scenario{
		Name: "cluster-create-c1", Kind: report.KindCube, Explicit: true,
		Help:      "cluster (3 node hosts): E2B POST /sandboxes on one master + first envd request through a proxy host, one at a time; vs create-c1",
		Baselines: []string{"create-c1"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} },
		Probe:     probe,
		Run:       runClusterCreate("cluster-create-c1"),
		Finish:    finishClusterCreate,
	})
	Register(Scenario{
		Name: "cluster-create-c50", Kind: report.KindCube, Explicit: true,
		Help:      "cluster-create-c1 with --concurrency in flight (default 50); vs create-c50",
		Baselines: []string{"create-c50"},
		Params:    func(o report.Options) report.Params { return report.Params{N: o.N50, Concurrency: o.Concurrency} },
		Probe:     probe,
		Run:       runClusterCreate("cluster-create-c50"),
		Finish:    finishClusterCreate,
	})
	Register(Scenario{
		Name: "cluster-template", Kind: report.KindCube, Explicit: true,
		Help:   "cluster: ImportTemplate of the busybox E2B image once through a master until every node holds it",
		Params: func(o report.Options) report.Params { return report.Params{N: min(o.N1, 5), Concurrency: 1} },
		Probe:  probe,
		Run:    runClusterTemplate("cluster-template", 0),
		Finish: finishClusterTemplate(0),
	})
	Register(Scenario{
		Name: "cluster-template-32m", Kind: report.KindCube, Explicit: true,
		Help:   "cluster-template with a 32 MiB incompressible layer added to the image",
		Params: func(o report.Options) report.Params { return report.Params{N: min(o.N1, 5), Concurrency: 1} },
		Probe:  probe,
		Run:    runClusterTemplate("cluster-template-32m", 32<<20),
		Finish: finishClusterTemplate(32 << 20),
	})
}

// benchCluster is the run's cluster, built on first use.
type benchCluster struct {
	ownSystem
	c   *clusterenv.Cluster
	api *mastertest.Client
	// api2 is master m2's E2B API: m2 exports a sandbox's snapshot as it
	// pauses (store.export_on_pause), m1 does not.
	api2 *mastertest.Client

	mu   sync.Mutex
	aggs map[string]*clusterAgg // by scenario, over its chunks
}

// clusterAgg is what a cluster scenario measured over all its chunks,
// beyond its latency samples.
type clusterAgg struct {
	creates, firsts, imports []time.Duration
	per                      nodeSpread
	size                     int64
}

func (bc *benchCluster) agg(name string) *clusterAgg {
	bc.mu.Lock()
	defer bc.mu.Unlock()
	if bc.aggs == nil {
		bc.aggs = map[string]*clusterAgg{}
	}
	a := bc.aggs[name]
	if a == nil {
		a = &clusterAgg{per: nodeSpread{}}
		bc.aggs[name] = a
	}
	return a
}

// summary is a distribution in a note.
func summary(what string, ds []time.Duration) string {
	s := report.Summarize(ds)
	r := func(d time.Duration) time.Duration { return d.Round(100 * time.Microsecond) }
	return fmt.Sprintf("%s: p50 %s p99 %s avg %s (n %d)", what, r(s.P50), r(s.P99), r(s.Avg), s.N)
}

// nodeSpread counts sandboxes per node host.
type nodeSpread map[string]int

func (s nodeSpread) String(nodes []*clusterenv.Node) string {
	var parts []string
	for _, n := range nodes {
		parts = append(parts, fmt.Sprintf("%s %d", n.Host.Name, s[n.ID]))
	}
	return strings.Join(parts, ", ")
}

// cluster builds the run's cluster once (later calls return it or the
// error that stopped it).
func (e *Env) cluster(ctx context.Context) (*benchCluster, error) {
	bc := &e.clus
	err := bc.build(ctx, e, "cluster", "3 nodes, 2 masters, 2 proxies, MariaDB", func(tb *benchTB) {
		// With weed at hand, an object store host too: paused sandboxes
		// can move between nodes (cluster-resume-move).
		_, store := objstoretest.Lookup()
		bc.c = clusterenv.Start(tb, clusterenv.Options{ObjectStore: store,
			ReplicaTOML: []string{"", "[store]\nexport_on_pause = true\n"}})
		key := bc.c.APIKey(tb)
		bc.api, bc.api2 = bc.c.Masters[0].API(key), bc.c.Masters[1].API(key)
	})
	return bc, err
}

// close tears the cluster down.
func (bc *benchCluster) close() error { return bc.ownSystem.close("cluster") }

// clusterSample is one sandbox's create and first envd answer.
type clusterSample struct {
	id            string
	create, first time.Duration
}

func runClusterCreate(name string) func(context.Context, *Env, report.Params) (*report.Result, error) {
	return func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
		bc, err := e.cluster(ctx)
		if err != nil {
			return nil, err
		}
		c := bc.c
		// One client per proxy host, taken in turn: the first request of
		// each sandbox goes through either.
		var hcs []*http.Client
		for range c.Proxies {
			hcs = append(hcs, &http.Client{Timeout: time.Minute, Transport: &http.Transport{
				TLSClientConfig: c.ServerTLS(), MaxIdleConnsPerHost: p.Concurrency}})
		}
		var (
			all driveResult
			mu  sync.Mutex
			agg = bc.agg(name)
		)
		done := 0
		for _, n := range rounds(p.N, e.Opts.MaxLive) {
			var ids []string
			e.Progress.Start(name, n)
			d := drive(ctx, e.Progress, n, p.Concurrency, func(ctx context.Context, i int) (time.Duration, error) {
				s, err := bc.createFirst(ctx, hcs[(done+i)%len(hcs)], c.Proxies[(done+i)%len(c.Proxies)].URL)
				if s.id != "" {
					mu.Lock()
					ids = append(ids, s.id)
					if err == nil {
						agg.creates = append(agg.creates, s.create)
						agg.firsts = append(agg.firsts, s.first)
					}
					mu.Unlock()
				}
				return s.create + s.first, err
			})
			e.Progress.Finish()
			all.merge(d)
			if err := bc.killAll(context.WithoutCancel(ctx), ids, p.Concurrency, agg.per); err != nil {
				return nil, err
			}
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			done += n
		}
		return all.result(name, report.KindCube, p)
	}
}

// finishClusterCreate notes, over every chunk, the split of the latency
// into the E2B create and the first request through the route, and the
// spread over the node hosts.
func finishClusterCreate(e *Env, r *report.Result) {
	bc := &e.clus
	a := bc.agg(r.Scenario)
	r.Notes = append(r.Notes,
		summary("E2B POST /sandboxes alone (master m1 → node host over mutual TLS)", a.creates),
		summary("first envd /health through a proxy host (route resolve + node data plane)", a.firsts),
		"sandboxes per node host: "+a.per.String(bc.c.Nodes),
		fmt.Sprintf("cluster built in %s (shared by the run's cluster scenarios)", bc.built.Round(time.Millisecond)))
}

// createFirst makes one sandbox through the E2B API and sends its envd
// the first request through the proxy at base.
func (bc *benchCluster) createFirst(ctx context.Context, hc *http.Client, base string) (clusterSample, error) {
	var s clusterSample
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, bc.api.Base+"/sandboxes",
		strings.NewReader(`{"templateID":"`+clusterenv.Template+`","timeout":600}`))
	if err != nil {
		return s, err
	}
	req.Header.Set("Content-Type", "application/json")
	var out struct {
		SandboxID string `json:"sandboxID"`
	}
	start := time.Now()
	r, err := bc.api.Try(req, &out)
	s.create = time.Since(start)
	if err != nil {
		return s, fmt.Errorf("create: %w", err)
	}
	if r.StatusCode/100 != 2 || out.SandboxID == "" {
		return s, fmt.Errorf("create: %s %s", r.Status, bytes.TrimSpace(r.Body))
	}
	s.id = out.SandboxID
	req, err = http.NewRequestWithContext(ctx, http.MethodGet, base+"/health", nil)
	if err != nil {
		return s, err
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
	s.first = time.Since(start)
	if err != nil {
		return s, fmt.Errorf("first envd request to %s through %s: %w", s.id, base, err)
	}
	return s, nil
}

// killAll deletes sandboxes through the E2B API, c at a time, after
// counting in per which node hosts held them.
func (bc *benchCluster) killAll(ctx context.Context, ids []string, c int, per nodeSpread) error {
	if len(ids) == 0 {
		return nil
	}
	if resp, err := bc.c.Masters[0].Admin.ListSandboxes(ctx, &masterpb.ListSandboxesRequest{}); err == nil {
		want := map[string]bool{}
		for _, id := range ids {
			want[id] = true
		}
		for _, sb := range resp.Sandboxes {
			if want[sb.SandboxId] {
				per[sb.NodeId]++
			}
		}
	}
	d := drive(ctx, nil, len(ids), c, func(ctx context.Context, i int) (time.Duration, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodDelete, bc.api.Base+"/sandboxes/"+ids[i], nil)
		if err != nil {
			return 0, err
		}
		r, err := bc.api.Try(req, nil)
		if err != nil {
			return 0, err
		}
		if r.StatusCode/100 != 2 && r.StatusCode != http.StatusNotFound {
			return 0, fmt.Errorf("kill %s: %s %s", ids[i], r.Status, bytes.TrimSpace(r.Body))
		}
		return 0, nil
	})
	if d.failed > 0 {
		return fmt.Errorf("kill %d of %d sandboxes failed: %w", d.failed, len(ids), errors.Join(d.errs...))
	}
	return nil
}

func runClusterTemplate(name string, pad int64) func(context.Context, *Env, report.Params) (*report.Result, error) {
	return func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
		bc, err := e.cluster(ctx)
		if err != nil {
			return nil, err
		}
		src := bc.c.Image()
		if pad > 0 {
			if src, err = paddedImage(filepath.Join(bc.tb.dir, name), pad); err != nil {
				return nil, err
			}
		}
		m := bc.c.Masters[0]
		agg := bc.agg(name)
		var d driveResult
		e.Progress.Start(name, p.N)
		defer e.Progress.Finish()
		begin := time.Now()
		for i := 0; i < p.N && ctx.Err() == nil; i++ {
			id := fmt.Sprintf("bench-%s-%s-%d", e.RunID, strings.TrimPrefix(name, "cluster-"), len(agg.imports)+d.failed)
			returned, all, sz, err := bc.distribute(ctx, m, id, src)
			if err == nil {
				d.samples = append(d.samples, all)
				agg.imports = append(agg.imports, returned)
				agg.size = sz
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

// finishClusterTemplate notes how long the import call took and what
// was distributed.
func finishClusterTemplate(pad int64) func(*Env, *report.Result) {
	return func(e *Env, r *report.Result) {
		bc := &e.clus
		a := bc.agg(r.Scenario)
		img := "the busybox E2B test image (about 1 MiB of layers)"
		if pad > 0 {
			img = fmt.Sprintf("the busybox test image plus a %d MiB layer of random bytes", pad>>20)
		}
		r.Notes = append(r.Notes,
			fmt.Sprintf("%s, %.1f MiB as a template on a node; latency: ImportTemplate through m1 until m1 reports all %d node hosts holding it",
				img, float64(a.size)/(1<<20), len(bc.c.Nodes)),
			summary("the import call alone (m1 stores the image, then waits for every healthy node to pull it from its store)", a.imports),
			"each sample a fresh template ID, deleted from every node after it")
	}
}

// distribute imports template id from src once through master m and
// waits until m reports every node holding it, then deletes it.
func (bc *benchCluster) distribute(ctx context.Context, m *clusterenv.Master, id, src string) (returned, all time.Duration, size int64, err error) {
	began := time.Now()
	resp, err := m.Admin.ImportTemplate(ctx, &masterpb.ImportTemplateRequest{TemplateId: id, Source: src})
	if err != nil {
		return 0, 0, 0, fmt.Errorf("import %s: %w", id, err)
	}
	returned = time.Since(began)
	defer func() {
		if _, derr := m.Admin.DeleteTemplate(context.WithoutCancel(ctx), &masterpb.DeleteTemplateRequest{TemplateId: id}); derr != nil {
			err = errors.Join(err, fmt.Errorf("delete template %s: %w", id, derr))
		}
	}()
	wctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	for {
		if bc.heldEverywhere(wctx, m, id) {
			return returned, time.Since(began), resp.Template.SizeBytes, nil
		}
		select {
		case <-wctx.Done():
			return 0, 0, 0, fmt.Errorf("template %s on every node: %w", id, wctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func (bc *benchCluster) heldEverywhere(ctx context.Context, m *clusterenv.Master, id string) bool {
	resp, err := m.Admin.ListNodes(ctx, &masterpb.ListNodesRequest{})
	if err != nil {
		return false
	}
	held := map[string]bool{}
	for _, v := range resp.Nodes {
		for _, t := range v.Report.Templates {
			if t.Id == id {
				held[v.Report.NodeId] = true
			}
		}
	}
	for _, n := range bc.c.Nodes {
		if !held[n.ID] {
			return false
		}
	}
	return true
}

// paddedImage writes the busybox test image plus a layer holding pad
// bytes of random (incompressible) data as an OCI layout at dir.
func paddedImage(dir string, pad int64) (string, error) {
	base, err := testimage.BusyboxImage()
	if err != nil {
		return "", err
	}
	data := make([]byte, pad)
	_, _ = rand.Read(data)
	var buf bytes.Buffer
	if err := writeOneFileTar(&buf, "pad.bin", data); err != nil {
		return "", err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(buf.Bytes())), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return "", err
	}
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return "", err
	}
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return "", err
	}
	if err := lp.AppendImage(img); err != nil {
		return "", err
	}
	return dir, nil
}

func writeOneFileTar(w io.Writer, name string, data []byte) error {
	tw := tar.NewWriter(w)
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data)),
		ModTime: time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC), Format: tar.FormatPAX}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	if _, err := tw.Write(data); err != nil {
		return err
	}
	return tw.Close()
}
