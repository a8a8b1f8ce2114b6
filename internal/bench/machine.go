package bench

import (
	"context"
	"os"
	"os/exec"
	goruntime "runtime"
	"strings"

	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/raw"
	"github.com/cubesandbox/cube/internal/bench/report"
)

// DescribeMachine collects the machine description.
func DescribeMachine(ctx context.Context, e *Env) report.Machine {
	m := report.Machine{CPUs: goruntime.NumCPU(), Go: goruntime.Version(), LoadStart: loadAvg()}
	m.Hostname, _ = os.Hostname()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		m.MemoryBytes = report.Bytes(int64(si.Totalram) * int64(si.Unit))
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "model name"); ok {
				m.CPUModel = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "PRETTY_NAME="); ok {
				m.OS = strings.Trim(v, `"`)
			}
		}
	}
	m.Runc = firstLine(ctx, "runc", "--version")
	m.Podman = firstLine(ctx, "podman", "--version")
	if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err == nil {
		f.Close()
		m.KVM = true
	}
	m.Cgroups = cgroupMode()
	if e != nil && e.Client != nil {
		if info, err := e.Info(ctx); err == nil {
			m.Storage = info.StorageMode
			m.Runtime = runtimeDetail(info.Runtimes, e.Opts.Runtime)
		}
	}
	return m
}

func runtimeDetail(rts []*pb.RuntimeInfo, name string) string {
	if name == "" {
		name = "runc"
	}
	for _, r := range rts {
		if r.Name == name && r.Detail != "" {
			return name + " (" + r.Detail + ")"
		}
	}
	return name
}

func firstLine(ctx context.Context, name string, args ...string) string {
	out, err := exec.CommandContext(ctx, name, args...).Output()
	if err != nil {
		return ""
	}
	l, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return l
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

func cgroupMode() string {
	ms, err := raw.CgroupMounts()
	if err != nil {
		return ""
	}
	v1, v2 := false, false
	for _, m := range ms {
		if m.V2 {
			v2 = true
		} else {
			v1 = true
		}
	}
	switch {
	case v1 && v2:
		return "hybrid (v1 controllers + v2)"
	case v2:
		return "v2"
	case v1:
		return "v1"
	}
	return "none"
}
