package master

import (
	"context"
	"fmt"
	"path"
	"regexp"
	"strings"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Volume sizes: E2B's API names no size, so a volume gets
// DefaultVolumeMiB unless the create asks for another (cube's extension).
// Images are sparse: the size is a limit, not space taken.
const (
	DefaultVolumeMiB = 1024
	MinVolumeMiB     = 4 // as storage.MinVolumeMiB: below it ext4 leaves no room
	MaxVolumeMiB     = 1 << 20
)

// volumeNameRE is what E2B accepts as a volume name.
var volumeNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

// VolumeMount asks for a team's volume (by name) mounted at Path.
type VolumeMount struct {
	Name string
	Path string
}

// CreateVolume adds a volume to the caller's team. It is a catalog row
// only: the node that first runs a sandbox mounting it makes its image
// (so a failed create leaves no file anywhere).
func (s *Service) CreateVolume(ctx context.Context, name string, sizeMiB int64) (*catalog.Volume, error) {
	if !volumeNameRE.MatchString(name) {
		return nil, errdefs.FieldErrorf("name", "%q: 1-128 letters, digits, '_', '.', '-', starting with a letter or digit", name)
	}
	if sizeMiB == 0 {
		sizeMiB = DefaultVolumeMiB
	}
	if sizeMiB < MinVolumeMiB || sizeMiB > MaxVolumeMiB {
		return nil, errdefs.FieldErrorf("sizeMiB", "%d: between %d and %d", sizeMiB, MinVolumeMiB, MaxVolumeMiB)
	}
	v := &catalog.Volume{
		ID: "vol-" + sandboxid.New(), Team: TeamOf(ctx), Name: name, SizeMiB: sizeMiB,
		Token: token(), CreatedAt: time.Now().UTC(),
	}
	if err := s.cat.CreateVolume(ctx, v); err != nil {
		return nil, err
	}
	s.log.Info("volume created", "volume_id", v.ID, "team", v.Team, "size_mib", sizeMiB)
	return v, nil
}

// GetVolume returns one of the caller's team's volumes.
func (s *Service) GetVolume(ctx context.Context, id string) (*catalog.Volume, error) {
	return s.cat.GetVolume(ctx, TeamOf(ctx), id)
}

// ListVolumes returns the caller's team's volumes.
func (s *Service) ListVolumes(ctx context.Context) ([]*catalog.Volume, error) {
	return s.cat.ListVolumes(ctx, TeamOf(ctx))
}

// DeleteVolume removes a volume: refused (FailedPrecondition) while a
// sandbox holds it; its image is removed from its node first, so a node
// that cannot be reached keeps the row (Unavailable) rather than leaving
// an image no row names.
func (s *Service) DeleteVolume(ctx context.Context, id string) error {
	v, err := s.cat.GetVolume(ctx, TeamOf(ctx), id)
	if err != nil {
		return err
	}
	// Take the volume for the delete, so no create claims it meanwhile.
	// A delete cut short (the master died, the node was down) left its
	// mark: a new delete takes over from it.
	deleting := deletingVolume + v.ID
	if holder, err := s.volumeHolder(ctx, v); err != nil {
		return err
	} else if holder != "" && holder != deleting {
		return fmt.Errorf("volume %s is mounted by sandbox %s; kill the sandbox first: %w", v.Name, holder, errdefs.ErrFailedPrecondition)
	}
	if ok, err := s.cat.ClaimVolume(ctx, v.ID, v.SandboxID, deleting, ""); err != nil {
		return err
	} else if !ok {
		return fmt.Errorf("volume %s was mounted meanwhile: %w", v.Name, errdefs.ErrFailedPrecondition)
	}
	if v.NodeID != "" {
		if err := s.deleteVolumeOn(ctx, v.NodeID, v.ID); err != nil {
			_, _ = s.cat.ClaimVolume(context.WithoutCancel(ctx), v.ID, deleting, "", "")
			return err
		}
	}
	if err := s.cat.DeleteVolume(ctx, v.Team, v.ID, deleting); err != nil {
		return err
	}
	s.log.Info("volume deleted", "volume_id", v.ID, "team", v.Team, "node_id", v.NodeID)
	return nil
}

func (s *Service) deleteVolumeOn(ctx context.Context, nodeID, id string) error {
	c, err := s.client(nodeID)
	if err != nil {
		return fmt.Errorf("volume %s lives on node %s: %w", id, nodeID, err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_, err = c.DeleteVolume(ctx, &cubeletpb.DeleteVolumeRequest{VolumeId: id})
	return fromGRPC(nodeID, err)
}

// maxSandboxVolumes bounds one sandbox's volumes (the node's bound too).
const maxSandboxVolumes = 8

// deletingVolume prefixes the holder a delete writes into a volume's
// row while it removes the volume's image from its node.
const deletingVolume = "deleting-"

// volumeHolder is the sandbox that holds v, "" when none: a holder whose
// row is gone (killed, failed) holds nothing. A delete in progress holds
// the volume (its mark is returned as the holder) until it ends.
func (s *Service) volumeHolder(ctx context.Context, v *catalog.Volume) (string, error) {
	if v.SandboxID == "" || strings.HasPrefix(v.SandboxID, deletingVolume) {
		return v.SandboxID, nil
	}
	if _, err := s.cat.GetSandbox(ctx, v.SandboxID); errdefs.IsNotFound(err) {
		return "", nil
	} else if err != nil {
		return "", err
	}
	return v.SandboxID, nil
}

// claimedVolume is a volume a create holds, with where it is mounted.
type claimedVolume struct {
	vol  *catalog.Volume
	path string
}

// claimVolumes makes sandbox id the holder of each volume asked for
// (FailedPrecondition when another live sandbox holds one). It returns
// the node they pin the sandbox to ("" when none has a node yet); two
// volumes on two nodes cannot be mounted together. On error, nothing is
// held.
func (s *Service) claimVolumes(ctx context.Context, id string, ms []VolumeMount) (vols []claimedVolume, pin string, err error) {
	if len(ms) > maxSandboxVolumes {
		// Before any catalog work: the node would refuse it after
		// placement anyway.
		return nil, "", errdefs.FieldErrorf("volumeMounts", "%d volumes, at most %d", len(ms), maxSandboxVolumes)
	}
	defer func() {
		if err != nil {
			s.releaseVolumes(id)
		}
	}()
	paths := map[string]bool{}
	for i, m := range ms {
		field := fmt.Sprintf("volumeMounts[%d]", i)
		if err := checkVolumePath(m.Path); err != nil {
			return nil, "", errdefs.FieldErrorf(field+".path", "%v", err)
		}
		if paths[m.Path] {
			return nil, "", errdefs.FieldErrorf(field+".path", "%q is mounted twice", m.Path)
		}
		paths[m.Path] = true
		v, err := s.cat.GetVolumeByName(ctx, TeamOf(ctx), m.Name)
		if err != nil {
			return nil, "", err
		}
		holder, err := s.volumeHolder(ctx, v)
		if err != nil {
			return nil, "", err
		}
		if holder == id {
			return nil, "", errdefs.FieldErrorf(field+".name", "volume %q is mounted twice", m.Name)
		}
		if strings.HasPrefix(holder, deletingVolume) {
			return nil, "", fmt.Errorf("volume %q is being deleted: %w", m.Name, errdefs.ErrFailedPrecondition)
		}
		if holder != "" {
			return nil, "", fmt.Errorf("volume %q is mounted by sandbox %s (one sandbox at a time): %w", m.Name, holder, errdefs.ErrFailedPrecondition)
		}
		if ok, err := s.cat.ClaimVolume(ctx, v.ID, v.SandboxID, id, m.Path); err != nil {
			return nil, "", err
		} else if !ok {
			return nil, "", fmt.Errorf("volume %q was mounted by another sandbox meanwhile: %w", m.Name, errdefs.ErrFailedPrecondition)
		}
		if v.NodeID != "" {
			if pin != "" && pin != v.NodeID {
				return nil, "", errdefs.FieldErrorf(field+".name", "volume %q lives on node %s, another of this sandbox's volumes on node %s: volumes are node-local", m.Name, v.NodeID, pin)
			}
			pin = v.NodeID
		}
		vols = append(vols, claimedVolume{vol: v, path: m.Path})
	}
	return vols, pin, nil
}

// SandboxVolumes returns the caller's team's volumes that sandbox id
// mounts (one indexed query: the API calls it on every GET of a sandbox).
func (s *Service) SandboxVolumes(ctx context.Context, id string) ([]VolumeMount, error) {
	vs, err := s.cat.SandboxVolumes(ctx, TeamOf(ctx), id)
	if err != nil {
		return nil, err
	}
	out := make([]VolumeMount, 0, len(vs))
	for _, v := range vs {
		out = append(out, VolumeMount{Name: v.Name, Path: v.MountPath})
	}
	return out, nil
}

// releaseVolumes clears sandbox id's hold on its volumes (a create that
// failed).
func (s *Service) releaseVolumes(id string) {
	if err := s.cat.ReleaseVolumes(context.Background(), id); err != nil {
		s.log.Warn("release volumes of a failed create; its holds lapse with its row", "sandbox_id", id, "err", err)
	}
}

// placeVolumes records the node a sandbox's volumes now live on.
func (s *Service) placeVolumes(ctx context.Context, vols []claimedVolume, nodeID string) error {
	for _, v := range vols {
		if v.vol.NodeID != "" {
			continue
		}
		got, err := s.cat.PlaceVolume(ctx, v.vol.ID, nodeID)
		if err != nil {
			return err
		}
		if got != nodeID {
			return fmt.Errorf("volume %s was placed on node %s meanwhile: %w", v.vol.Name, got, errdefs.ErrAborted)
		}
	}
	return nil
}

// volumesPB is what the node is told to mount.
func volumesPB(vols []claimedVolume) []*cubeletpb.VolumeMount {
	var out []*cubeletpb.VolumeMount
	for _, v := range vols {
		out = append(out, &cubeletpb.VolumeMount{VolumeId: v.vol.ID, Path: v.path, SizeMib: v.vol.SizeMiB})
	}
	return out
}

// pinnedNodes keeps only node pin when pin is set (a sandbox mounting a
// volume runs where the volume's image is).
func pinnedNodes(nodes []*scheduler.Node, pin string) []*scheduler.Node {
	if pin == "" {
		return nodes
	}
	out := nodes[:0:0]
	for _, n := range nodes {
		if n.ID == pin {
			out = append(out, n)
		}
	}
	return out
}

// checkVolumePath checks where a volume is mounted in the sandbox (the
// node checks it again against what its runtime owns).
func checkVolumePath(p string) error {
	switch {
	case p == "" || p[0] != '/' || path.Clean(p) != p:
		return fmt.Errorf("%q must be a clean absolute path", p)
	case p == "/":
		return fmt.Errorf("cannot mount over the sandbox's root")
	case len(p) > 1024:
		return fmt.Errorf("longer than 1024 bytes")
	}
	for _, r := range []string{"/proc", "/sys", "/dev"} {
		if p == r || len(p) > len(r) && p[:len(r)+1] == r+"/" {
			return fmt.Errorf("%q is inside %s, which the runtime owns", p, r)
		}
	}
	return nil
}

// pinnedByVolumes refuses to move sb to another node while it holds
// volumes: a volume is an image on its node's pool that nothing copies,
// so the sandbox would come back without it (and the volume stay held).
func (s *Service) pinnedByVolumes(ctx context.Context, sb *catalog.Sandbox) error {
	vs, err := s.cat.SandboxVolumes(ctx, sb.Team, sb.ID)
	if err != nil {
		return err
	}
	if len(vs) == 0 {
		return nil
	}
	names := make([]string, 0, len(vs))
	for _, v := range vs {
		names = append(names, v.Name)
	}
	return fmt.Errorf("sandbox %s mounts volumes %s, which live on node %s only (volumes are node-local): it cannot move; kill it, or wait for it to end: %w",
		sb.ID, strings.Join(names, ", "), sb.NodeID, errdefs.ErrFailedPrecondition)
}
