package vmguest

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/testenv"
)

// testCacheDir keeps the kernel package between runs; the guest built from
// it lives in a subdirectory, shared by this package's tests.
const testCacheDir = DefaultCacheDir

// TestGuestDir is where the tests build the guest once.
var TestGuestDir = filepath.Join(testCacheDir, "guest-test")

func requireTools(t testing.TB) {
	t.Helper()
	for _, tool := range []string{"apt-cache", "apt-get", "dpkg-deb"} {
		if _, err := exec.LookPath(tool); err != nil {
			testenv.Missing(t, "%s not installed", tool)
		}
	}
	testenv.RequireRoot(t, "apt-get download into the cache")
}

func TestBuildCacheHitAndContents(t *testing.T) {
	requireTools(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	a, err := Build(ctx, BuildConfig{OutDir: TestGuestDir, CacheDir: testCacheDir})
	if err != nil {
		t.Fatal(err)
	}
	pkg, version, err := resolveKernel(ctx, DefaultMetapackage)
	if err != nil {
		t.Fatal(err)
	}
	if a.KernelVersion != version || !strings.HasSuffix(pkg, version) {
		t.Fatalf("kernel %q, apt says %q (%s)", a.KernelVersion, version, pkg)
	}

	// Second build: cache hit, no file rewritten.
	st, _ := os.Stat(a.Initrd)
	start := time.Now()
	b, err := Build(ctx, BuildConfig{OutDir: TestGuestDir, CacheDir: testCacheDir})
	if err != nil {
		t.Fatal(err)
	}
	st2, _ := os.Stat(b.Initrd)
	if !st2.ModTime().Equal(st.ModTime()) {
		t.Fatal("cache hit rewrote initrd.img")
	}
	t.Logf("cache hit in %v", time.Since(start))

	files := readCpio(t, a.Initrd)
	for _, want := range []string{"init", "bin/busybox", "bin/switch_root", "bin/insmod", "dev/console", "etc/modules", "newroot"} {
		if _, ok := files[want]; !ok {
			t.Errorf("initramfs lacks %s", want)
		}
	}
	if got := files["dev/console"]; got.mode&0o170000 != cpioChar || got.rmajor != 5 || got.rminor != 1 {
		t.Errorf("dev/console: mode %o rdev %d:%d", got.mode, got.rmajor, got.rminor)
	}
	if got := strings.Fields(string(files["etc/modules"].data)); strings.Join(got, ",") != strings.Join(a.Modules, ",") {
		t.Errorf("etc/modules %v, guest.json %v", got, a.Modules)
	}
	// Dependencies come before their users, and every root module (or the
	// kernel itself) provides what the guest needs.
	pos := map[string]int{}
	for i, m := range a.Modules {
		pos[m] = i
		if _, ok := files["lib/modules/"+m+".ko"]; !ok {
			t.Errorf("module %s listed but not in the initramfs", m)
		}
	}
	for _, pair := range [][2]string{{"virtio", "virtio_mmio"}, {"virtio_ring", "virtio_blk"}, {"net_failover", "virtio_net"}} {
		if pos[pair[0]] >= pos[pair[1]] {
			t.Errorf("%s must load before %s: %v", pair[0], pair[1], a.Modules)
		}
	}
	for _, r := range []string{"virtio_mmio", "virtio_blk", "virtio_net", "virtio_console"} {
		if _, ok := pos[r]; !ok {
			t.Errorf("root module %s missing (%v)", r, a.Modules)
		}
	}
}

func TestLoadErrors(t *testing.T) {
	if _, err := Load(t.TempDir()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("empty dir: %v", err)
	}
	if _, err := Load(""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("no dir: %v", err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, ManifestFile), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad json: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, ManifestFile), []byte(`{"kernel_version":"x"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("no kernel: %v", err)
	}
}

func TestBuildUnknownMetapackage(t *testing.T) {
	requireTools(t)
	out := t.TempDir()
	_, err := Build(context.Background(), BuildConfig{OutDir: out, CacheDir: t.TempDir(), Metapackage: "cube-no-such-package"})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("got %v", err)
	}
	if ents, _ := os.ReadDir(out); len(ents) != 0 {
		t.Fatalf("failed build left %d files", len(ents))
	}
}

func TestCmdline(t *testing.T) {
	got := Cmdline(CmdlineOptions{TCG: true, Hostname: "sb-1", Net: &NetConfig{
		Addr: netip.MustParsePrefix("169.254.0.21/30"), Gateway: netip.MustParseAddr("169.254.0.22")},
		Extra: []string{"foo=bar"}})
	for _, want := range []string{"console=ttyS0", "root=/dev/vda rw rootfstype=ext4", "panic=-1", "tsc=reliable no_timer_check " + TCGTSCParam,
		"cube.hostname=sb-1", "cube.ip=169.254.0.21/30", "cube.gw=169.254.0.22", "foo=bar"} {
		if !strings.Contains(got, want) {
			t.Errorf("cmdline %q lacks %q", got, want)
		}
	}
	if kvm := Cmdline(CmdlineOptions{}); strings.Contains(kvm, "tsc=reliable") || strings.Contains(kvm, "cube.") {
		t.Errorf("KVM cmdline %q", kvm)
	}
	// A P-256 CA certificate is ~400 bytes of DER: with everything else
	// the line stays well under x86's 2048-byte COMMAND_LINE_SIZE.
	ca := Cmdline(CmdlineOptions{TCG: true, Hostname: strings.Repeat("h", 63), TokenHash: strings.Repeat("a", 64),
		Resolver: netip.MustParseAddr("169.254.0.22"), EgressCA: make([]byte, 600),
		Net: &NetConfig{Addr: netip.MustParsePrefix("169.254.0.21/30"), Gateway: netip.MustParseAddr("169.254.0.22")}})
	if !strings.Contains(ca, "cube.egress_ca=") || len(ca) > 1536 {
		t.Errorf("cmdline with a CA: %d bytes: %q", len(ca), ca)
	}
}

type cpioEntry struct {
	mode, rmajor, rminor uint32
	data                 []byte
}

// readCpio parses the newc archive independently of the writer.
func readCpio(t *testing.T, path string) map[string]cpioEntry {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]cpioEntry{}
	off := 0
	align := func(n int) int { return (n + 3) &^ 3 }
	hex := func(i int) uint32 {
		v, err := strconv.ParseUint(string(raw[off+6+8*i:off+14+8*i]), 16, 32)
		if err != nil {
			t.Fatalf("bad header at %d: %v", off, err)
		}
		return uint32(v)
	}
	for {
		if !bytes.HasPrefix(raw[off:], []byte("070701")) {
			t.Fatalf("bad magic at %d", off)
		}
		mode, size, rmaj, rmin, nsize := hex(1), hex(6), hex(9), hex(10), hex(11)
		name := string(raw[off+110 : off+110+int(nsize)-1])
		dataOff := align(off + 110 + int(nsize))
		if name == "TRAILER!!!" {
			return out
		}
		out[name] = cpioEntry{mode: mode, rmajor: rmaj, rminor: rmin, data: raw[dataOff : dataOff+int(size)]}
		off = align(dataOff + int(size))
	}
}
