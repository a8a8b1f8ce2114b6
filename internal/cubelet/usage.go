package cubelet

import (
	"context"
	"path/filepath"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/usage"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// newSampler builds the per-sandbox resource sampler over the service's
// records (package usage); Run starts it.
func (s *Service) newSampler() *usage.Sampler {
	return usage.New(usage.Config{
		Interval: s.cfg.Usage.Interval.Duration,
		Keep:     s.cfg.Usage.History,
		MaxBytes: s.cfg.Usage.MaxBytes,
		Series:   s.cfg.Usage.SandboxSeries,
	}, s.usageTargets, s.log)
}

// usageTargets lists every sandbox on the node for the sampler: running
// ones are sampled, the others keep their history until they leave.
func (s *Service) usageTargets() []usage.Target {
	s.mu.Lock()
	recs := make([]*sandbox.Record, 0, len(s.boxes))
	for _, e := range s.boxes {
		recs = append(recs, e.rec.Load())
	}
	s.mu.Unlock()
	out := make([]usage.Target, 0, len(recs))
	for _, r := range recs {
		out = append(out, s.usageTarget(r))
	}
	return out
}

func (s *Service) usageTarget(r *sandbox.Record) usage.Target {
	t := usage.Target{ID: r.ID, CgroupPath: s.cfg.CgroupPath(r.ID), MilliCPU: r.Resources.MilliCPU}
	if r.Container != nil && r.Container.CgroupPath != "" {
		t.CgroupPath = r.Container.CgroupPath
	}
	t.Live = r.State == lifecycle.Running && r.Container != nil
	if r.Mount != nil {
		t.FS = r.Mount.Target
	}
	if r.Disk != nil {
		t.Image = r.Disk.Path
	}
	if r.Network != nil && r.Network.SlotNetNS != "" {
		// The slot namespace is pinned under the name of the host end
		// of its veth pair (network/slot.Layout).
		t.HostLink = filepath.Base(r.Network.SlotNetNS)
	}
	return t
}

// Usage returns a sandbox's resource samples taken in [start, end] (zero
// bounds are open), oldest first. A sandbox not sampled yet (just made,
// or the node's cubelet just restarted) has none.
func (s *Service) Usage(_ context.Context, id string, start, end time.Time) ([]usage.Sample, error) {
	if _, err := s.lookup(id); err != nil {
		return nil, err
	}
	return s.usage.History(id, start, end), nil
}

// UsageInterval is how often sandboxes are sampled (0 = never).
func (s *Service) UsageInterval() time.Duration { return s.usage.Interval() }
