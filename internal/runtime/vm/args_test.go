package vm

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/runtime"
)

var update = flag.Bool("update", false, "rewrite testdata golden files")

// TestQEMUArgsGolden pins the QEMU command lines a boot and a restore use
// (jailed: descriptors only) and a raw restore's (paths, daemonized).
func TestQEMUArgsGolden(t *testing.T) {
	p := paths{Disk: "/pool/s1.ext4", QMP: "/run/b/qmp.sock", Agent: "/run/b/agent.sock", Console: "/run/b/console.log", PIDFile: "/run/b/qemu.pid", Log: "/run/b/qemu.log", VsockCID: 1234}
	fds := &qemuFDs{Name: nameMarker("/run/b"), QMP: 3, Agent: 4, Disk: 5, Console: 6, Tap: 8, VhostNet: 9, Vsock: 10}
	tcg := Shape{MemoryMiB: 256, VCPUs: 1, Accel: "tcg", Machine: Machine, CPU: cpuModel("tcg"), Kernel: "/g/vmlinuz", Initrd: "/g/initrd.img", Cmdline: "console=ttyS0 root=/dev/vda", Devices: []string{"virtio-blk", "virtio-serial"}}
	tmpl := tcg
	tmpl.RAMObject, tmpl.SharedRAM = true, true
	clone := tmpl
	clone.SharedRAM = false
	ramFDs := *fds
	ramFDs.RAM = 7
	cases := map[string]struct {
		s        Shape
		incoming bool
		fds      *qemuFDs
		share    bool
	}{
		"tcg-template-boot":     {tmpl, false, &ramFDs, true},
		"tcg-template-clone":    {clone, true, &ramFDs, false},
		"tcg-clone-of-a-clone":  {clone, true, fds, false},
		"tcg-boot":              {tcg, false, fds, false},
		"kvm-restore-net-vsock": {Shape{MemoryMiB: 512, VCPUs: 2, Accel: "kvm", Machine: Machine, CPU: cpuModel("kvm"), Kernel: "/g/vmlinuz", Initrd: "/g/initrd.img", Cmdline: "console=ttyS0", Devices: []string{"virtio-blk", "virtio-serial", "vhost-vsock", "virtio-net", "vhost-net"}, MAC: macFor("s1")}, true, fds, false},
		"tcg-raw":               {tcg, false, nil, false},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			p := p
			p.FDs, p.ShareRAM = c.fds, c.share
			got := strings.Join(qemuArgs(c.s, p, c.incoming), "\n") + "\n"
			file := filepath.Join("testdata", name+".args")
			if *update {
				if err := os.MkdirAll("testdata", 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(file, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(file)
			if err != nil {
				t.Fatalf("%v (run with -update to create)", err)
			}
			if got != string(want) {
				t.Errorf("args differ from %s:\n%s", file, got)
			}
		})
	}
}

func TestShapeHelpers(t *testing.T) {
	for milli, want := range map[int64]int{0: 1, -5: 1, 1: 1, 1000: 1, 1001: 2, 2500: 3} {
		if got := vcpusFor(milli); got != want {
			t.Errorf("vcpusFor(%d) = %d, want %d", milli, got, want)
		}
	}
	if a, b := macFor("x"), macFor("y"); a == b || !strings.HasPrefix(a, "02:") {
		t.Errorf("macFor: %s, %s", a, b)
	}
	if a1, a2 := macFor("x"), macFor("x"); a1 != a2 {
		t.Error("macFor is not stable")
	}
	if cid := cidFor("x"); cid < 3 {
		t.Errorf("cidFor = %d", cid)
	}
	if got := escapeOpt("/a,b"); got != "/a,,b" {
		t.Errorf("escapeOpt = %q", got)
	}
	s := Shape{VCPUs: 1, MemoryMiB: 256}
	if n := shapeNote(s, runtime.Limits{MilliCPU: 1000, MemoryMiB: 256}, 256); n != "" {
		t.Errorf("same shape noted: %q", n)
	}
	if n := shapeNote(s, runtime.Limits{MilliCPU: 2000, MemoryMiB: 512}, 256); !strings.Contains(n, "2 vCPUs") || !strings.Contains(n, "512 MiB") {
		t.Errorf("shapeNote = %q", n)
	}
}
