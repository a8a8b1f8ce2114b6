package bench

import (
	"context"
	"os"
	"os/exec"
	goruntime "runtime"
	"strings"

	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// Machine describes where a run happened: absolute figures only mean
// something next to it (and ratios next to the load it was under).
type Machine struct {
	Hostname    string `json:"hostname"`
	CPUs        int    `json:"cpus"`
	CPUModel    string `json:"cpu_model"`
	MemoryBytes Bytes  `json:"memory_bytes"`
	Kernel      string `json:"kernel"`
	OS          string `json:"os"`
	Runc        string `json:"runc"`
	Podman      string `json:"podman,omitempty"`
	Go          string `json:"go"`
	Cgroups     string `json:"cgroups"`
	KVM         bool   `json:"kvm"`
	Storage     string `json:"storage,omitempty"` // cubelet's pool mode
	// Runtime is the runtime the run creates with and what its driver
	// says of itself ("vm (accel=tcg channel=virtio-serial)").
	Runtime   string `json:"runtime,omitempty"`
	LoadStart string `json:"load_start"`
	LoadEnd   string `json:"load_end"`
}

// DescribeMachine collects the machine description.
func DescribeMachine(ctx context.Context, e *Env) Machine {
	m := Machine{CPUs: goruntime.NumCPU(), Go: goruntime.Version(), LoadStart: loadAvg()}
	m.Hostname, _ = os.Hostname()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) == nil {
		m.MemoryBytes = Bytes(int64(si.Totalram) * int64(si.Unit))
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
	ms, err := cgroupMounts()
	if err != nil {
		return ""
	}
	v1, v2 := false, false
	for _, m := range ms {
		if m.v2 {
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
