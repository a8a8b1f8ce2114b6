package e2bapi

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
)

// TestNoSpaceStatus: a full disk on a node (relayed over gRPC, as the
// master sees it) is a 507 without Retry-After; the control, plain
// exhaustion, stays a 429 the SDKs retry.
func TestNoSpaceStatus(t *testing.T) {
	full := grpcerr.FromGRPC(grpcerr.ToGRPC(fmt.Errorf("clone: no space left on /var/lib/cube: %w", errdefs.ErrNoSpace)))
	busy := grpcerr.FromGRPC(grpcerr.ToGRPC(fmt.Errorf("create limit: %w", errdefs.ErrResourceExhausted)))
	for _, c := range []struct {
		err   error
		code  int
		ecode string
		retry string
	}{
		{fmt.Errorf("node n1: %w", full), http.StatusInsufficientStorage, "insufficient_storage", ""},
		{fmt.Errorf("node n1: %w", busy), http.StatusTooManyRequests, "sandbox_capacity_unavailable", "1"},
	} {
		w := httptest.NewRecorder()
		writeError(w, c.err)
		if w.Code != c.code || w.Header().Get("Retry-After") != c.retry {
			t.Errorf("%v: %d (Retry-After %q), want %d (%q)", c.err, w.Code, w.Header().Get("Retry-After"), c.code, c.retry)
		}
		if _, ecode := statusOf(c.err); ecode != c.ecode {
			t.Errorf("%v: error code %q, want %q", c.err, ecode, c.ecode)
		}
		t.Logf("%v → %d %s", c.err, w.Code, w.Body.String())
	}
}
