package vm

import (
	"bufio"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// smapsBreakdown sums the Pss of QEMU pid's mappings (KiB) by what they
// are: the template's RAM ("template"), TCG's translation cache (the
// anonymous executable mapping), the heap, glibc's thread arenas and
// stacks and other anonymous memory ("anon"), QEMU's binary ("qemu"),
// its libraries ("libs") and other files. It says where a clone's own
// memory goes. "dirty:<category>" sums Private_Dirty, what stays the
// clone's own however many clones share the rest.
func smapsBreakdown(pid int) (map[string]int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]int64{}
	cat := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) >= 5 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			path := ""
			if len(fields) >= 6 {
				path = strings.Join(fields[5:], " ")
			}
			perms := fields[1]
			switch {
			case strings.Contains(path, "memfd:"+templateMemfdName):
				cat = "template"
			case path == "" && strings.Contains(perms, "x"):
				cat = "tcg"
			case path == "[heap]":
				cat = "heap"
			case path == "" || strings.HasPrefix(path, "[stack"):
				cat = "anon"
			case strings.Contains(path, "qemu-system"):
				cat = "qemu"
			case strings.Contains(path, ".so"):
				cat = "libs"
			default:
				cat = "other"
			}
			continue
		}
		if len(fields) == 3 && (fields[0] == "Pss:" || fields[0] == "Private_Dirty:") {
			if n, err := strconv.ParseInt(fields[1], 10, 64); err == nil {
				k := cat
				if fields[0] == "Private_Dirty:" {
					k = "dirty:" + cat
				}
				out[k] += n
			}
		}
	}
	return out, sc.Err()
}

func formatBreakdown(m map[string]int64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		if !strings.HasPrefix(k, "dirty:") {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s %.1f (private dirty %.1f)", k, float64(m[k])/1024, float64(m["dirty:"+k])/1024)
	}
	return "Pss MiB:" + b.String()
}

func TestSmapsBreakdownSelf(t *testing.T) {
	m, err := smapsBreakdown(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if m["heap"]+m["anon"] == 0 {
		t.Fatalf("no anonymous memory in the test's own smaps: %v", m)
	}
	t.Log(formatBreakdown(m))
}

// thpEnabled is THP_enabled from /proc/<pid>/status: "0" once
// PR_SET_THP_DISABLE is set.
func thpEnabled(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "THP_enabled:"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no THP_enabled in /proc/%d/status", pid)
	return ""
}
