// Package hostload says how busy the host's CPUs are, so that waits on
// work that needs CPU time (a QEMU answering its monitor, a guest booting)
// stretch with the load instead of failing on a busy node.
package hostload

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// Runnable is the host's runnable threads now (the numerator of the
// fourth field of /proc/loadavg), 0 when unknown.
func Runnable() int {
	_, r := read()
	return r
}

// Busy is how many threads want the CPUs: the larger of the runnable
// threads now and the one-minute load average (a sample taken between
// bursts reads low; the average lags a burst that just began).
func Busy() float64 {
	avg, r := read()
	return max(avg, float64(r))
}

// Scale is d stretched by the load: d × max(1, Busy / CPUs). A wait so
// scaled gives the work it waits for about the CPU time d gives it on an
// idle host.
func Scale(d time.Duration) time.Duration {
	return scale(d, Busy(), runtime.NumCPU())
}

func scale(d time.Duration, busy float64, cpus int) time.Duration {
	if cpus <= 0 || busy <= float64(cpus) {
		return d
	}
	return time.Duration(float64(d) * busy / float64(cpus))
}

func read() (avg1 float64, runnable int) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, 0
	}
	f := strings.Fields(string(b))
	if len(f) < 4 {
		return 0, 0
	}
	avg1, _ = strconv.ParseFloat(f[0], 64)
	r, _, _ := strings.Cut(f[3], "/")
	runnable, _ = strconv.Atoi(r)
	return avg1, runnable
}
