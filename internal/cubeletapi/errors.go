package cubeletapi

import (
	"errors"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/lifecycle"
)

// ToGRPC turns a Service error into a status with an ErrorDetail
// (grpcerr.ToGRPCDetail) naming the sandbox the call was about and, for an
// illegal transition, the sandbox's state.
func ToGRPC(err error, sandboxID string) error {
	if err == nil {
		return nil
	}
	d := &pb.ErrorDetail{SandboxId: sandboxID}
	var te *lifecycle.TransitionError
	if errors.As(err, &te) {
		d.CurrentState = stateToPB(te.From)
		d.SandboxId = te.ID
	}
	return grpcerr.ToGRPCDetail(err, d)
}
