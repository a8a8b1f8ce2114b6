package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestGvisorMeasure prints the medians docs/gvisor.md reports at
// cubelet level (each verb as the API serves it: agent answering), and in
// the same run the bare runsc commands on a bundle of the same template.
// It only runs with CUBE_GVISOR_MEASURE=<rounds>.
func TestGvisorMeasure(t *testing.T) {
	n := 0
	if _, err := fmt.Sscan(os.Getenv("CUBE_GVISOR_MEASURE"), &n); err != nil || n <= 0 {
		t.Skip("set CUBE_GVISOR_MEASURE=<rounds> to measure")
	}
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 16})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	env.ImportBusybox(t, svc, "warm")
	defer func() {
		deleteAll(t, svc, mustList(t, svc))
		for _, sn := range listSnaps(t, svc, "") {
			_ = svc.DeleteSnapshot(ctx, sn)
		}
		env.AssertNoLeaks(t)
	}()
	if _, err := svc.WarmTemplate(ctx, "warm", "gvisor"); err != nil {
		t.Fatalf("warm template: %v", err)
	}

	times := map[string][]time.Duration{}
	timed := func(name string, fn func() error) {
		t.Helper()
		begin := time.Now()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		times[name] = append(times[name], time.Since(begin))
	}
	for i := range n {
		var a *sandbox.Record
		timed("create (cold)", func() error {
			res, err := svc.Create(ctx, cubelet.CreateRequest{SandboxID: fmt.Sprintf("ms-%d", i), TemplateID: "busybox", Runtime: "gvisor"})
			if err == nil {
				a = res.Sandbox
			}
			return err
		})
		timed("create from warm template", func() error {
			res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "warm"})
			if err == nil && !res.Warm {
				err = fmt.Errorf("create from warm template was not warm")
			}
			return err
		})
		timed("pause (memory)", func() error { _, err := svc.Pause(ctx, a.ID); return err })
		timed("resume (memory)", func() error { _, err := svc.Resume(ctx, a.ID); return err })
		timed("pause-to-disk", func() error { _, err := svc.PauseTo(ctx, a.ID, sandbox.PauseDisk); return err })
		timed("resume from disk", func() error { _, err := svc.Resume(ctx, a.ID); return err })
		var sn *cubelet.SnapshotResult
		timed("snapshot with memory (running)", func() error {
			var err error
			sn, err = svc.Snapshot(ctx, cubelet.SnapshotRequest{SandboxID: a.ID})
			return err
		})
		timed("clone of 1", func() error {
			_, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.Snapshot.ID, Count: 1})
			return err
		})
		if i%3 == 0 {
			timed("clone of 10", func() error {
				_, err := svc.Clone(ctx, cubelet.CloneRequest{SnapshotID: sn.Snapshot.ID, Count: 10})
				return err
			})
		}
		var rest []*sandbox.Record
		for _, r := range mustList(t, svc) {
			if r.ID != a.ID {
				rest = append(rest, r)
			}
		}
		deleteAll(t, svc, rest)
		timed("destroy", func() error { _, err := svc.Delete(ctx, a.ID); return err })
		if err := svc.DeleteSnapshot(ctx, sn.Snapshot.ID); err != nil {
			t.Fatal(err)
		}
	}
	measureRawRunsc(t, env, svc, n, timed)

	names := make([]string, 0, len(times))
	for k := range times {
		names = append(names, k)
	}
	slices.Sort(names)
	var tb strings.Builder
	fmt.Fprintf(&tb, "%-50s %10s %4s\n", "operation", "median", "n")
	for _, k := range names {
		v := slices.Clone(times[k])
		slices.Sort(v)
		fmt.Fprintf(&tb, "%-50s %7.1f ms %4d\n", k, float64(v[len(v)/2].Microseconds())/1000, len(v))
	}
	med := func(k string) float64 {
		v := slices.Clone(times[k])
		slices.Sort(v)
		return float64(v[len(v)/2].Microseconds()) / 1000
	}
	// The target: a snapshot that keeps the sandbox running within 1.2x of
	// what runsc needs to checkpoint and restore (its delete in between is
	// what the driver keeps off the path).
	if raw := med("raw: runsc checkpoint") + med("raw: runsc restore -detach"); raw > 0 {
		fmt.Fprintf(&tb, "snapshot with memory (running) / (raw checkpoint + raw restore) = %.2fx\n", med("snapshot with memory (running)")/raw)
	}
	t.Log("\n" + tb.String())
}

// deleteAll destroys sandboxes in parallel (each delete waits ~1.4 s for
// runsc here, which is not what is measured).
func deleteAll(t *testing.T, svc *cubelet.Service, recs []*sandbox.Record) {
	t.Helper()
	var wg sync.WaitGroup
	for _, r := range recs {
		wg.Go(func() {
			if _, err := svc.Delete(context.Background(), r.ID); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
}

// measureRawRunsc times the bare runsc commands the verbs wrap, with the
// driver's global flags, on a bundle made from a cubelet sandbox's: same
// root filesystem and spec, a busybox shell counter as PID 1 (an agent
// cannot be checkpointed while it listens), no network namespace and no
// cgroup, and a runsc root of its own.
func measureRawRunsc(t *testing.T, env *cubelettest.Env, svc *cubelet.Service, n int, timed func(string, func() error)) {
	t.Helper()
	ctx := context.Background()
	host := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "ms-raw-host", Runtime: "gvisor"})
	bundle := filepath.Join(t.TempDir(), "bundle")
	writeRawBundle(t, host.Container.Bundle, bundle)
	root := t.TempDir()
	logPath := filepath.Join(t.TempDir(), "runsc.out")
	raw := func(args ...string) error {
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		argv := append([]string{"--root", root, "--platform=" + env.Config.Gvisor.Platform, "--network=none"}, args...)
		cmd := exec.CommandContext(ctx, env.Config.Gvisor.Binary, argv...)
		// Files, not pipes: runsc hands its stdio to a detached sandbox,
		// and a pipe would stay open (and Wait block) as long as it lives.
		out, err := os.Create(logPath)
		if err != nil {
			return err
		}
		defer out.Close()
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Run(); err != nil {
			b, _ := os.ReadFile(logPath)
			return fmt.Errorf("runsc %s: %w: %s", strings.Join(args, " "), err, b)
		}
		return nil
	}
	for i := range n {
		id := fmt.Sprintf("msraw%d", i)
		t.Cleanup(func() { _ = raw("delete", "-force", id) })
		timed("raw: runsc run -detach", func() error { return raw("run", "-detach", "--bundle", bundle, id) })
		time.Sleep(200 * time.Millisecond)
		timed("raw: runsc pause", func() error { return raw("pause", id) })
		timed("raw: runsc resume", func() error { return raw("resume", id) })
		img := filepath.Join(t.TempDir(), "img")
		timed("raw: runsc checkpoint", func() error { return raw("checkpoint", "--image-path", img, id) })
		timed("raw: runsc delete -force (checkpointed)", func() error { return raw("delete", "-force", id) })
		timed("raw: runsc restore -detach", func() error {
			return raw("restore", "--image-path", img, "-detach", "--bundle", bundle, id)
		})
		timed("raw: runsc delete -force (running)", func() error { return raw("delete", "-force", id) })
	}
	if _, err := svc.Delete(ctx, host.ID); err != nil {
		t.Fatal(err)
	}
}

func writeRawBundle(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(from, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	spec["process"].(map[string]any)["args"] = []string{"/bin/sh", "-c", `i=0; while :; do i=$((i+1)); sleep 0.1; done`}
	linux := spec["linux"].(map[string]any)
	delete(linux, "cgroupsPath")
	delete(linux, "resources")
	var ns []any
	for _, x := range linux["namespaces"].([]any) {
		if x.(map[string]any)["type"] != "network" {
			ns = append(ns, x)
		}
	}
	linux["namespaces"] = ns
	if err := os.MkdirAll(to, 0o700); err != nil {
		t.Fatal(err)
	}
	out, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(to, "config.json"), out, 0o600); err != nil {
		t.Fatal(err)
	}
}
