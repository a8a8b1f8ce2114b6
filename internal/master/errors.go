package master

import (
	"errors"
	"fmt"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
)

// fromGRPC classifies an error from a cubelet call: a status comes back in
// the project's error vocabulary (grpcerr.FromGRPC, its ErrorDetail kept),
// so the layers above classify with errdefs only.
func fromGRPC(node string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("node %s: %w", node, grpcerr.FromGRPC(err))
}

// maybeCreated reports whether a failed create may nonetheless have made
// the sandbox on the node (the call got there but its answer did not come
// back), so the master must clean up before trying elsewhere.
func maybeCreated(err error) bool {
	if errors.Is(err, errNotSent) {
		return false
	}
	return errdefs.IsUnavailable(err) || errdefs.IsCanceled(err) || errors.Is(err, errdefs.ErrInternal)
}

// errNotSent: a call that was not made because the node's connection was
// down; Unavailable, and nothing to undo.
var errNotSent = fmt.Errorf("connection down, call not sent: %w", errdefs.ErrUnavailable)
