package main

import (
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/cubesandbox/cube/internal/network/nettest"
)

// The egress spec's fake internet (-egress): a nettest world in its own
// namespace with a DNS server and HTTP/HTTPS servers (certificates from a
// test CA) on its three addresses; network-agent forwards the sandboxes'
// DNS to it and verifies upstreams against the test CA. The names:
//
//	api.allowed.test, cdn.allowed.test  two allowed names on addresses 1 and 2
//	pkg.wild.test                       under a wildcard (address 2)
//	evil.test                           a name no policy allows (address 0,
//	                                    also the allowed names' neighbour)
var egressNames = map[string]int{"api.allowed.test": 1, "cdn.allowed.test": 2, "pkg.wild.test": 2, "evil.test": 0}

// egressWorld is what the spec is told about the world (CUBE_E2E_EGRESS,
// JSON), and what it needs to run.
type egressWorld struct {
	Names map[string]string `json:"names"` // name -> address
	Addrs []string          `json:"addrs"`
	// CA is the test CA's PEM file (the spec uploads it for clients that
	// check the world's certificates themselves).
	CA string `json:"ca"`
	// Probe is egressprobe's binary, built static for the sandboxes.
	Probe string `json:"probe"`
	// Requests is a URL on loopback answering what the world's web
	// servers received (JSON: host, sni, path, authorization), so the
	// spec can tell what an upstream saw.
	Requests string `json:"requests"`
	// AuditDir holds network-agent's audit files (<sandbox>.jsonl).
	AuditDir string `json:"auditDir"`
	// Agent is network-agent's binary (the spec stops it by pid, found by
	// this path, and keeps it from restarting while it checks that
	// domain-restricted sandboxes fail closed); AgentHTTP its api.http.
	Agent     string `json:"agent"`
	AgentHTTP string `json:"agentHTTP"`

	network string // network-agent's extra config, beside networkTOML's
	dns     string // the world's DNS server
	tb      *progTB
}

// startEgressWorld builds the world and the probe; stop removes them.
func startEgressWorld(bin, stateDir string) (w *egressWorld, err error) {
	tb := newProgTB()
	defer func() {
		if r := recover(); r != nil {
			if f, ok := r.(progFatal); ok {
				tb.cleanup()
				w, err = nil, errors.New(string(f))
				return
			}
			panic(r)
		}
	}()
	world := nettest.NewWorld(tb)
	ca := nettest.NewTestCA(tb, "cube-e2e-world-ca")
	records := map[string][]netip.Addr{}
	w = &egressWorld{Names: map[string]string{}, CA: ca.File, tb: tb, AuditDir: filepath.Join(stateDir, "network", "audit"),
		Agent: filepath.Join(bin, "network-agent")}
	for n, i := range egressNames {
		records[n] = []netip.Addr{world.Addrs[i]}
		w.Names[n] = world.Addrs[i].String()
	}
	for _, a := range world.Addrs {
		w.Addrs = append(w.Addrs, a.String())
	}
	dnsAddr := world.ServeDNS(tb, records)
	var mu sync.Mutex
	certs := map[string]*tls.Certificate{}
	web := world.ServeWeb(tb, func(sni string) *tls.Certificate {
		mu.Lock()
		defer mu.Unlock()
		if c := certs[sni]; c != nil {
			return c
		}
		name := sni
		if name == "" {
			name = "no-sni.test"
		}
		c := ca.Issue(tb, name)
		certs[sni] = &c
		return &c
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(progFatal(err.Error()))
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		type seen struct {
			Host          string `json:"host"`
			SNI           string `json:"sni"`
			Path          string `json:"path"`
			Authorization string `json:"authorization"`
		}
		out := []seen{}
		for _, r := range web.Requests() {
			out = append(out, seen{Host: r.Host, SNI: r.SNI, Path: r.Path, Authorization: r.Header.Get("Authorization")})
		}
		_ = json.NewEncoder(rw).Encode(out)
	})}
	go func() { _ = srv.Serve(ln) }()
	tb.Cleanup(func() { _ = srv.Close() })
	w.Requests = "http://" + ln.Addr().String()
	if w.AgentHTTP, err = freeAddr(); err != nil {
		panic(progFatal(err.Error()))
	}
	w.Probe = filepath.Join(bin, "egressprobe")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", w.Probe, "./test/e2e/node/system/egressprobe")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		panic(progFatal(fmt.Sprintf("build egressprobe: %v\n%s", err, out)))
	}
	w.dns = dnsAddr.String()
	// network-agent's health listener is w.AgentHTTP (networkTOML's
	// [api] http): the spec asks it and kills the agent by it.
	w.network = fmt.Sprintf("[egress]\nupstream_ca = %q\n", ca.File)
	return w, nil
}

func (w *egressWorld) env() string {
	b, _ := json.Marshal(w)
	return "CUBE_E2E_EGRESS=" + string(b)
}

func (w *egressWorld) stop() error {
	w.tb.cleanup()
	if len(w.tb.errs) > 0 {
		return errors.Join(w.tb.errs...)
	}
	return nil
}

// progTB lets a program use nettest's helpers, which take a testing.TB:
// cleanups run at stop, Fatal panics with progFatal (startEgressWorld
// recovers it), Errorf is collected. Methods nettest does not call are
// left to the nil embedded TB (and would panic).
type progTB struct {
	testing.TB
	mu       sync.Mutex
	cleanups []func()
	errs     []error
}

type progFatal string

func newProgTB() *progTB { return &progTB{} }

func (t *progTB) Helper() {}

func (t *progTB) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}

func (t *progTB) TempDir() string {
	d, err := os.MkdirTemp("", "cube-e2e-egress-")
	if err != nil {
		panic(progFatal(err.Error()))
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func (t *progTB) Fatal(args ...any) { panic(progFatal(fmt.Sprint(args...))) }

func (t *progTB) Fatalf(format string, args ...any) { panic(progFatal(fmt.Sprintf(format, args...))) }

func (t *progTB) Skip(args ...any) { panic(progFatal("skipped: " + fmt.Sprint(args...))) }

func (t *progTB) Skipf(format string, args ...any) { t.Skip(fmt.Sprintf(format, args...)) }

func (t *progTB) SkipNow() { t.Skip("skipped") }

func (t *progTB) Errorf(format string, args ...any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.errs = append(t.errs, fmt.Errorf(format, args...))
}

func (t *progTB) Error(args ...any) { t.Errorf("%s", fmt.Sprint(args...)) }

func (t *progTB) Logf(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }

func (t *progTB) Log(args ...any) { fmt.Fprintln(os.Stderr, args...) }

func (t *progTB) Name() string { return "e2e-egress" }

// cleanup runs the cleanups, last registered first (as testing does).
func (t *progTB) cleanup() {
	t.mu.Lock()
	fs := t.cleanups
	t.cleanups = nil
	t.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}
