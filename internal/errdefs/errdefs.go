// Package errdefs is the project's one error vocabulary.
//
// Packages wrap these sentinels with %w (fmt.Errorf("template %q: %w", id,
// errdefs.ErrNotFound)) and callers classify with errors.Is. The mapping to
// gRPC status codes and back happens once, in package errdefs/grpcerr, at
// the API edges, so nothing below an edge imports grpc/codes.
package errdefs

import (
	"context"
	"errors"
	"fmt"
)

// The kinds. Each has one gRPC code (see grpcerr); context.Canceled and
// context.DeadlineExceeded are kinds too.
var (
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrOutOfRange: an argument past the end of what is valid now (an
	// offset, a page). It is also an InvalidArgument: errors.Is(err,
	// ErrInvalidArgument) holds for it.
	ErrOutOfRange         error = &subKind{msg: "out of range", parent: ErrInvalidArgument}
	ErrNotFound                 = errors.New("not found")
	ErrAlreadyExists            = errors.New("already exists")
	ErrFailedPrecondition       = errors.New("failed precondition")
	ErrResourceExhausted        = errors.New("resource exhausted")
	ErrUnavailable              = errors.New("unavailable")
	ErrNotImplemented           = errors.New("not implemented")
	ErrInternal                 = errors.New("internal")
	ErrAborted                  = errors.New("aborted")
	// ErrUnauthenticated: credentials missing or wrong (a registry's 401).
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrPermissionDenied: credentials valid but not allowed (a registry's 403).
	ErrPermissionDenied = errors.New("permission denied")
	// ErrNoSpace: a filesystem the operation writes to is full (ENOSPC,
	// EDQUOT, SQLite's "database or disk is full"). It is also a
	// ResourceExhausted: errors.Is(err, ErrResourceExhausted) holds for it.
	// Unlike other exhaustion it does not pass by waiting: an operator
	// frees space, and the same call then succeeds.
	ErrNoSpace error = &subKind{msg: "no space left on device", parent: ErrResourceExhausted}
)

// subKind is a kind that is also a more general one.
type subKind struct {
	msg    string
	parent error
}

func (k *subKind) Error() string { return k.msg }
func (k *subKind) Unwrap() error { return k.parent }

func IsInvalidArgument(err error) bool    { return errors.Is(err, ErrInvalidArgument) }
func IsOutOfRange(err error) bool         { return errors.Is(err, ErrOutOfRange) }
func IsNotFound(err error) bool           { return errors.Is(err, ErrNotFound) }
func IsAlreadyExists(err error) bool      { return errors.Is(err, ErrAlreadyExists) }
func IsFailedPrecondition(err error) bool { return errors.Is(err, ErrFailedPrecondition) }
func IsResourceExhausted(err error) bool  { return errors.Is(err, ErrResourceExhausted) }
func IsNoSpace(err error) bool            { return errors.Is(err, ErrNoSpace) }
func IsUnavailable(err error) bool        { return errors.Is(err, ErrUnavailable) }
func IsNotImplemented(err error) bool     { return errors.Is(err, ErrNotImplemented) }
func IsInternal(err error) bool           { return errors.Is(err, ErrInternal) }
func IsAborted(err error) bool            { return errors.Is(err, ErrAborted) }
func IsUnauthenticated(err error) bool    { return errors.Is(err, ErrUnauthenticated) }
func IsPermissionDenied(err error) bool   { return errors.Is(err, ErrPermissionDenied) }

// IsCanceled reports whether err comes from a cancelled or expired context.
func IsCanceled(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// FieldError is an InvalidArgument about one request field. The API edge
// puts Field in the error detail, so clients learn which field to fix.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }
func (e *FieldError) Unwrap() error { return ErrInvalidArgument }

// FieldErrorf returns a *FieldError about field with a formatted message.
func FieldErrorf(field, format string, a ...any) error {
	return &FieldError{Field: field, Msg: fmt.Sprintf(format, a...)}
}
