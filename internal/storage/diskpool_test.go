package storage

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// readyFiles lists the files under the pool's ready dir for one template.
func readyFiles(t *testing.T, d *DiskPool, tmpl string) []string {
	t.Helper()
	ents, _ := os.ReadDir(filepath.Join(d.Dir(), tmpl))
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

func waitReady(t *testing.T, d *DiskPool, tmpl string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for _, s := range d.Stats() {
			if s.TemplateID == tmpl && s.Ready == n {
				return
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("template %s never had %d ready disks: %+v", tmpl, n, d.Stats())
}

func stat(d *DiskPool, tmpl string) DiskPoolStats {
	for _, s := range d.Stats() {
		if s.TemplateID == tmpl {
			return s
		}
	}
	return DiskPoolStats{}
}

func TestDiskPool(t *testing.T) {
	requireRoot(t)
	p := openTestPool(t, PoolConfig{})
	ctx := context.Background()
	content := bytes.Repeat([]byte("template image\n"), 4096)
	img := p.TemplateImagePath("tmpl")
	if err := os.MkdirAll(filepath.Dir(img), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(img, content, 0o644); err != nil {
		t.Fatal(err)
	}
	src := DiskSource{TemplateID: "tmpl", Image: img, Gen: 7}

	d := NewDiskPool(p, DiskPoolConfig{Size: 3})
	if _, _, err := d.Start([]DiskSource{src}); err != nil {
		t.Fatal(err)
	}
	waitReady(t, d, "tmpl", 3)

	// A hit renames a ready disk into place: same content, and the pool
	// refills behind it.
	dst := p.SandboxDiskPath("sb1")
	hit, err := d.Take(ctx, src, dst)
	if err != nil || !hit {
		t.Fatalf("take from a full pool: hit=%v err=%v", hit, err)
	}
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, content) {
		t.Fatal("pooled disk does not hold the template's content")
	}
	waitReady(t, d, "tmpl", 3)

	// A burst larger than the pool: every take succeeds, the ones that
	// find the pool empty clone inline.
	for i := range 6 {
		if _, err := d.Take(ctx, src, p.SandboxDiskPath("burst"+string(rune('a'+i)))); err != nil {
			t.Fatal(err)
		}
	}
	if s := stat(d, "tmpl"); s.Hits+s.Misses != 7 || s.Hits < 3 {
		t.Fatalf("after 7 takes: %+v", s)
	}
	// dst exists: a take never replaces a disk.
	if _, err := d.Take(ctx, src, dst); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("take over an existing disk: %v", err)
	}

	// Drain removes the ready disks and keeps the template from coming
	// back; a new generation registers again.
	waitReady(t, d, "tmpl", 3)
	if err := d.Drain("tmpl"); err != nil {
		t.Fatal(err)
	}
	if hit, err := d.Take(ctx, src, p.SandboxDiskPath("after-drain")); err != nil || hit {
		t.Fatalf("take after drain: hit=%v err=%v", hit, err)
	}
	time.Sleep(50 * time.Millisecond)
	if f := readyFiles(t, d, "tmpl"); len(f) != 0 || len(d.Stats()) != 0 {
		t.Fatalf("drained template refilled: %v %+v", f, d.Stats())
	}
	src2 := src
	src2.Gen = 8
	if _, err := d.Take(ctx, src2, p.SandboxDiskPath("gen8")); err != nil {
		t.Fatal(err)
	}
	waitReady(t, d, "tmpl", 3)

	// A restart adopts the ready disks of known templates and generations
	// and removes everything else. Simulate the crash by not closing d:
	// stop its refiller only.
	d.cancel()
	<-d.done
	stale := filepath.Join(d.Dir(), "tmpl", "7-000999.img")
	tmp := filepath.Join(d.Dir(), "tmpl", ".8-000998.tmp")
	gone := filepath.Join(d.Dir(), "deleted-template", "8-000001.img")
	for _, f := range []string{stale, tmp, gone} {
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	before := readyFiles(t, d, "tmpl")
	d2 := NewDiskPool(p, DiskPoolConfig{Size: 3})
	adopted, removed, err := d2.Start([]DiskSource{src2})
	if err != nil || adopted != 3 || removed != 3 {
		t.Fatalf("restart: adopted %d removed %d err %v (files before: %v)", adopted, removed, err, before)
	}
	if hit, err := d2.Take(ctx, src2, p.SandboxDiskPath("adopted")); err != nil || !hit {
		t.Fatalf("take of an adopted disk: hit=%v err=%v", hit, err)
	}
	for _, f := range []string{stale, tmp, filepath.Dir(gone)} {
		if _, err := os.Stat(f); !os.IsNotExist(err) {
			t.Errorf("%s survived the restart sweep", f)
		}
	}

	// Close removes every ready disk; takes afterwards clone inline.
	if err := d2.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(d2.Dir()); !os.IsNotExist(err) {
		t.Fatalf("ready dir survived Close: %v", err)
	}
	if hit, err := d2.Take(ctx, src2, p.SandboxDiskPath("closed")); err != nil || hit {
		t.Fatalf("take after close: hit=%v err=%v", hit, err)
	}
}

func TestDiskPoolDisabledAndBrokenSource(t *testing.T) {
	requireRoot(t)
	p := openTestPool(t, PoolConfig{})
	ctx := context.Background()
	off := NewDiskPool(p, DiskPoolConfig{Size: 0})
	missing := DiskSource{TemplateID: "nope", Image: p.TemplateImagePath("nope"), Gen: 1}
	if _, _, err := off.Start(nil); err != nil {
		t.Fatal(err)
	}
	defer off.Close()
	if _, err := off.Take(ctx, missing, p.SandboxDiskPath("x")); err == nil {
		t.Fatal("take of a missing image succeeded")
	}
	if _, err := os.Stat(p.SandboxDiskPath("x")); !os.IsNotExist(err) {
		t.Fatal("failed take left a file")
	}

	// A source that cannot be cloned does not make the refiller spin:
	// it marks the set broken until the next take.
	d := NewDiskPool(p, DiskPoolConfig{Size: 2})
	if _, _, err := d.Start([]DiskSource{missing}); err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	time.Sleep(100 * time.Millisecond)
	if s := stat(d, "nope"); s.Ready != 0 {
		t.Fatalf("broken source: %+v", s)
	}
	if f := readyFiles(t, d, "nope"); len(f) != 0 {
		t.Fatalf("broken source left files: %v", f)
	}
}
