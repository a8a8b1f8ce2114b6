package proxy

import (
	"context"
	"errors"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
)

// A sandbox moves between nodes (a drain, a resume on another node): it
// is frozen where it was, started on its new node under the same ID, and
// the original destroyed. A request that was on its way to the original
// (its route resolved before the move) then fails: it hangs on the frozen
// copy until that copy goes, and its connection breaks. retryTransport
// sends such a request once more, to where the sandbox is now, when doing
// so cannot repeat something the sandbox already received:
//
//   - nothing of it reached the old place (no header was written: the
//     dial failed, or the attempt ended before writing; httptrace), or
//     it is GET, HEAD, OPTIONS or TRACE, or it carries an
//     Idempotency-Key header. The transports write a request's headers
//     before its body, and a handler may act on headers alone (a copy
//     frozen after acting carries the effect into the moved snapshot), so
//     a body nobody read does not make a POST or DELETE safe to repeat;
//   - none of its body was taken (a body the upstream began to read is
//     gone: such a request is answered 502, never repeated);
//   - no answer began (a failure after the answer's headers reaches the
//     client as a cut-off answer, as before);
//   - its client is still there and it was not aborted (Abort: a sandbox
//     gone is gone); an attempt ended by Moved (the sandbox is elsewhere
//     now) counts as failed;
//   - the route, asked afresh (the Resolver's cache forgotten, Forgetter),
//     names another place than the one that failed. While the sandbox
//     moves the master holds that resolve until the move is done, so
//     the retry goes to the new node; past the master's bound the
//     resolve fails and the client gets 503 with Retry-After.
//
// Any other failure is answered 502 as before, after one more resolve;
// for a second after a resolve found the sandbox where it was, a failed
// request to it is answered 502 without one (a client polling a port
// that does not listen yet does not cost the master a resolve each).
type retryTransport struct {
	h    *Handler
	next http.RoundTripper
}

func (t retryTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	rt, ok := r.Context().Value(ctxKey{}).(routed)
	if !ok {
		return t.next.RoundTrip(r)
	}
	resp, sent, err := t.attempt(r, rt)
	if err == nil || r.Context().Err() != nil {
		return resp, err
	}
	body, ok := replay(r, rt.body, sent)
	if !ok {
		return nil, err
	}
	id := rt.target.SandboxID
	if !errors.Is(err, errMoved) && t.h.stillThere(id) {
		// A resolve a moment ago found it where it was: its own
		// failure (a port not listening yet, polled), not a move. The
		// master is not asked again for every such request.
		return nil, err
	}
	if f, ok := t.h.cfg.Resolver.(Forgetter); ok {
		f.Forget(id)
	}
	nt, rerr := t.h.cfg.Resolver.Resolve(context.WithValue(r.Context(), presentedKey{}, rt.presented), id)
	if rerr != nil {
		if r.Context().Err() != nil {
			return nil, err
		}
		return nil, &reresolveError{err: rerr, first: err}
	}
	if sameLocation(nt, rt.target) {
		t.h.notMoved(id)
		return nil, err // not a move: the sandbox's own failure
	}
	if nt.TrafficAccessToken != "" && rt.port != agentproto.Port && !tokenEqual(rt.presented.TrafficToken, nt.TrafficAccessToken) {
		return nil, &reresolveError{err: errUnauthorized, first: err}
	}
	t.h.log.Info("request retried where the sandbox is now", "sandbox_id", id, "method", r.Method,
		"from_node", rt.target.NodeID, "to_node", nt.NodeID, "err", err)
	r2 := r.Clone(context.WithValue(r.Context(), ctxKey{}, routed{target: nt, port: rt.port, presented: rt.presented}))
	r2.URL.Host = upstreamHost(nt, rt.port)
	r2.Body = body
	resp, _, err = t.attempt(r2, routed{target: nt, port: rt.port, presented: rt.presented, req: rt.req})
	return resp, err
}

// attempt sends r to rt.target under a context of its own, which Moved
// ends (the request's context, which Abort ends, stays): the response
// body is read under it, so it is never cancelled here. sent reports
// whether the transport began writing the request's headers (the first
// header field encoded, HTTP/1.1 or HTTP/2): from then on some of it may
// have reached the upstream.
func (t retryTransport) attempt(r *http.Request, rt routed) (resp *http.Response, sent bool, err error) {
	var wrote atomic.Bool
	ctx := httptrace.WithClientTrace(r.Context(), &httptrace.ClientTrace{
		WroteHeaderField: func(string, []string) { wrote.Store(true) },
		WroteHeaders:     func() { wrote.Store(true) },
	})
	if rt.req == nil {
		resp, err = t.next.RoundTrip(r.WithContext(ctx))
		return resp, wrote.Load(), err
	}
	ctx, cancel := context.WithCancelCause(ctx)
	rt.req.setAttempt(rt.target, cancel)
	resp, err = t.next.RoundTrip(r.WithContext(ctx))
	if err != nil && errors.Is(context.Cause(ctx), errMoved) && r.Context().Err() == nil {
		// Ended by Moved, not by the client: say so (a bare
		// cancellation would be taken for the client leaving).
		err = errMoved
	}
	return resp, wrote.Load(), err
}

// samePlaceFor is how long a failed request's resolve that found its
// sandbox where it was spares the sandbox's next failed requests theirs.
const samePlaceFor = time.Second

// notMoved records that a failed request's sandbox was found where it was.
func (h *Handler) notMoved(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	if h.samePlace == nil {
		h.samePlace = map[string]time.Time{}
	}
	if len(h.samePlace) >= 1024 {
		for k, at := range h.samePlace {
			if now.Sub(at) >= samePlaceFor {
				delete(h.samePlace, k)
			}
		}
	}
	h.samePlace[id] = now
}

// stillThere reports whether a failed request's resolve found sandbox id
// where it was within samePlaceFor.
func (h *Handler) stillThere(id string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	at, ok := h.samePlace[id]
	if ok && time.Since(at) >= samePlaceFor {
		delete(h.samePlace, id)
		return false
	}
	return ok
}

// reresolveError is a retry's resolve that failed: the client gets what
// that failure means (writeError), not a bare 502.
type reresolveError struct{ err, first error }

func (e *reresolveError) Error() string {
	return "request failed (" + e.first.Error() + "), and resolving the sandbox again failed: " + e.err.Error()
}

func (e *reresolveError) Unwrap() error { return e.err }

// replay returns the body to send r again with, and whether r may be
// sent again at all: one whose failed attempt wrote nothing (sent false),
// or that is safe to repeat (repeatable), and whose body, when it has
// one, nobody took a byte of nor is reading (body, the incoming
// request's, which the outgoing one reads through ReverseProxy's
// wrapper). The failed attempt's hold on the body ends here: its reads
// fail from now on, so the two attempts never share a byte.
func replay(r *http.Request, body *watchedBody, sent bool) (io.ReadCloser, bool) {
	if sent && !repeatable(r) {
		return nil, false
	}
	if r.Body == nil || r.Body == http.NoBody {
		return r.Body, true
	}
	if body == nil {
		return nil, false
	}
	return body.handOver()
}

// repeatable reports whether r may be sent again after some of it may
// have reached its upstream: a safe method (RFC 9110, 9.2.1), or a
// request its client marked with an Idempotency-Key.
func repeatable(r *http.Request) bool {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return r.Header.Get("Idempotency-Key") != ""
}

// watchedBody is a request body that records whether any of it was read,
// so that a request that failed before taking a byte may be sent again
// with it (handOver).
type watchedBody struct {
	mu       sync.Mutex
	rc       io.ReadCloser
	taken    bool // a byte was read
	reading  bool // a Read is under way
	detached bool // handed over to a retry: this one reads no more
}

var errHandedOver = errors.New("request body handed over to a retry")

func (b *watchedBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	if b.detached {
		b.mu.Unlock()
		return 0, errHandedOver
	}
	b.reading = true
	b.mu.Unlock()
	n, err := b.rc.Read(p)
	b.mu.Lock()
	b.reading = false
	if n > 0 {
		b.taken = true
	}
	b.mu.Unlock()
	return n, err
}

// Close closes the incoming body only when a read is under way (a
// transport ending a request unblocks its body writer so); otherwise the
// body stays for a retry, and the server closes it when the request ends.
func (b *watchedBody) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.reading && !b.detached {
		return b.rc.Close()
	}
	return nil
}

// handOver gives the body to a new attempt when none of it was taken and
// no read is under way; this one reads no more.
func (b *watchedBody) handOver() (io.ReadCloser, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.taken || b.reading || b.detached {
		return nil, false
	}
	b.detached = true
	return &watchedBody{rc: b.rc}, true
}

// sameLocation reports whether a and b reach a sandbox at the same place.
func sameLocation(a, b *Target) bool {
	return a.NodeID == b.NodeID && a.NodeAddr == b.NodeAddr && a.HostIP == b.HostIP && a.NetNS == b.NetNS
}

// upstreamHost is the outgoing request's URL host for port of sandbox t
// where t says it is: "<sandboxID>.<location>:<port>", the location a
// hash of where it is, so that the transports pool connections per place.
func upstreamHost(t *Target, port int) string {
	h := fnv.New64a()
	for _, s := range []string{t.NodeID, t.NodeAddr, t.HostIP, t.NetNS} {
		_, _ = io.WriteString(h, s)
		_, _ = h.Write([]byte{0})
	}
	return net.JoinHostPort(t.SandboxID+"."+strconv.FormatUint(h.Sum64(), 36), strconv.Itoa(port))
}
