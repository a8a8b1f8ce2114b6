package audit

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// Events land as JSON lines in the sandbox's file; an invalid sandbox ID
// never names a file.
func TestLog(t *testing.T) {
	dir := t.TempDir()
	l, err := New(dir, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	l.Write(Event{SandboxID: "sb-1", Kind: KindDNS, Verdict: Allowed, Name: "a.example"})
	l.Write(Event{SandboxID: "sb-1", Kind: KindConnect, Verdict: Denied, Addr: "198.51.100.1:443", Reason: "r"})
	l.Write(Event{SandboxID: "../escape", Kind: KindDNS, Verdict: Allowed})
	l.Close("sb-1")
	f, err := os.Open(l.Path("sb-1"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var got []Event
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var e Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatal(err)
		}
		got = append(got, e)
	}
	if len(got) != 2 || got[0].Name != "a.example" || got[1].Verdict != Denied || got[0].Time.IsZero() {
		t.Fatalf("%+v", got)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("files: %v", ents)
	}
	var nilLog *Log
	nilLog.Write(Event{SandboxID: "sb-1"}) // discards
}

// Files unchanged for keep go at the next start; younger ones stay.
func TestPrune(t *testing.T) {
	dir := t.TempDir()
	old, young := filepath.Join(dir, "sb-old.jsonl"), filepath.Join(dir, "sb-young.jsonl")
	for _, p := range []string{old, young} {
		if err := os.WriteFile(p, []byte("{}\n"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	past := time.Now().Add(-48 * time.Hour)
	if err := os.Chtimes(old, past, past); err != nil {
		t.Fatal(err)
	}
	if _, err := New(dir, 24*time.Hour, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(old); !os.IsNotExist(err) {
		t.Errorf("old file kept: %v", err)
	}
	if _, err := os.Stat(young); err != nil {
		t.Errorf("young file removed: %v", err)
	}
}
