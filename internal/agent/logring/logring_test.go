package logring

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
)

func lines(es []agentproto.LogEntry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Line)
	}
	return out
}

func TestWriterSplitsLines(t *testing.T) {
	r := New(1 << 20)
	w := r.Writer(agentproto.LogEntry{Source: agentproto.LogSourceProcess, Stream: "stdout", PID: 7, Cmd: "sh"})
	for _, chunk := range []string{"he", "llo\nwor", "ld\r\n\n", "tail"} {
		if _, err := w.Write([]byte(chunk)); err != nil {
			t.Fatal(err)
		}
	}
	got, _ := r.Read(Query{})
	if fmt.Sprint(lines(got)) != "[hello world ]" {
		t.Fatalf("lines %q", lines(got))
	}
	w.Flush()
	got, _ = r.Read(Query{})
	if len(got) != 4 || got[3].Line != "tail" || got[3].PID != 7 || got[3].Stream != "stdout" || got[3].Seq != 4 {
		t.Fatalf("after flush: %+v", got)
	}
	long := strings.Repeat("x", 2*MaxLine+10)
	_, _ = w.Write([]byte(long + "\n"))
	got, _ = r.Read(Query{})
	if n := len(got); n != 7 || len(got[4].Line) != MaxLine || len(got[6].Line) != 10 {
		t.Fatalf("a %d-byte line: %d entries", len(long), n)
	}
}

// TestCap: a ring never holds more than its cap however much is written,
// drops the oldest first, and counts what it dropped.
func TestCap(t *testing.T) {
	const capBytes = 64 << 10
	r := New(capBytes)
	w := r.Writer(agentproto.LogEntry{Stream: "stdout"})
	line := strings.Repeat("y", 100)
	const n = 10000 // ~1.6 MB written
	for i := 0; i < n; i++ {
		fmt.Fprintf(w, "%05d %s\n", i, line)
	}
	got, dropped := r.Read(Query{})
	size := 0
	for i := range got {
		size += cost(&got[i])
	}
	t.Logf("kept %d lines (%d bytes of cap %d), dropped %d", len(got), size, capBytes, dropped)
	if size > capBytes || int(dropped)+len(got) != n {
		t.Fatalf("kept %d bytes in %d lines, dropped %d of %d", size, len(got), dropped, n)
	}
	if !strings.HasPrefix(got[len(got)-1].Line, fmt.Sprintf("%05d", n-1)) || !strings.HasPrefix(got[0].Line, fmt.Sprintf("%05d", dropped)) {
		t.Fatalf("kept %q .. %q", got[0].Line[:5], got[len(got)-1].Line[:5])
	}
}

func TestQuery(t *testing.T) {
	r := New(1 << 20)
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := 0; i < 10; i++ {
		r.Add(agentproto.LogEntry{Time: base.Add(time.Duration(i) * time.Second), Line: fmt.Sprint(i)})
	}
	at := func(i int) time.Time { return base.Add(time.Duration(i) * time.Second) }
	for _, c := range []struct {
		q    Query
		want string
	}{
		{Query{}, "[0 1 2 3 4 5 6 7 8 9]"},
		{Query{Start: at(7)}, "[7 8 9]"},
		{Query{End: at(2)}, "[0 1 2]"},
		{Query{Start: at(3), Limit: 2}, "[3 4]"},
		{Query{Backward: true, Limit: 3}, "[9 8 7]"},
		{Query{Backward: true, End: at(4), Limit: 2}, "[4 3]"},
		{Query{Start: at(2), End: at(4)}, "[2 3 4]"},
		{Query{MaxBytes: 2 * entryOverhead}, "[0 1]"}, // each costs 65: stops once past 128
	} {
		got, _ := r.Read(c.q)
		if s := fmt.Sprint(lines(got)); s != c.want {
			t.Errorf("%+v: %s, want %s", c.q, s, c.want)
		}
	}
}
