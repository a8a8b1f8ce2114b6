// Package errdefs is the project's one error vocabulary.
//
// Packages wrap these sentinels with %w (fmt.Errorf("template %q: %w", id,
// errdefs.ErrNotFound)) and callers classify with errors.Is. The mapping to
// gRPC status codes happens once, at the API edge (ToGRPC / FromGRPC), so
// nothing below the edge imports grpc/codes.
package errdefs

import (
	"context"
	"errors"
)

var (
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrUnavailable        = errors.New("unavailable")
	ErrNotImplemented     = errors.New("not implemented")
	ErrInternal           = errors.New("internal")
	ErrAborted            = errors.New("aborted")
	// ErrUnauthenticated: credentials missing or wrong (a registry's 401).
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrPermissionDenied: credentials valid but not allowed (a registry's 403).
	ErrPermissionDenied = errors.New("permission denied")
)

func IsInvalidArgument(err error) bool    { return errors.Is(err, ErrInvalidArgument) }
func IsNotFound(err error) bool           { return errors.Is(err, ErrNotFound) }
func IsAlreadyExists(err error) bool      { return errors.Is(err, ErrAlreadyExists) }
func IsFailedPrecondition(err error) bool { return errors.Is(err, ErrFailedPrecondition) }
func IsResourceExhausted(err error) bool  { return errors.Is(err, ErrResourceExhausted) }
func IsUnavailable(err error) bool        { return errors.Is(err, ErrUnavailable) }
func IsNotImplemented(err error) bool     { return errors.Is(err, ErrNotImplemented) }

// IsCanceled reports whether err comes from a cancelled or expired context.
func IsCanceled(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}
