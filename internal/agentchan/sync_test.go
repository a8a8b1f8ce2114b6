package agentchan

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

func TestGuestSyncSkipsStaleBytes(t *testing.T) {
	guest, host := connPair(t)
	stale := "\x00\x00\x04\x08\x00\x00\x00\x00\x00garbage of an old session" +
		syncPrefix[:5] + // a torn SYNC of an old host
		"PRI * HTTP/2.0\r\n" // a torn preface before any SYNC
	after := "\x00\x00\x00\x04\x00\x00\x00\x00\x00frames"
	go func() {
		// A failed write shows as guestSync's error below.
		_, _ = io.WriteString(host, stale+syncPrefix+"n1\n"+
			"more junk"+syncPrefix+"n1\n"+ // repeated SYNC before the preface
			h2Preface+after)
	}()

	c, err := guestSync(guest)
	if err != nil {
		t.Fatal(err)
	}
	ack := make([]byte, len(ackPrefix+"n1\n"))
	if _, err := io.ReadFull(host, ack); err != nil {
		t.Fatal(err)
	}
	if string(ack) != ackPrefix+"n1\n" {
		t.Fatalf("ack = %q, want %q", ack, ackPrefix+"n1\n")
	}
	got := make([]byte, len(h2Preface+after))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != h2Preface+after {
		t.Fatalf("guest conn reads %q, want preface then %q", got, after)
	}
}

func TestGuestSyncEOFBeforeSync(t *testing.T) {
	guest, host := connPair(t)
	if _, err := io.WriteString(host, "stale bytes, no handshake"); err != nil {
		t.Fatal(err)
	}
	if err := host.(*net.UnixConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := guestSync(guest); !errors.Is(err, io.EOF) {
		t.Fatalf("guestSync = %v, want EOF", err)
	}
}

// fakeGuest reads the host's SYNC lines and answers the n-th (1-based)
// with the ACKs answer returns; it returns the nonce it saw.
func fakeGuest(t *testing.T, c net.Conn, n int, answer func(nonce string) string) <-chan string {
	ch := make(chan string, 1)
	go func() {
		defer close(ch)
		br := bufio.NewReader(c)
		for i := 1; ; i++ {
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			nonce, ok := strings.CutPrefix(strings.TrimSuffix(line, "\n"), syncPrefix)
			if !ok {
				t.Errorf("host sent %q, want a SYNC line", line)
				return
			}
			if i == n {
				if _, err := io.WriteString(c, answer(nonce)); err != nil {
					t.Errorf("answer the SYNC: %v", err)
				}
				ch <- nonce
				return
			}
		}
	}()
	return ch
}

func TestHostSyncSkipsForeignAck(t *testing.T) {
	host, guest := connPair(t)
	seen := fakeGuest(t, guest, 1, func(nonce string) string {
		return "stale h2 bytes" + ackPrefix + "0123456789abcdef\n" + // an old host's ACK
			ackPrefix + nonce + "\nafter-ack"
	})
	c, err := hostSync(context.Background(), host)
	if err != nil {
		t.Fatal(err)
	}
	nonce := <-seen
	if len(nonce) != 16 || nonce == "0123456789abcdef" {
		t.Fatalf("nonce %q: want 16 random hex digits", nonce)
	}
	got := make([]byte, len("after-ack"))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != "after-ack" {
		t.Fatalf("host conn reads %q, want the bytes after its own ACK", got)
	}
}

func TestHostSyncResendsUntilAcked(t *testing.T) {
	host, guest := connPair(t)
	// A guest session that has not yet seen the old host leave swallows
	// the first SYNCs; the host must keep sending.
	seen := fakeGuest(t, guest, 3, func(nonce string) string { return ackPrefix + nonce + "\n" })
	start := time.Now()
	if _, err := hostSync(context.Background(), host); err != nil {
		t.Fatal(err)
	}
	if <-seen == "" {
		t.Fatal("guest never saw a third SYNC")
	}
	// Resent at 20 ms then 40 ms: well under a second.
	if d := time.Since(start); d > time.Second {
		t.Fatalf("handshake took %v", d)
	}
}

func TestHostSyncNonceMismatchTimesOut(t *testing.T) {
	host, guest := connPair(t)
	go func() { // answers every SYNC, always with someone else's nonce
		br := bufio.NewReader(guest)
		for {
			if _, err := br.ReadString('\n'); err != nil {
				return
			}
			if _, err := io.WriteString(guest, ackPrefix+"ffffffffffffffff\n"); err != nil {
				return
			}
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	c, err := hostSync(ctx, host)
	if c != nil || !errors.Is(err, errNoSync) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hostSync = %v, %v; want errNoSync wrapping DeadlineExceeded", c, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("gave up after %v, want about 300ms", d)
	}
}

// boundedReader records the largest the scanner's buffer got.
type boundedReader struct {
	r   io.Reader
	s   *scanner
	max int
}

func (b *boundedReader) Read(p []byte) (int, error) {
	if l := len(b.s.buf); l > b.max {
		b.max = l
	}
	return b.r.Read(p)
}

func TestScannerTrimsAtMaxScan(t *testing.T) {
	const chunk = 4096 // scanner.until's read size
	// The marker is torn across the read that pushes the buffer past
	// maxScan: the trim must keep its head.
	junk := bytes.Repeat([]byte{'x'}, (maxScan/chunk+1)*chunk-5)
	stream := bytes.NewReader(append(junk, syncPrefix+"nonce\nrest"...))
	s := &scanner{}
	br := &boundedReader{r: stream, s: s}
	s.r = br
	got, err := s.until(syncPrefix, true)
	if err != nil {
		t.Fatal(err)
	}
	if got != "nonce" || string(s.buf) != "rest" {
		t.Fatalf("until = %q, buf %q; want nonce, rest", got, s.buf)
	}
	if br.max > maxScan+chunk {
		t.Fatalf("buffer grew to %d bytes, want at most maxScan+%d", br.max, chunk)
	}
}

func TestScannerBoundedWithoutMarker(t *testing.T) {
	s := &scanner{}
	br := &boundedReader{r: io.LimitReader(zeros{}, 4*maxScan), s: s}
	s.r = br
	if _, err := s.until(syncPrefix, true); !errors.Is(err, io.EOF) {
		t.Fatalf("until = %v, want EOF", err)
	}
	if br.max > maxScan+4096 {
		t.Fatalf("buffer grew to %d bytes scanning %d bytes of junk", br.max, 4*maxScan)
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

func TestPrefixConnReplaysThenReads(t *testing.T) {
	a, b := connPair(t)
	go func() { _, _ = io.WriteString(b, "wire") }() // a failed write shows as the ReadFull below
	c := &prefixConn{Conn: a, prefix: []byte("buffered-")}
	got := make([]byte, len("buffered-wire"))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != "buffered-wire" {
		t.Fatalf("read %q", got)
	}
}
