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
