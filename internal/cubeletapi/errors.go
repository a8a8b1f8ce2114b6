package cubeletapi

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/lifecycle"
)

// codeOf classifies err once, in this one place.
func codeOf(err error) codes.Code {
	switch {
	case errdefs.IsInvalidArgument(err):
		return codes.InvalidArgument
	case errdefs.IsNotFound(err):
		return codes.NotFound
	case errdefs.IsAlreadyExists(err):
		return codes.AlreadyExists
	case errdefs.IsFailedPrecondition(err):
		return codes.FailedPrecondition
	case errdefs.IsResourceExhausted(err):
		return codes.ResourceExhausted
	case errdefs.IsUnavailable(err):
		return codes.Unavailable
	case errdefs.IsNotImplemented(err):
		return codes.Unimplemented
	case errors.Is(err, errdefs.ErrAborted):
		return codes.Aborted
	case errors.Is(err, errdefs.ErrUnauthenticated):
		return codes.Unauthenticated
	case errors.Is(err, errdefs.ErrPermissionDenied):
		return codes.PermissionDenied
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	}
	return codes.Internal
}

// ToGRPC turns a Service error into a status with an ErrorDetail.
func ToGRPC(err error, sandboxID string) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	code := codeOf(err)
	d := &pb.ErrorDetail{Reason: code.String(), SandboxId: sandboxID}
	var fe *cubelet.FieldError
	if errors.As(err, &fe) {
		d.Field = fe.Field
	}
	var te *lifecycle.TransitionError
	if errors.As(err, &te) {
		d.CurrentState = stateToPB(te.From)
		d.SandboxId = te.ID
	}
	st, derr := status.New(code, err.Error()).WithDetails(d)
	if derr != nil {
		return status.Error(code, err.Error())
	}
	return st.Err()
}

// Detail extracts the ErrorDetail of a status error, or nil.
func Detail(err error) *pb.ErrorDetail {
	st, ok := status.FromError(err)
	if !ok {
		return nil
	}
	for _, d := range st.Details() {
		if ed, ok := d.(*pb.ErrorDetail); ok {
			return ed
		}
	}
	return nil
}
