package cubeletapi

import (
	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// pauseModeFromPB maps the request's mode; unspecified is memory, the
// mode the master's E2B pause relies on.
func pauseModeFromPB(m pb.PauseMode) (sandbox.PauseMode, error) {
	switch m {
	case pb.PauseMode_PAUSE_MODE_UNSPECIFIED, pb.PauseMode_PAUSE_MODE_MEMORY:
		return sandbox.PauseMemory, nil
	case pb.PauseMode_PAUSE_MODE_DISK:
		return sandbox.PauseDisk, nil
	default:
		return "", &errdefs.FieldError{Field: "mode", Msg: "unknown pause mode " + m.String()}
	}
}
