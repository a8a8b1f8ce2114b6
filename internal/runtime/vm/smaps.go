package vm

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// SmapsRollup reads /proc/<pid>/smaps_rollup: each "Name: N kB" line as
// Name -> N KiB (Rss, Pss, Pss_Anon, Pss_File, Pss_Shmem, ...). A clone's
// own memory is Pss minus Pss_Shmem: Pss_Shmem is its share of the
// template's pages it maps.
func SmapsRollup(pid int) (map[string]int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		fields := strings.Fields(rest)
		if !ok || len(fields) != 2 || fields[1] != "kB" {
			continue
		}
		if n, err := strconv.ParseInt(fields[0], 10, 64); err == nil {
			out[name] = n
		}
	}
	return out, sc.Err()
}

// TemplateMapping sums /proc/<pid>/smaps over the mappings of a template's
// sealed RAM copy (a clone's guest RAM): Rss, Pss, Anonymous (pages the
// guest wrote since the restore, copied on write) and the rest, in KiB.
// It is empty for a QEMU that maps no template.
func TemplateMapping(pid int) (map[string]int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]int64{}
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		name, rest, ok := strings.Cut(line, ":")
		fields := strings.Fields(rest)
		if ok && !strings.Contains(name, " ") && len(fields) == 2 && fields[1] == "kB" {
			if in {
				if n, err := strconv.ParseInt(fields[0], 10, 64); err == nil {
					out[name] += n
				}
			}
			continue
		}
		if ok && !strings.Contains(name, " ") {
			continue // VmFlags, THPeligible, ...
		}
		// A mapping's header: address perms offset dev inode [path].
		in = strings.Contains(line, "memfd:"+templateMemfdName)
	}
	return out, sc.Err()
}
