// Package rpcerr classifies the agent's errors once and maps them to the
// two edges the agent has: Connect codes (process and filesystem services)
// and HTTP statuses (/files, /init, ...).
//
// Packages below the edges return errdefs sentinels wrapped with %w, or raw
// os/syscall errors; FromOS turns the latter into the former, so a missing
// file is NotFound and a permission problem is PermissionDenied whichever
// service hit it.
package rpcerr

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// FromOS wraps err with the errdefs sentinel its errno stands for. Errors
// that already carry a sentinel, and nil, are returned unchanged.
func FromOS(err error) error {
	if err == nil || classified(err) {
		return err
	}
	var errno unix.Errno
	if !errors.As(err, &errno) {
		return err
	}
	var kind error
	switch errno {
	case unix.ENOENT:
		kind = errdefs.ErrNotFound
	case unix.EACCES, unix.EPERM, unix.EROFS:
		kind = errdefs.ErrPermissionDenied
	case unix.EEXIST, unix.ENOTEMPTY:
		kind = errdefs.ErrAlreadyExists
	case unix.ENOSPC, unix.EDQUOT, unix.EMFILE, unix.ENFILE:
		kind = errdefs.ErrResourceExhausted
	case unix.ENOTDIR, unix.EISDIR, unix.EINVAL, unix.ENAMETOOLONG, unix.ELOOP, unix.EXDEV, unix.ENOTSUP:
		kind = errdefs.ErrInvalidArgument
	case unix.ESRCH:
		kind = errdefs.ErrNotFound
	default:
		return err
	}
	return fmt.Errorf("%w: %w", err, kind)
}

func classified(err error) bool {
	for _, s := range []error{
		errdefs.ErrInvalidArgument, errdefs.ErrNotFound, errdefs.ErrAlreadyExists,
		errdefs.ErrFailedPrecondition, errdefs.ErrResourceExhausted, errdefs.ErrUnavailable,
		errdefs.ErrNotImplemented, errdefs.ErrInternal, errdefs.ErrAborted,
		errdefs.ErrUnauthenticated, errdefs.ErrPermissionDenied,
	} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// Code is err's Connect code.
func Code(err error) connect.Code {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Code()
	}
	err = FromOS(err)
	switch {
	case errdefs.IsInvalidArgument(err):
		return connect.CodeInvalidArgument
	case errdefs.IsNotFound(err):
		return connect.CodeNotFound
	case errdefs.IsAlreadyExists(err):
		return connect.CodeAlreadyExists
	case errdefs.IsFailedPrecondition(err):
		return connect.CodeFailedPrecondition
	case errdefs.IsResourceExhausted(err):
		return connect.CodeResourceExhausted
	case errdefs.IsUnavailable(err):
		return connect.CodeUnavailable
	case errdefs.IsNotImplemented(err):
		return connect.CodeUnimplemented
	case errors.Is(err, errdefs.ErrAborted):
		return connect.CodeAborted
	case errors.Is(err, errdefs.ErrUnauthenticated):
		return connect.CodeUnauthenticated
	case errors.Is(err, errdefs.ErrPermissionDenied):
		return connect.CodePermissionDenied
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	}
	return connect.CodeInternal
}

// ToConnect returns err as a *connect.Error with its classified code.
func ToConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	return connect.NewError(Code(err), err)
}

// Interceptor converts every error a handler returns with ToConnect, so
// services can return plain wrapped errors.
func Interceptor() connect.Interceptor { return interceptor{} }

type interceptor struct{}

func (interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		res, err := next(ctx, req)
		return res, ToConnect(err)
	}
}

func (interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return ToConnect(next(ctx, conn))
	}
}

// HTTPStatus is err's HTTP status, as envd's REST endpoints answer.
func HTTPStatus(err error) int {
	err = FromOS(err)
	switch {
	case errdefs.IsInvalidArgument(err):
		return http.StatusBadRequest
	case errdefs.IsNotFound(err):
		return http.StatusNotFound
	case errdefs.IsAlreadyExists(err):
		return http.StatusConflict
	case errdefs.IsFailedPrecondition(err):
		return http.StatusPreconditionFailed
	case errdefs.IsResourceExhausted(err):
		// envd's "not enough disk space"; the SDK maps it to NotEnoughSpaceError.
		return http.StatusInsufficientStorage
	case errors.Is(err, errdefs.ErrUnauthenticated):
		return http.StatusUnauthorized
	case errors.Is(err, errdefs.ErrPermissionDenied):
		return http.StatusForbidden
	case errdefs.IsNotImplemented(err):
		return http.StatusNotImplemented
	case errdefs.IsUnavailable(err):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// WriteHTTP writes err as envd's JSON error body {"code": N, "message": ...}
// with the matching status.
func WriteHTTP(w http.ResponseWriter, err error) {
	status := HTTPStatus(err)
	WriteHTTPStatus(w, status, err.Error())
}

// WriteHTTPStatus writes an envd JSON error with an explicit status.
func WriteHTTPStatus(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{status, msg})
}
