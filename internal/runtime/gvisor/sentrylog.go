package gvisor

import (
	"bufio"
	"os"
	"path/filepath"
	"slices"
	"strings"
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
// "state.go:65] Save succeeded: exiting..." or "Save failed: ...".
// They are matched after the log line's "file:line] " prefix, which the
// sandbox's own processes cannot write (nothing they do is logged with
// a line break of its choosing).
const (
	saveStarted   = "] Sandbox save started"
	saveSucceeded = "] Save succeeded"
	saveFailed    = "] Save failed"
)

// saveVerdict reads what the sentry logged about its last save: "ok"
// when it said the save succeeded, "failed" (with its line) when it said
// it failed, "" when it said neither (no log, no save, or the sentry
// died mid-save).
func saveVerdict(path string) (verdict, line string) {
	if path == "" {
		return "", ""
	}
	f, err := os.Open(path)
	if err != nil {
		return "", ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.Contains(l, saveStarted):
			verdict, line = "", ""
		case strings.Contains(l, saveSucceeded):
			verdict, line = "ok", l
		case strings.Contains(l, saveFailed):
			verdict, line = "failed", l
		}
	}
	return verdict, line
}
