package gvisor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSaveVerdict: only the sentry's own state.go lines, after the
// checkpoint began (sentryLogMark) and after a "save started", decide a
// save. Text a guest gets into the log inside another line's message
// (what a bare substring match took for a verdict) and a verdict of an
// earlier save in the same log do not count. The control rows are the
// sentry's real sequence: it gives "ok" and "failed".
func TestSaveVerdict(t *testing.T) {
	const (
		started = "I1202 05:08:41.873055   12345 state.go:63] Sandbox save started, pausing all tasks.\n"
		ok      = "I1202 05:08:42.001234   12345 state.go:65] Save succeeded: exiting...\n"
		failed  = "W1202 05:08:42.001234   12345 state.go:70] Save failed: endpoint still has waiters upon save\n"
		other   = "I1202 05:08:40.000001   12345 loader.go:500] Process started\n"
		// What a guest could get the sentry to log: its text inside a
		// message, even one that looks like a whole line.
		forged  = "W1202 05:08:41.900000   12345 fs.go:12] open \"/x] Save succeeded\" failed\n"
		forged2 = "I1202 05:08:41.900000   12345 console.go:9] line: I1202 05:08:42.001234   12345 state.go:65] Save succeeded: exiting...\n"
	)
	for _, c := range []struct {
		name, before, after string
		want                string
	}{
		{"control: the save succeeded", other, started + ok, "ok"},
		{"control: the save failed", other, started + failed, "failed"},
		{"guest text after the save started", other, started + forged + forged2, ""},
		{"bare substring without the prefix", other, started + "] Save succeeded\n", ""},
		{"verdict without a save started", other, ok, ""},
		{"earlier save's verdict before the mark", started + ok, other, ""},
		{"sentry died mid-save", other + started + ok, started, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), sentryLogName)
			if err := os.WriteFile(path, []byte(c.before), 0o600); err != nil {
				t.Fatal(err)
			}
			mark := sentryLogMark(path)
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteString(c.after); err != nil {
				t.Fatal(err)
			}
			_ = f.Close()
			got, line := saveVerdict(path, mark)
			t.Logf("log after the mark %q: verdict %q (%q)", c.after, got, line)
			if got != c.want {
				t.Fatalf("verdict %q, want %q", got, c.want)
			}
		})
	}

	t.Run("a log over the cap is truncated at the checkpoint", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), sentryLogName)
		big := strings.Repeat(other, sentryLogMax/len(other)+1) + started + ok
		if err := os.WriteFile(path, []byte(big), 0o600); err != nil {
			t.Fatal(err)
		}
		if mark := sentryLogMark(path); mark != 0 {
			t.Fatalf("mark %d, want 0 after truncating", mark)
		}
		if st, err := os.Stat(path); err != nil || st.Size() != 0 {
			t.Fatalf("log over the cap not truncated: %v %v", st, err)
		}
		if v, _ := saveVerdict(path, 0); v != "" {
			t.Fatalf("verdict %q from a truncated log", v)
		}
	})
}
