package cubelet

import (
	"context"
	"fmt"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/storage"
)

// maxVolumes bounds one sandbox's volumes.
const maxVolumes = 8

// checkVolumes validates a create request's volumes: IDs usable as one
// path element, clean absolute paths outside what the runtime owns and
// not bound twice (nor over a host mount), a size, and a runtime that
// binds host directories (a VM boots its own disk).
func (s *Service) checkVolumes(req *CreateRequest) error {
	if len(req.Volumes) == 0 {
		return nil
	}
	if len(req.Volumes) > maxVolumes {
		return errdefs.FieldErrorf("volumes", "%d volumes, at most %d", len(req.Volumes), maxVolumes)
	}
	if d := s.node.Drivers[req.Runtime]; d != nil && d.Capabilities().BootsDisk {
		return fmt.Errorf("volumes: runtime %q boots its own disk and binds no host directory; volumes are mounted on runc and gvisor only: %w", req.Runtime, errdefs.ErrNotImplemented)
	}
	dests := map[string]bool{}
	for _, m := range req.HostMounts {
		dests[m.Destination] = true
	}
	ids := map[string]bool{}
	for i, v := range req.Volumes {
		field := fmt.Sprintf("volumes[%d]", i)
		if err := storage.ValidateID(v.ID); err != nil {
			return errdefs.FieldErrorf(field+".volume_id", "%q is not a volume ID", v.ID)
		}
		if ids[v.ID] {
			return errdefs.FieldErrorf(field+".volume_id", "%s is mounted twice", v.ID)
		}
		ids[v.ID] = true
		if err := actions.CheckDestination(v.Path); err != nil {
			return &errdefs.FieldError{Field: field + ".path", Msg: err.Error()}
		}
		if dests[v.Path] {
			return errdefs.FieldErrorf(field+".path", "%q is bound twice", v.Path)
		}
		dests[v.Path] = true
		if v.SizeMiB < storage.MinVolumeMiB {
			return errdefs.FieldErrorf(field+".size_mib", "%d MiB is below the minimum %d MiB", v.SizeMiB, storage.MinVolumeMiB)
		}
	}
	return nil
}

// DeleteVolume removes a volume's image from the node; FailedPrecondition
// while a sandbox has it mounted. It reports whether the node held it.
func (s *Service) DeleteVolume(ctx context.Context, id string) (bool, error) {
	return s.node.DeleteVolume(ctx, id)
}
