package agentchan

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestNoWedgeAfterFalseSync: a body that starts with the SYNC marker resets
// the session (the documented limitation) and makes the guest acknowledge
// a bogus nonce; the next host's SYNC, with its own nonce, must still be
// acknowledged rather than skipped while the guest waits for a preface.
func TestNoWedgeAfterFalseSync(t *testing.T) {
	v := startVM(t, testHandler(nil))
	c, conns := recordingClient(t, v.sock)
	if _, err := get(context.Background(), t, c, "/session"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, BaseURL+"/echo", strings.NewReader(syncPrefix+"not a handshake"))
	if resp, err := c.Do(req); err == nil {
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	cancel()
	for _, cc := range conns() {
		cc.Close()
	}
	c2, _ := recordingClient(t, v.sock)
	ctx2, cancel2 := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel2()
	start := time.Now()
	if _, err := get(ctx2, t, c2, "/session"); err != nil {
		t.Fatalf("a new host after a false SYNC: %v", err)
	}
	t.Logf("new host answered %v after the reset", time.Since(start))
}
