package cubelet

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
	"github.com/cubesandbox/cube/internal/workflow"
)

// Warm templates: a template can carry a memory snapshot of a sandbox
// booted from it, taken once its agent answered. A create from such a
// template is a clone of that snapshot — a restore of a booted sandbox
// instead of a boot — with the create's own ID, labels, env and network
// policy. That is where VM starts in tens of milliseconds come from on
// KVM hosts, and what makes a gVisor start skip the sentry's boot.

// WarmResult is the warmed template and the timings of the boot and
// snapshot that warmed it.
type WarmResult struct {
	Template *sandbox.Template
	Timings  []workflow.Timing
}

// WarmTemplate boots a sandbox from template id on runtime (the
// template's, else the node default, when empty), snapshots it with its
// memory, destroys it and records the snapshot as the template's warm
// snapshot, replacing any earlier one. Runtimes that cannot checkpoint
// memory are FailedPrecondition. The template's runtime becomes runtime,
// so creates that name none restore the snapshot.
func (s *Service) WarmTemplate(ctx context.Context, id, runtime string) (*WarmResult, error) {
	tmpl, err := s.GetTemplate(ctx, id)
	if err != nil {
		return nil, err
	}
	if runtime == "" {
		runtime = tmpl.Runtime
	}
	if runtime == "" {
		runtime = s.cfg.Node.DefaultRuntime
	}
	d, err := s.node.Driver(runtime)
	if err != nil {
		return nil, &errdefs.FieldError{Field: "runtime", Msg: err.Error()}
	}
	if c := d.Capabilities(); !c.Checkpoint || !c.Restore {
		return nil, fmt.Errorf("runtime %s cannot take memory snapshots, so template %s cannot be warmed: %w", runtime, id, errdefs.ErrFailedPrecondition)
	}
	if err := s.claimTemplate(id); err != nil {
		return nil, err
	}
	defer s.unclaimTemplate(id)

	log := s.log.With("template_id", id, "runtime", runtime)
	var timings []workflow.Timing
	boot, err := s.Create(ctx, CreateRequest{
		SandboxID: "warm-" + sandboxid.New()[:12], TemplateID: id, Runtime: runtime, cold: true,
		Labels: map[string]string{LabelWarmTemplate: id},
		// A token nobody but this node knows: every clone of the warm
		// snapshot holds it until its reinit gives it its own, so none
		// serves without a token in between.
		AccessToken: rand.Text(),
	})
	if boot != nil {
		timings = append(timings, boot.Timings...)
	}
	if err != nil {
		return nil, fmt.Errorf("warm template %s: boot: %w", id, err)
	}
	// Stop: the booted sandbox goes once the snapshot is taken (or if it
	// fails: removed below).
	snap, err := s.Snapshot(ctx, SnapshotRequest{
		SandboxID: boot.Sandbox.ID, Name: "warm-" + id, Stop: true,
		Labels: map[string]string{LabelWarmTemplate: id},
	})
	if snap != nil {
		timings = append(timings, snap.Timings...)
	}
	if err != nil {
		if _, derr := s.Delete(context.WithoutCancel(ctx), boot.Sandbox.ID); derr != nil && !errdefs.IsNotFound(derr) {
			err = errors.Join(err, derr)
		}
		if snap != nil && snap.Snapshot != nil {
			err = errors.Join(err, s.removeSnapshot(snap.Snapshot, "discarded: warming failed"))
		}
		return nil, fmt.Errorf("warm template %s: %w", id, err)
	}
	sn := snap.Snapshot
	if !sn.HasMemory {
		return nil, errors.Join(
			fmt.Errorf("warm template %s: runtime %s took a disk-only snapshot: %w", id, runtime, errdefs.ErrFailedPrecondition),
			s.removeSnapshot(sn, "discarded: no memory image"))
	}
	sn.WarmFor = id
	if err := s.store.PutSnapshot(sn); err != nil {
		return nil, errors.Join(err, s.removeSnapshot(sn, "discarded: warming failed"))
	}
	// Re-read: the template may have changed while the sandbox booted.
	tmpl, err = s.store.GetTemplate(id)
	if err != nil {
		return nil, errors.Join(err, s.removeSnapshot(sn, "discarded: template gone"))
	}
	old := tmpl.WarmSnapshotID
	tmpl.WarmSnapshotID, tmpl.Runtime = sn.ID, runtime
	if err := s.store.PutTemplate(tmpl); err != nil {
		return nil, errors.Join(err, s.removeSnapshot(sn, "discarded: warming failed"))
	}
	if old != "" && old != sn.ID {
		s.dropWarmSnapshot(old, "replaced by a newer warm snapshot")
	}
	log.Info("template warmed", "snapshot_id", sn.ID, "memory_dir", sn.MemoryDir)
	return &WarmResult{Template: tmpl, Timings: timings}, nil
}

// LabelWarmTemplate marks the sandbox and snapshot of a warm-up.
const LabelWarmTemplate = "cube.warm-template"

// claimTemplate keeps imports and other warm-ups of id out while one runs.
func (s *Service) claimTemplate(id string) error {
	s.tmplMu.Lock()
	defer s.tmplMu.Unlock()
	if s.importing[id] {
		return fmt.Errorf("template %q is being imported or warmed: %w", id, errdefs.ErrAlreadyExists)
	}
	s.importing[id] = true
	return nil
}

func (s *Service) unclaimTemplate(id string) {
	s.tmplMu.Lock()
	delete(s.importing, id)
	s.tmplMu.Unlock()
}

// dropWarmSnapshot removes a template's warm snapshot, logging failures:
// the orphan sweep gets what is left.
func (s *Service) dropWarmSnapshot(id, why string) {
	sn, err := s.store.GetSnapshot(id)
	if err != nil {
		return
	}
	if err := s.removeSnapshot(sn, why); err != nil {
		s.log.Warn("remove warm snapshot", "snapshot_id", id, "err", err)
	}
}

// warmSnapshotFor is the warm snapshot a create restores, nil when it
// boots: the template has none, the create asks for another runtime, or
// for host mounts (binds cannot be added to a restored sandbox).
func (s *Service) warmSnapshotFor(tmpl *sandbox.Template, req *CreateRequest) *sandbox.Snapshot {
	if req.cold || tmpl.WarmSnapshotID == "" || len(req.HostMounts) > 0 || len(req.Volumes) > 0 {
		return nil
	}
	sn, err := s.store.GetSnapshot(tmpl.WarmSnapshotID)
	if err != nil || sn.State != sandbox.SnapshotReady || !sn.HasMemory || sn.Runtime != req.Runtime {
		return nil
	}
	return sn
}

// warmShapeWarnings says, when req asked for another CPU or memory shape
// than the warm snapshot's (has), that the snapshot's was kept.
func warmShapeWarnings(req CreateRequest, has sandbox.Resources) []string {
	if r := req.Resources; r.MilliCPU != has.MilliCPU || r.MemoryMiB != has.MemoryMiB {
		return []string{fmt.Sprintf(
			"restored the warm snapshot of template %s with its shape (%d mCPU, %d MiB), not the %d mCPU, %d MiB asked for",
			req.TemplateID, has.MilliCPU, has.MemoryMiB, r.MilliCPU, r.MemoryMiB)}
	}
	return nil
}

// createWarm is a create served by restoring the template's warm
// snapshot: a clone of one with the create's identity. The snapshot's
// CPU and memory shape is kept (a memory image cannot change it); a
// request for another shape is served with a warning saying so.
func (s *Service) createWarm(ctx context.Context, req CreateRequest, sn *sandbox.Snapshot) (*Result, error) {
	warnings := warmShapeWarnings(req, sn.Resources)
	res, err := s.Clone(ctx, CloneRequest{
		RequestID: req.RequestID, SnapshotID: sn.ID, Count: 1, SandboxIDs: []string{req.SandboxID},
		Labels: req.Labels, Annotations: req.Annotations, Env: req.Env, Network: req.Network,
		AccessTokens: []string{req.AccessToken},
	})
	if err != nil {
		var timings []workflow.Timing
		if res != nil {
			timings = res.Timings
		}
		return &Result{Timings: timings}, fmt.Errorf("create from the warm snapshot of template %s: %w", req.TemplateID, err)
	}
	for _, w := range warnings {
		s.log.Warn(w, "sandbox_id", req.SandboxID)
	}
	return &Result{Sandbox: res.Sandboxes[0], Timings: res.Timings, Warm: true, Warnings: warnings}, nil
}

// warmOf reports whether a snapshot is some template's warm snapshot,
// which only deleting or re-warming the template removes. One whose
// template does not point at it (a warm-up cut short, a failed removal) is
// an ordinary snapshot again.
func (s *Service) warmOf(sn *sandbox.Snapshot) error {
	if !s.isWarm(sn) {
		return nil
	}
	return fmt.Errorf("snapshot %s is the warm snapshot of template %s (%s): delete or re-warm the template instead: %w",
		sn.ID, sn.WarmFor, strings.TrimSpace(sn.Name), errdefs.ErrFailedPrecondition)
}

// isWarm: sn is the warm snapshot its template currently points at.
func (s *Service) isWarm(sn *sandbox.Snapshot) bool {
	if sn.WarmFor == "" {
		return false
	}
	t, err := s.store.GetTemplate(sn.WarmFor)
	return err == nil && t.WarmSnapshotID == sn.ID
}
