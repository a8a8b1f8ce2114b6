package rpcerr

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestClassification(t *testing.T) {
	_, statErr := os.Stat("/nonexistent/path")
	cases := []struct {
		err    error
		code   connect.Code
		status int
	}{
		{statErr, connect.CodeNotFound, http.StatusNotFound},
		{&os.PathError{Op: "open", Path: "/root/x", Err: unix.EACCES}, connect.CodePermissionDenied, http.StatusForbidden},
		{fmt.Errorf("write: %w", unix.ENOSPC), connect.CodeResourceExhausted, http.StatusInsufficientStorage},
		{fmt.Errorf("mkdir: %w", unix.EEXIST), connect.CodeAlreadyExists, http.StatusConflict},
		{fmt.Errorf("x: %w", unix.ENOTDIR), connect.CodeInvalidArgument, http.StatusBadRequest},
		{fmt.Errorf("x: %w", errdefs.ErrFailedPrecondition), connect.CodeFailedPrecondition, http.StatusPreconditionFailed},
		{fmt.Errorf("x: %w", errdefs.ErrUnauthenticated), connect.CodeUnauthenticated, http.StatusUnauthorized},
		{context.DeadlineExceeded, connect.CodeDeadlineExceeded, http.StatusInternalServerError},
		{fmt.Errorf("plain"), connect.CodeInternal, http.StatusInternalServerError},
		{connect.NewError(connect.CodeAborted, fmt.Errorf("kept")), connect.CodeAborted, http.StatusInternalServerError},
	}
	for _, c := range cases {
		if got := Code(c.err); got != c.code {
			t.Errorf("Code(%v) = %v, want %v", c.err, got, c.code)
		}
		if got := HTTPStatus(c.err); got != c.status {
			t.Errorf("HTTPStatus(%v) = %d, want %d", c.err, got, c.status)
		}
		if ce := ToConnect(c.err); connect.CodeOf(ce) != c.code {
			t.Errorf("ToConnect(%v) code %v", c.err, connect.CodeOf(ce))
		}
	}
	if ToConnect(nil) != nil || FromOS(nil) != nil {
		t.Error("nil must stay nil")
	}
	w := httptest.NewRecorder()
	WriteHTTP(w, fmt.Errorf("gone: %w", errdefs.ErrNotFound))
	if w.Code != 404 || !strings.Contains(w.Body.String(), `"code":404`) || !strings.Contains(w.Body.String(), `"message":"gone: not found"`) {
		t.Errorf("WriteHTTP: %d %s", w.Code, w.Body)
	}
}
