package master

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// nodeError is a cubelet's gRPC error turned back into the project's
// error vocabulary, so the layers above classify with errdefs only.
type nodeError struct {
	node string
	msg  string
	kind error
}

func (e *nodeError) Error() string { return "node " + e.node + ": " + e.msg }
func (e *nodeError) Unwrap() error { return e.kind }

// fromGRPC classifies an error from a cubelet call.
func fromGRPC(node string, err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok {
		return fmt.Errorf("node %s: %w", node, err)
	}
	var kind error
	switch st.Code() {
	case codes.InvalidArgument, codes.OutOfRange:
		kind = errdefs.ErrInvalidArgument
	case codes.NotFound:
		kind = errdefs.ErrNotFound
	case codes.AlreadyExists:
		kind = errdefs.ErrAlreadyExists
	case codes.FailedPrecondition:
		kind = errdefs.ErrFailedPrecondition
	case codes.ResourceExhausted:
		kind = errdefs.ErrResourceExhausted
	case codes.Unavailable:
		kind = errdefs.ErrUnavailable
	case codes.Unimplemented:
		kind = errdefs.ErrNotImplemented
	case codes.Aborted:
		kind = errdefs.ErrAborted
	case codes.DeadlineExceeded:
		kind = context.DeadlineExceeded
	case codes.Canceled:
		kind = context.Canceled
	default:
		kind = errdefs.ErrInternal
	}
	return &nodeError{node: node, msg: st.Message(), kind: kind}
}

// maybeCreated reports whether a failed create may nonetheless have made
// the sandbox on the node (the call got there but its answer did not come
// back), so the master must clean up before trying elsewhere.
func maybeCreated(err error) bool {
	return errdefs.IsUnavailable(err) || errdefs.IsCanceled(err) || errors.Is(err, errdefs.ErrInternal)
}
