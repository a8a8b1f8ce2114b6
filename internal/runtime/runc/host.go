package runc

import (
	"bufio"
	"os"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// capSysResource is CAP_SYS_RESOURCE's bit in /proc/self/status CapEff.
const capSysResource = 24

// fitRlimits lowers hard limits the host would refuse. Without
// CAP_SYS_RESOURCE (cubelet itself running in a restricted container)
// runc's setrlimit fails for anything above our own hard limit and the
// whole start fails; a lower NOFILE is the better outcome. ocispec.For stays
// pure, so this host-dependent step happens here, at Start.
func fitRlimits(sp *specs.Spec) (lowered bool) {
	if sp.Process == nil || hasCap(capSysResource) {
		return false
	}
	for i, rl := range sp.Process.Rlimits {
		res, ok := rlimitResources[rl.Type]
		if !ok {
			continue
		}
		var cur unix.Rlimit
		if unix.Getrlimit(res, &cur) != nil || cur.Max == unix.RLIM_INFINITY {
			continue
		}
		if rl.Hard > cur.Max {
			sp.Process.Rlimits[i].Hard = cur.Max
			sp.Process.Rlimits[i].Soft = min(rl.Soft, cur.Max)
			lowered = true
		}
	}
	return lowered
}

var rlimitResources = map[string]int{
	"RLIMIT_NOFILE": unix.RLIMIT_NOFILE,
	"RLIMIT_NPROC":  unix.RLIMIT_NPROC,
	"RLIMIT_CORE":   unix.RLIMIT_CORE,
}

func hasCap(bit uint) bool {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		v, ok := strings.CutPrefix(sc.Text(), "CapEff:")
		if !ok {
			continue
		}
		mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		return err == nil && mask&(1<<bit) != 0
	}
	return false
}
