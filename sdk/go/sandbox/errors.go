package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"
)

// Kinds of failure; match them with errors.Is. Every error this package
// returns from a call to the service matches at most one of them.
var (
	// ErrNotFound: no such sandbox, snapshot, template, process or file
	// (another team's sandbox is not found too).
	ErrNotFound = errors.New("not found")
	// ErrAuth: the API key or the sandbox's access token is missing or
	// wrong (401), or the caller may not do this (403).
	ErrAuth = errors.New("authentication failed")
	// ErrRateLimit: the service refused for lack of room or over a quota
	// (429); APIError.RetryAfter says when to retry, if ever.
	ErrRateLimit = errors.New("rate limited")
	// ErrTimeout: the call's deadline passed (the context's, the request
	// timeout's, or the service's own).
	ErrTimeout = errors.New("timeout")
	// ErrInvalidArgument: the service refused the request as malformed
	// or unsupported (400).
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrConflict: the sandbox's state forbids the verb, e.g. pausing a
	// paused sandbox (409), or the name is taken.
	ErrConflict = errors.New("conflict")
	// ErrNotImplemented: the service cannot do this (501), e.g. a
	// snapshot on a node without snapshots.
	ErrNotImplemented = errors.New("not implemented")
	// ErrUnavailable: the service or the sandbox cannot be reached now
	// (502, 503, a connection refused).
	ErrUnavailable = errors.New("unavailable")
)

// APIError is a refusal from the E2B REST API: its status and its
// {"code", "message"} body. errors.Is matches it with the kind its status
// means.
type APIError struct {
	StatusCode int
	Message    string
	// ErrorCode is the body's machine-readable error_code, if any.
	ErrorCode string
	// RetryAfter is the Retry-After header of a 429; zero when the service
	// named no time (retrying will not help, e.g. a team over its quota).
	RetryAfter time.Duration
}

func (e *APIError) Error() string {
	return strconv.Itoa(e.StatusCode) + ": " + e.Message
}

// Is reports whether the status means target's kind.
func (e *APIError) Is(target error) bool {
	return kindOfStatus(e.StatusCode) == target
}

func kindOfStatus(code int) error {
	switch code {
	case http.StatusNotFound:
		return ErrNotFound
	case http.StatusUnauthorized, http.StatusForbidden:
		return ErrAuth
	case http.StatusTooManyRequests:
		return ErrRateLimit
	case http.StatusRequestTimeout, http.StatusGatewayTimeout:
		return ErrTimeout
	case http.StatusBadRequest, http.StatusUnprocessableEntity:
		return ErrInvalidArgument
	case http.StatusConflict, http.StatusPreconditionFailed:
		return ErrConflict
	case http.StatusNotImplemented:
		return ErrNotImplemented
	case http.StatusBadGateway, http.StatusServiceUnavailable:
		return ErrUnavailable
	}
	return nil
}

// kindOfConnect maps an agent's Connect code to a kind.
func kindOfConnect(code connect.Code) error {
	switch code {
	case connect.CodeNotFound:
		return ErrNotFound
	case connect.CodeUnauthenticated, connect.CodePermissionDenied:
		return ErrAuth
	case connect.CodeResourceExhausted:
		return ErrRateLimit
	case connect.CodeDeadlineExceeded:
		return ErrTimeout
	case connect.CodeInvalidArgument, connect.CodeOutOfRange:
		return ErrInvalidArgument
	case connect.CodeAlreadyExists, connect.CodeFailedPrecondition, connect.CodeAborted:
		return ErrConflict
	case connect.CodeUnimplemented:
		return ErrNotImplemented
	case connect.CodeUnavailable:
		return ErrUnavailable
	}
	return nil
}

// kindError adds a kind to an error while keeping the original in the
// chain (a *connect.Error, a context error, a *url.Error).
type kindError struct {
	kind error
	err  error
}

func (e *kindError) Error() string   { return e.err.Error() }
func (e *kindError) Unwrap() []error { return []error{e.err, e.kind} }

// classify gives err its kind; op names the call for the message.
func classify(op string, err error) error {
	if err == nil {
		return nil
	}
	var kind error
	var ce *connect.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		kind = ErrTimeout
	case errors.As(err, &ce):
		kind = kindOfConnect(ce.Code())
	}
	err = fmt.Errorf("%s: %w", op, err)
	if kind == nil || errors.Is(err, kind) {
		return err
	}
	return &kindError{kind: kind, err: err}
}

// CommandExitError is returned, with the command's result, when a command
// exits with a non-zero status or is killed by a signal.
type CommandExitError struct {
	CommandResult
}

func (e *CommandExitError) Error() string {
	msg := "command exited with code " + strconv.Itoa(e.ExitCode)
	if e.Err != "" {
		msg += ": " + e.Err
	}
	return msg
}
