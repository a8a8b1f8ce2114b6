package master

import (
	"context"
	"strconv"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Labels the master puts on the sandboxes it creates besides ManagedLabel:
// what reconcile needs to adopt one whose row the catalog lost.
const (
	teamLabel    = "cube.team"
	timeoutLabel = "cube.timeout"         // the timeout asked for, in seconds
	privateLabel = "cube.private-traffic" // "true": the route needs a traffic token
)

// managedLabels are the node labels of a sandbox the master creates.
func managedLabels(sb *catalog.Sandbox) map[string]string {
	l := map[string]string{
		ManagedLabel: ManagedValue,
		teamLabel:    sb.Team,
		timeoutLabel: strconv.FormatInt(int64(sb.EndAt.Sub(sb.StartedAt)/time.Second), 10),
	}
	if sb.TrafficAccessToken != "" {
		l[privateLabel] = "true"
	}
	return l
}

// adoptable reports whether a managed sandbox a node holds without a row
// or a tombstone is recent enough to be adopted (sandbox.adopt_window):
// its row was lost with the catalog, and a client may hold it. An older
// one is destroyed: the tombstone of a removal that old may have been
// pruned, so it may be one the master removed on purpose.
func (s *Service) adoptable(nsb *cubeletpb.Sandbox, now time.Time) bool {
	w := s.cfg.Sandbox.AdoptWindow.Duration
	if w <= 0 || nsb.CreatedAt == nil {
		return false
	}
	switch nsb.State {
	case cubeletpb.SandboxState_SANDBOX_STATE_RUNNING, cubeletpb.SandboxState_SANDBOX_STATE_PAUSED:
	default:
		return false
	}
	return now.Sub(nsb.CreatedAt.AsTime()) < w
}

// adopt writes the row of a sandbox a node holds, from its node record
// and labels. The deadline counts from its creation with the timeout it
// was created with (else sandbox.default_timeout); its metadata and
// envd access token are not on the node and stay empty (its agent keeps
// requiring the token the client holds). A sandbox created with a
// private route gets a traffic token nobody knows: its route stays
// closed rather than open to all.
func (s *Service) adopt(ctx context.Context, nodeID string, nsb *cubeletpb.Sandbox) (*catalog.Sandbox, error) {
	created := nsb.CreatedAt.AsTime().UTC()
	timeout := s.cfg.Sandbox.DefaultTimeout.Duration
	if v, err := strconv.ParseInt(nsb.Labels[timeoutLabel], 10, 64); err == nil && v > 0 {
		timeout = time.Duration(v) * time.Second
	}
	state := catalog.StateRunning
	if nsb.State == cubeletpb.SandboxState_SANDBOX_STATE_PAUSED {
		state = catalog.StatePaused
	}
	row := &catalog.Sandbox{
		ID: nsb.Id, TemplateID: nsb.TemplateId, NodeID: nodeID, State: state,
		MilliCPU: nsb.GetResources().GetMilliCpu(), MemoryMiB: nsb.GetResources().GetMemoryMib(),
		StartedAt: created, EndAt: created.Add(timeout),
		Runtime: nsb.Runtime, Team: nsb.Labels[teamLabel],
	}
	if nsb.Labels[privateLabel] == "true" {
		row.TrafficAccessToken = token()
	}
	if err := s.cat.CreateSandbox(ctx, row); err != nil {
		return nil, err
	}
	s.event(row.ID, "warn", "sandbox adopted from its node: the catalog had no row for it", map[string]string{"node": nodeID})
	return row, nil
}
