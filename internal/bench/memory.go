package bench

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/bench/report"
)

// procMem is /proc/<pid>/smaps_rollup's Rss, Pss and Pss_Shmem (Pss of
// shared memory: for a VM clone its share of the template's pages).
type procMem struct{ rss, pss, pssShmem report.Bytes }

func readProcMem(pid int) (procMem, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return procMem{}, err
	}
	defer f.Close()
	var m procMem
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		switch k {
		case "Rss":
			m.rss = kbField(v)
		case "Pss":
			m.pss = kbField(v)
		case "Pss_Shmem":
			m.pssShmem = kbField(v)
		}
	}
	return m, sc.Err()
}

// kbField parses "   1234 kB".
func kbField(v string) report.Bytes {
	f := strings.Fields(v)
	if len(f) == 0 {
		return 0
	}
	n, _ := strconv.ParseInt(f[0], 10, 64)
	return report.Bytes(n << 10)
}

// cgroupMem is what the memory controller charges to a cgroup.
type cgroupMem struct {
	charged report.Bytes // v1 memory.usage_in_bytes, v2 memory.current: everything charged
	anon    report.Bytes // v1 rss, v2 anon
	file    report.Bytes // v1 cache, v2 file: page cache charged here (its disk's pages)
	kernel  report.Bytes // v1 memory.kmem.usage_in_bytes, v2 kernel
}

func readCgroupMem(dir string, v2 bool) (cgroupMem, error) {
	var m cgroupMem
	stat, err := readKV(filepath.Join(dir, "memory.stat"))
	if err != nil {
		return m, err
	}
	if v2 {
		m.anon, m.file, m.kernel = report.Bytes(stat["anon"]), report.Bytes(stat["file"]), report.Bytes(stat["kernel"])
		cur, err := readInt(filepath.Join(dir, "memory.current"))
		m.charged = report.Bytes(cur)
		return m, err
	}
	m.anon, m.file = report.Bytes(stat["rss"]), report.Bytes(stat["cache"])
	if k, err := readInt(filepath.Join(dir, "memory.kmem.usage_in_bytes")); err == nil {
		m.kernel = report.Bytes(k)
	}
	cur, err := readInt(filepath.Join(dir, "memory.usage_in_bytes"))
	m.charged = report.Bytes(cur)
	return m, err
}

func readKV(path string) (map[string]int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 {
			if n, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				out[f[0]] = n
			}
		}
	}
	return out, nil
}

func readInt(path string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}

// rootLoop returns the loop device and its backing file behind the root
// filesystem of pid ("", "" when the root is not a loop mount).
func rootLoop(pid int) (dev, backing string, dio bool, err error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return "", "", false, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 2 || pf[4] != "/" {
			continue
		}
		if !strings.HasPrefix(qf[1], "/dev/loop") {
			return "", "", false, nil
		}
		dev = qf[1]
	}
	if dev == "" {
		return "", "", false, nil
	}
	sys := filepath.Join("/sys/block", filepath.Base(dev), "loop")
	b, err := os.ReadFile(filepath.Join(sys, "backing_file"))
	if err != nil {
		return dev, "", false, err
	}
	d, _ := os.ReadFile(filepath.Join(sys, "dio"))
	return dev, strings.TrimSpace(string(b)), strings.TrimSpace(string(d)) == "1", nil
}

// pageCached returns how much of file is in the page cache (mincore of a
// read-only mapping: nothing is read in by asking).
func pageCached(file string) (report.Bytes, error) {
	f, err := os.Open(file)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Size() == 0 {
		return 0, err
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, fmt.Errorf("mmap %s: %w", file, err)
	}
	defer func() { _ = unix.Munmap(m) }() // read-only mapping: nothing to lose
	page := os.Getpagesize()
	vec := make([]byte, (len(m)+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		return 0, fmt.Errorf("mincore %s: %w", file, errno)
	}
	var n int64
	for _, v := range vec {
		n += int64(v & 1)
	}
	return report.Bytes(n * int64(page)), nil
}

// memAvailable is /proc/meminfo's MemAvailable.
func memAvailable() (report.Bytes, error) {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "MemAvailable:"); ok {
			return kbField(v), nil
		}
	}
	return 0, fmt.Errorf("no MemAvailable in /proc/meminfo")
}

// cubeletRSS is cubelet's resident memory: from /proc when its PID is
// known, else from process_resident_memory_bytes on its /metrics.
func (e *Env) cubeletRSS(ctx context.Context) (rss, pss report.Bytes, err error) {
	if e.CubeletPID > 0 {
		m, err := readProcMem(e.CubeletPID)
		return m.rss, m.pss, err
	}
	if e.MetricsURL == "" {
		return 0, 0, fmt.Errorf("cubelet's PID and metrics address are both unknown")
	}
	v, err := e.metrics(ctx, "process_resident_memory_bytes")
	if err != nil {
		return 0, 0, err
	}
	return report.Bytes(v[0]), 0, nil
}

// metrics reads the values of series (metric names with their labels as
// the exposition format writes them) from one scrape of cubelet's
// /metrics.
func (e *Env) metrics(ctx context.Context, series ...string) ([]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.MetricsURL+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	hc := e.MetricsHTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	lines := bytes.Split(body, []byte("\n"))
	out := make([]float64, len(series))
	for i, name := range series {
		found := false
		for _, line := range lines {
			if v, ok := bytes.CutPrefix(line, []byte(name+" ")); ok {
				if out[i], err = strconv.ParseFloat(string(bytes.TrimSpace(v)), 64); err != nil {
					return nil, fmt.Errorf("%s on %s/metrics: %w", name, e.MetricsURL, err)
				}
				found = true
				break
			}
		}
		if !found {
			return nil, fmt.Errorf("no %s on %s/metrics", name, e.MetricsURL)
		}
	}
	return out, nil
}
