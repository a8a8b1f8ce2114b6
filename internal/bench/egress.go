package bench

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/master/mastertest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/testbin"
)

// The egress scenarios time what the node's egress path adds (network-agent's
// DNS forwarder and egress proxy, docs/network.md), on a system of their own
// (package mastertest: cubemaster in-process, one cubelet with busybox, runc,
// and a network-agent) in front of a fake internet (a nettest world: a DNS
// server and an HTTPS server with a test CA's certificates). Each cube
// scenario runs interleaved with its baseline, so the report's ratios come
// from one run:
//
//   - egress-https-sni vs egress-https-direct: a small HTTPS GET (new
//     connection, TLS handshake, request, response) from a sandbox's
//     network namespace, through the proxy (SNI checked, TLS passed
//     through) vs under a CIDR policy the proxy never sees;
//   - egress-https-terminated vs egress-https-direct: the same through the
//     proxy terminating TLS to inject a credential (the client trusts the
//     node's egress CA);
//   - egress-create-domain vs egress-create-open: POST /sandboxes on the E2B
//     API with a domain policy (allowOut names, denyOut 0.0.0.0/0) vs the
//     default policy, until the API answers (the sandbox is then deleted).
//
// They build a system of their own, so they run only when named:
//
//	cube-bench egress-https-sni egress-https-terminated egress-create-domain

func init() {
	probe := func(ctx context.Context, e *Env) error {
		if os.Geteuid() != 0 {
			return skipf("it starts a cubemaster, a cubelet and a network-agent of its own (root)")
		}
		if testbin.Root() == "" {
			return skipf("it builds the system from source: run it from the repository")
		}
		if rt := e.Opts.Runtime; rt != "" && rt != "runc" {
			return skipf("its system runs runc sandboxes (this run is for %s)", rt)
		}
		return nil
	}
	one := func(o report.Options) report.Params { return report.Params{N: o.N1, Concurrency: 1} }
	Register(Scenario{
		Name: "egress-https-direct", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "small HTTPS GET from a sandbox's namespace under a CIDR policy (no egress proxy)",
		Params: one, Probe: probe, Run: runEgressHTTPS(egressDirect),
	})
	Register(Scenario{
		Name: "egress-https-sni", Kind: report.KindCube, Explicit: true,
		Help:      "small HTTPS GET from a sandbox through the egress proxy (domain policy: SNI checked, TLS passed through)",
		Baselines: []string{"egress-https-direct"},
		Params:    one, Probe: probe, Run: runEgressHTTPS(egressSNI),
	})
	Register(Scenario{
		Name: "egress-https-terminated", Kind: report.KindCube, Explicit: true,
		Help:      "small HTTPS GET from a sandbox through the egress proxy terminating TLS to inject a credential",
		Baselines: []string{"egress-https-direct"},
		Params:    one, Probe: probe, Run: runEgressHTTPS(egressTerminated),
	})
	Register(Scenario{
		Name: "egress-create-open", Kind: report.KindBaseline, Runtime: "runc",
		Help:   "E2B POST /sandboxes with the default network policy, on a node with network-agent",
		Params: one, Probe: probe, Run: runEgressCreate("egress-create-open", false),
	})
	Register(Scenario{
		Name: "egress-create-domain", Kind: report.KindCube, Explicit: true,
		Help:      "E2B POST /sandboxes with a domain policy (allowOut names, denyOut 0.0.0.0/0)",
		Baselines: []string{"egress-create-open"},
		Params:    one, Probe: probe, Run: runEgressCreate("egress-create-domain", true),
	})
}

// The HTTPS paths.
const (
	egressDirect = iota
	egressSNI
	egressTerminated
	egressPaths
)

// egressNames: the world's HTTPS server answers both on one address;
// secret.test is the one with a credential rule.
const (
	egressName       = "api.allowed.test"
	egressSecretName = "secret.test"
)

// benchEgress is the run's egress system, built on first use.
type benchEgress struct {
	ownSystem
	api   *mastertest.Client
	addr  netip.Addr // the world's HTTPS server
	agent *nettest.Env

	worldCA  *x509.CertPool
	egressCA *x509.CertPool

	mu  sync.Mutex
	sbx [egressPaths]string // the HTTPS scenarios' sandboxes (their namespaces), made on first use
	ids []string            // every sandbox made, deleted at close
}

func (e *Env) egressSystem(ctx context.Context) (*benchEgress, error) {
	b := &e.egress
	err := b.build(ctx, e, "egress", "cubemaster, a cubelet with network-agent and a fake internet", func(tb *benchTB) {
		m := mastertest.StartMaster(tb, "[sandbox]\nmilli_cpu = 100\n")
		n := mastertest.StartNode(tb, m, "busybox")
		w := nettest.NewWorld(tb)
		b.addr = w.Addrs[1]
		up := w.ServeDNS(tb, map[string][]netip.Addr{egressName: {b.addr}, egressSecretName: {b.addr}})
		ca := nettest.NewTestCA(tb, "bench-world-ca")
		cert := ca.Issue(tb, egressName, egressSecretName)
		w.ServeWeb(tb, func(string) *tls.Certificate { return &cert })
		b.worldCA = ca.Pool
		// The node again, now with a network-agent (the forwarder and the
		// proxy) that resolves through the world and trusts its CA.
		n.Stop()
		b.agent = n.Env.StartNetworkAgent(tb, nettest.Options{DNSUpstreams: []string{up.String()}, UpstreamCA: ca.File})
		n.Start()
		m.WaitHealthy(tb, n)
		b.egressCA = x509.NewCertPool()
		if !b.egressCA.AppendCertsFromPEM(b.agent.Agent.EgressCA()) {
			tb.Fatal("the node's egress CA does not parse")
		}
		b.api = m.API(m.APIKey(tb))
		// Before the agent's cleanup, which wants every slot released.
		tb.Cleanup(func() {
			b.mu.Lock()
			ids := b.ids
			b.mu.Unlock()
			_ = b.killAll(context.Background(), ids)
			n.Stop()
		})
	})
	return b, err
}

func (b *benchEgress) close() error { return b.ownSystem.close("egress") }

// create makes a sandbox with network (JSON, "" for none) and returns its
// ID.
func (b *benchEgress) create(ctx context.Context, network string) (string, error) {
	body := `{"templateID":"busybox","timeout":600`
	if network != "" {
		body += `,"network":` + network
	}
	body += "}"
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.api.Base+"/sandboxes", strings.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	var out struct {
		SandboxID string `json:"sandboxID"`
	}
	r, err := b.api.Try(req, &out)
	if err != nil {
		return "", fmt.Errorf("create: %w", err)
	}
	if r.StatusCode/100 != 2 || out.SandboxID == "" {
		return "", fmt.Errorf("create: %s %s", r.Status, bytes.TrimSpace(r.Body))
	}
	b.mu.Lock()
	b.ids = append(b.ids, out.SandboxID)
	b.mu.Unlock()
	return out.SandboxID, nil
}

func (b *benchEgress) killAll(ctx context.Context, ids []string) error {
	var errs []error
	for _, id := range ids {
		req, err := http.NewRequestWithContext(ctx, http.MethodDelete, b.api.Base+"/sandboxes/"+id, nil)
		if err != nil {
			return err
		}
		r, err := b.api.Try(req, nil)
		if err == nil && r.StatusCode != http.StatusNoContent && r.StatusCode != http.StatusNotFound {
			err = fmt.Errorf("delete %s: %s", id, r.Status)
		}
		errs = append(errs, err)
	}
	b.mu.Lock()
	b.ids = slicesWithout(b.ids, ids)
	b.mu.Unlock()
	return errors.Join(errs...)
}

func slicesWithout(all, gone []string) []string {
	drop := map[string]bool{}
	for _, g := range gone {
		drop[g] = true
	}
	var out []string
	for _, a := range all {
		if !drop[a] {
			out = append(out, a)
		}
	}
	return out
}

// sandbox returns the namespace of path's sandbox, creating it (and
// resolving its name through the sandbox's own resolver, which opens the
// address to a domain policy) on first use.
func (b *benchEgress) sandbox(ctx context.Context, path int) (string, error) {
	b.mu.Lock()
	ns := b.sbx[path]
	b.mu.Unlock()
	if ns != "" {
		return ns, nil
	}
	network, name := fmt.Sprintf(`{"allowOut":[%q],"denyOut":["0.0.0.0/0"]}`, b.addr), egressName
	switch path {
	case egressSNI:
		network = fmt.Sprintf(`{"allowOut":[%q],"denyOut":["0.0.0.0/0"]}`, egressName)
	case egressTerminated:
		name = egressSecretName
		network = fmt.Sprintf(`{"allowOut":[%q],"denyOut":["0.0.0.0/0"],"credentials":[{"host":%q,"header":"Authorization","value":"Bearer bench"}]}`,
			egressSecretName, egressSecretName)
	}
	id, err := b.create(ctx, network)
	if err != nil {
		return "", err
	}
	nw, err := b.agent.Agent.Get(ctx, id)
	if err != nil {
		return "", fmt.Errorf("the network of %s: %w", id, err)
	}
	if path != egressDirect {
		a, err := nettest.Resolve(ctx, nw.NetNS, netip.MustParseAddrPort("169.254.0.22:53"), "udp", name, 5*time.Second)
		if err != nil || len(a.Addrs) == 0 {
			return "", fmt.Errorf("resolve %s in %s: %v %v", name, id, a, err)
		}
	}
	b.mu.Lock()
	b.sbx[path] = nw.NetNS
	b.mu.Unlock()
	return nw.NetNS, nil
}

// get makes one HTTPS GET for name to the world's server from ns, on a
// new connection, trusting roots.
func (b *benchEgress) get(ctx context.Context, ns, name string, roots *x509.CertPool) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	raw, err := nsdial.DialContext(ctx, ns, "tcp4", netip.AddrPortFrom(b.addr, 443).String())
	if err != nil {
		return err
	}
	defer raw.Close()
	_ = raw.SetDeadline(time.Now().Add(10 * time.Second))
	c := tls.Client(raw, &tls.Config{ServerName: name, RootCAs: roots, NextProtos: []string{"http/1.1"}})
	if err := c.HandshakeContext(ctx); err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", name); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET https://%s/: %s", name, resp.Status)
	}
	return nil
}

func runEgressHTTPS(path int) func(context.Context, *Env, report.Params) (*report.Result, error) {
	name := [egressPaths]string{"egress-https-direct", "egress-https-sni", "egress-https-terminated"}[path]
	return func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
		b, err := e.egressSystem(ctx)
		if err != nil {
			return nil, err
		}
		ns, err := b.sandbox(ctx, path)
		if err != nil {
			return nil, err
		}
		host, roots := egressName, b.worldCA
		if path == egressTerminated {
			host, roots = egressSecretName, b.egressCA
		}
		e.Progress.Start(name, p.N)
		d := drive(ctx, e.Progress, p.N, p.Concurrency, func(ctx context.Context, _ int) (time.Duration, error) {
			start := time.Now()
			err := b.get(ctx, ns, host, roots)
			return time.Since(start), err
		})
		e.Progress.Finish()
		return d.result(name, kindOf(path), p)
	}
}

func kindOf(path int) report.Kind {
	if path == egressDirect {
		return report.KindBaseline
	}
	return report.KindCube
}

func runEgressCreate(name string, domains bool) func(context.Context, *Env, report.Params) (*report.Result, error) {
	kind, network := report.KindBaseline, ""
	if domains {
		kind, network = report.KindCube, fmt.Sprintf(`{"allowOut":[%q,"*.pypi.org"],"denyOut":["0.0.0.0/0"]}`, egressName)
	}
	return func(ctx context.Context, e *Env, p report.Params) (*report.Result, error) {
		b, err := e.egressSystem(ctx)
		if err != nil {
			return nil, err
		}
		var mu sync.Mutex
		var ids []string
		e.Progress.Start(name, p.N)
		d := drive(ctx, e.Progress, p.N, p.Concurrency, func(ctx context.Context, _ int) (time.Duration, error) {
			start := time.Now()
			id, err := b.create(ctx, network)
			took := time.Since(start)
			if id != "" {
				mu.Lock()
				ids = append(ids, id)
				mu.Unlock()
			}
			return took, err
		})
		e.Progress.Finish()
		if err := b.killAll(context.WithoutCancel(ctx), ids); err != nil {
			return nil, err
		}
		return d.result(name, kind, p)
	}
}
