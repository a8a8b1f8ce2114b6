package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// profiler captures cubelet's CPU profile in consecutive windows while a
// scenario runs (the pprof endpoint only profiles for a fixed number of
// seconds, and a scenario's length is not known up front), plus heap
// profiles at the scenario's peak and end. `go tool pprof` merges the
// windows: go tool pprof -top bin/cubelet DIR/cpu-*.pb.gz
type profiler struct {
	base   string // http://host:port of cubelet's metrics listener
	dir    string
	window time.Duration
	client *http.Client

	stop chan struct{}
	done chan struct{}

	mu    sync.Mutex
	files []string
	errs  []error
	heaps map[string]bool
}

// startProfiler begins capturing into dir.
// hc (nil: a plain client) reads base.
func startProfiler(ctx context.Context, hc *http.Client, base, dir string, window time.Duration) (*profiler, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if window < time.Second {
		window = time.Second
	}
	if hc == nil {
		hc = &http.Client{}
	}
	p := &profiler{
		base: base, dir: dir, window: window.Round(time.Second),
		client: hc,
		stop:   make(chan struct{}), done: make(chan struct{}),
		heaps: map[string]bool{},
	}
	// Fail fast when pprof is off rather than after the scenario.
	if err := p.fetch(ctx, "/debug/pprof/", ""); err != nil {
		return nil, fmt.Errorf("cubelet pprof at %s (set [api] pprof = true): %w", base, err)
	}
	go p.loop(context.WithoutCancel(ctx))
	return p, nil
}

func (p *profiler) loop(ctx context.Context) {
	defer close(p.done)
	for i := 0; ; i++ {
		select {
		case <-p.stop:
			return
		default:
		}
		name := filepath.Join(p.dir, fmt.Sprintf("cpu-%03d.pb.gz", i))
		url := fmt.Sprintf("/debug/pprof/profile?seconds=%d", int(p.window.Seconds()))
		if err := p.fetch(ctx, url, name); err != nil {
			p.fail(err)
			return
		}
	}
}

// heap saves a heap profile (after a GC, so in-use figures are current).
func (p *profiler) heap(ctx context.Context, label string) {
	p.mu.Lock()
	if p.heaps[label] {
		p.mu.Unlock()
		return
	}
	p.heaps[label] = true
	p.mu.Unlock()
	if err := p.fetch(ctx, "/debug/pprof/heap?gc=1", filepath.Join(p.dir, "heap-"+label+".pb.gz")); err != nil {
		p.fail(err)
	}
}

// finish waits for the CPU window in flight, takes the end heap profile
// and returns the files written.
func (p *profiler) finish(ctx context.Context) ([]string, error) {
	close(p.stop)
	<-p.done
	p.heap(ctx, "end")
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.files, errors.Join(p.errs...)
}

func (p *profiler) fail(err error) {
	p.mu.Lock()
	p.errs = append(p.errs, err)
	p.mu.Unlock()
}

// fetch GETs path and writes the body to file ("" = discard).
func (p *profiler) fetch(ctx context.Context, path, file string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.base+path, nil)
	if err != nil {
		return err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("GET %s: %s: %s", path, resp.Status, msg)
	}
	if file == "" {
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	p.mu.Lock()
	p.files = append(p.files, file)
	p.mu.Unlock()
	return nil
}
