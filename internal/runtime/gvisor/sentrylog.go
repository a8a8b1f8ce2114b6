package gvisor

import (
	"bufio"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
)

// sentryLogName is the sandbox process's (the sentry's) own log in the
// bundle: runsc's info-level log of the `boot` command, which is where
// the sentry says whether a checkpoint's save succeeded.
const sentryLogName = "sentry.log"

// sentryLogArgs are the runsc flags of run and restore that give the
// sentry its log. Without --debug runsc logs at info level: the start-up
// banner, a few lines per checkpoint (with a table of save timings) and
// rare warnings; about 35 kB for a start and a checkpoint. --debug-command
// keeps every other runsc command (run, gofer, checkpoint) out of it. With
// Config.Debug the full debug logs go to <bundle>/debug/ instead.
func (d *Driver) sentryLogArgs(bundle string) []string {
	if d.debug {
		return []string{"--debug", "--debug-log=" + filepath.Join(bundle, "debug") + "/"}
	}
	return []string{"--debug-log=" + filepath.Join(bundle, sentryLogName), "--debug-command=boot"}
}

// sentryLog is the path of the current sentry's log of the sandbox whose
// bundle is bundle: <bundle>/sentry.log, or with Config.Debug the newest
// boot log in <bundle>/debug/ ("" when there is none).
func (d *Driver) sentryLog(bundle string) string {
	if !d.debug {
		return filepath.Join(bundle, sentryLogName)
	}
	boots, _ := filepath.Glob(filepath.Join(bundle, "debug", "*.boot.txt"))
	if len(boots) == 0 {
		return ""
	}
	// runsc names them runsc.log.<YYYYMMDD-HHMMSS.micros>.boot.txt.
	slices.Sort(boots)
	return boots[len(boots)-1]
}

// The sentry's lines about a save (pkg/sentry/state, runsc 20221219):
// "state.go:63] Sandbox save started, pausing all tasks." then either
// "state.go:65] Save succeeded: exiting..." or "Save failed: ...". Each
// is matched as a whole log line in runsc's text format (glog's
// "I1202 05:03:07.123456   12345 state.go:63] "): the level letter and
// timestamp at the start of the line, then the sentry's state.go as the
// source. A guest's text reaches this log only inside another line's
// message (never at a line start with that prefix: nothing it does is
// logged with a line break of its choosing), so it cannot forge one.
var saveLine = regexp.MustCompile(`^[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d+ +\d+ state\.go:\d+\] (Sandbox save started|Save succeeded|Save failed)`)

// Kept for the tests that watch the log for a save in progress.
const saveStarted = "] Sandbox save started"

// sentryLogMax bounds the sentry's log: a checkpoint that finds it
// larger truncates it first (runsc opens it O_APPEND, so the sentry
// goes on writing at the new end), and saveVerdict reads at most this
// much of it. runsc logs at info level: ~35 kB for a start and a save.
// Each run and restore starts a new log (launch).
const sentryLogMax = 4 << 20

// sentryLogMark is where the next checkpoint's lines in the sentry log
// at path will start: its size, after truncating a log over sentryLogMax.
func sentryLogMark(path string) int64 {
	if path == "" {
		return 0
	}
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	if st.Size() > sentryLogMax {
		if err := os.Truncate(path, 0); err == nil {
			return 0
		}
	}
	return st.Size()
}

// saveVerdict reads what the sentry logged about a save that started at
// or after offset from (sentryLogMark): "ok" when it said the save
// succeeded, "failed" (with its line) when it said it failed, "" when it
// said neither (no log, no save since from, or the sentry died
// mid-save). A verdict counts only after a "save started" line.
func saveVerdict(path string, from int64) (verdict, line string) {
	if path == "" {
		return "", ""
	}
	f, err := os.Open(path)
	if err != nil {
		return "", ""
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || st.Size() < from {
		return "", "" // truncated since: not this save's log
	}
	if _, err := f.Seek(from, io.SeekStart); err != nil {
		return "", ""
	}
	sc := bufio.NewScanner(io.LimitReader(f, sentryLogMax))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	started := false
	for sc.Scan() {
		l := sc.Text()
		m := saveLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		switch m[1] {
		case "Sandbox save started":
			started, verdict, line = true, "", ""
		case "Save succeeded":
			if started {
				verdict, line = "ok", l
			}
		case "Save failed":
			if started {
				verdict, line = "failed", l
			}
		}
	}
	return verdict, line
}
