package master

import (
	"context"
	"crypto/tls"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
	"github.com/cubesandbox/cube/internal/pki"
)

// registry is the master's live view of its nodes. The catalog holds the
// same facts durably (so a restarted master knows where every sandbox is
// before the first heartbeat); the registry adds what only matters while
// running: connections to each cubelet and placements not yet reflected
// in a heartbeat.
//
// A node is healthy while its last heartbeat is younger than
// nodes.unhealthy_after and it reported every condition OK. An unhealthy
// node gets no new sandboxes; a silent one's sandboxes are marked failed
// (lostLoop) until it registers again.
type registry struct {
	mu    sync.Mutex
	nodes map[string]*nodeState
	// tls is how nodes at host:port are dialled ([tls]); nil = plaintext.
	tls *tls.Config
}

type nodeState struct {
	report      *masterpb.NodeReport
	lastSeen    time.Time
	registered  time.Time
	schedulable bool
	conn        *grpc.ClientConn
	client      cubeletpb.CubeletServiceClient
	// pending are placements made since the node's last heartbeat: the
	// scheduler counts them on top of the reported allocation so that a
	// burst of creates does not all pick the same node.
	pending map[string]reservation
	healthy bool // as last logged
	busy    bool // as last logged
	// templatesAt is when the node listed the templates report holds,
	// when the master asked for them after an import or delete (the
	// node's clock): a heartbeat generated before it keeps them.
	templatesAt time.Time
}

// newerTemplates returns r, or a copy of it with the templates of n's
// report when r was generated before the master's own listing of the
// node's templates (after an import or delete): r's set is older. Reports
// are shared read-only. Caller holds mu.
func (n *nodeState) newerTemplates(r *masterpb.NodeReport) *masterpb.NodeReport {
	if n.report == nil || r.GeneratedAt == nil || !r.GeneratedAt.AsTime().Before(n.templatesAt) {
		return r
	}
	r = proto.Clone(r).(*masterpb.NodeReport)
	r.Templates = n.report.Templates
	return r
}

type reservation struct {
	cpu, mem int64
	template string
	// created is when the node recorded the sandbox (the node's clock;
	// zero while the create is in flight): a report generated at or after
	// it counts the sandbox, and the reservation is dropped.
	created time.Time
}

var nodeIDRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

func validateReport(r *masterpb.NodeReport) error {
	if r == nil {
		return fmt.Errorf("node report missing: %w", errdefs.ErrInvalidArgument)
	}
	if !nodeIDRE.MatchString(r.NodeId) {
		return fmt.Errorf("node id %q: 1-64 letters, digits, '.', '_' or '-': %w", r.NodeId, errdefs.ErrInvalidArgument)
	}
	if r.Address == "" {
		return fmt.Errorf("node %s: address missing: %w", r.NodeId, errdefs.ErrInvalidArgument)
	}
	return nil
}

// setAddress (re)connects node id when its address changed. Over TLS the
// node must present a node certificate naming id: another node's, or any
// other component's, is refused at the handshake. Caller holds mu.
func (n *nodeState) setAddress(id, addr string, tc *tls.Config) error {
	if n.conn != nil && n.conn.Target() == addr || n.conn != nil && n.conn.Target() == "unix://"+addr {
		return nil
	}
	conn, err := cubeletclient.DialTLS(addr, pki.ExpectPeer(tc, id, pki.RoleNode))
	if err != nil {
		return fmt.Errorf("node address %q: %v: %w", addr, err, errdefs.ErrInvalidArgument)
	}
	if n.conn != nil {
		n.conn.Close()
	}
	n.conn, n.client = conn, cubeletclient.New(conn)
	return nil
}

// loadNodes fills the registry from the catalog at start-up.
func (s *Service) loadNodes(ctx context.Context) error {
	nodes, err := s.cat.ListNodes(ctx)
	if err != nil {
		return err
	}
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	for _, n := range nodes {
		var rep masterpb.NodeReport
		if err := protojson.Unmarshal(n.Report, &rep); err != nil {
			s.log.Warn("catalog node report unreadable; waiting for its next registration", "node_id", n.ID, "err", err)
			continue
		}
		ns := &nodeState{report: &rep, lastSeen: n.LastHeartbeat, registered: n.RegisteredAt, schedulable: n.Schedulable, pending: map[string]reservation{}}
		if err := ns.setAddress(n.ID, n.Address, s.reg.tls); err != nil {
			s.log.Warn("node address unusable", "node_id", n.ID, "err", err)
			continue
		}
		ns.healthy = s.healthOf(ns, time.Now()) == ""
		s.reg.nodes[n.ID] = ns
	}
	return nil
}

func reportTemplates(r *masterpb.NodeReport) []catalog.NodeTemplate {
	out := make([]catalog.NodeTemplate, 0, len(r.Templates))
	for _, t := range r.Templates {
		out = append(out, catalog.NodeTemplate{NodeID: r.NodeId, TemplateID: t.Id, Digest: t.Digest, SizeBytes: t.SizeBytes, CreatedAt: t.CreatedAt.AsTime()})
	}
	return out
}

// Register records a (re)started cubelet and reconciles the catalog with
// the sandboxes it really has (in the background: registration must not
// wait on a call back to the node).
func (s *Service) Register(ctx context.Context, r *masterpb.NodeReport) error {
	if err := validateReport(r); err != nil {
		return err
	}
	if err := s.secondRegistrant(r); err != nil {
		return err
	}
	now := time.Now()
	if err := s.putNode(ctx, r, now, true); err != nil {
		return err
	}
	s.log.Info("node registered", "node_id", r.NodeId, "address", r.Address, "version", r.Version, "templates", len(r.Templates))
	have := map[string]bool{}
	for _, t := range r.Templates {
		have[t.Id] = true
	}
	s.syncNode(r.NodeId, have)
	// The holder of the loops' lease reconciles; on another replica of a
	// shared catalog the holder sees the registration in the catalog
	// (refreshNodes) and reconciles it there.
	s.reconcileRegistered(r.NodeId)
	return nil
}

// reconcileRegistered reconciles a node that (re)registered, in the
// loops' context, when this replica holds their lease.
func (s *Service) reconcileRegistered(nodeID string) {
	s.lead.goLoop(func(ctx context.Context) {
		for attempt := 1; ; attempt++ {
			err := s.reconcileNode(ctx, nodeID)
			if err == nil || ctx.Err() != nil {
				return
			}
			if attempt == 5 {
				s.log.Warn("reconcile node failed; it runs again at the node's next registration", "node_id", nodeID, "err", err)
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Duration(attempt) * time.Second):
			}
		}
	})
}

// Heartbeat records a node's report. It returns false when the node is not
// registered (the cubelet then registers again).
func (s *Service) Heartbeat(ctx context.Context, r *masterpb.NodeReport) (bool, error) {
	if err := validateReport(r); err != nil {
		return false, err
	}
	s.reg.mu.Lock()
	_, known := s.reg.nodes[r.NodeId]
	s.reg.mu.Unlock()
	if !known {
		return false, nil
	}
	if err := s.secondRegistrant(r); err != nil {
		return false, err
	}
	return true, s.putNode(ctx, r, time.Now(), false)
}

// secondRegistrant refuses a report for a live node (one heard from
// within nodes.unhealthy_after) that comes from another cubelet than the
// one registered: another machine (boot ID) or another API address. The
// registered node's record, address and sandboxes stay as they are. A
// cubelet that restarts on the same machine and address registers again
// at once; one that moved (a reboot, a new address) is accepted once the
// old registration has been silent for nodes.unhealthy_after.
func (s *Service) secondRegistrant(r *masterpb.NodeReport) error {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	ns := s.reg.nodes[r.NodeId]
	if ns == nil || ns.report == nil {
		return nil
	}
	age := time.Since(ns.lastSeen)
	if age > s.cfg.Nodes.UnhealthyAfter.Duration || ns.report.BootId == r.BootId && ns.report.Address == r.Address {
		return nil
	}
	return fmt.Errorf("node %s is live (last report %s ago, from %s on boot %s); a report from %s on boot %s is refused until it has been silent for nodes.unhealthy_after (%s): %w",
		r.NodeId, age.Round(time.Millisecond), ns.report.Address, ns.report.BootId, r.Address, r.BootId, s.cfg.Nodes.UnhealthyAfter, errdefs.ErrAlreadyExists)
}

func (s *Service) putNode(ctx context.Context, r *masterpb.NodeReport, now time.Time, registered bool) error {
	// Egress verdicts are sent once, for the events: not part of the
	// node's stored report.
	verdicts, suppressed := r.EgressVerdicts, r.EgressSuppressed
	r.EgressVerdicts, r.EgressSuppressed = nil, nil
	s.reg.mu.Lock()
	if ns := s.reg.nodes[r.NodeId]; ns != nil && !registered {
		r = ns.newerTemplates(r)
	}
	s.reg.mu.Unlock()
	raw, err := protojson.Marshal(r)
	if err != nil {
		return err
	}
	// The template rows are rewritten only when the set changed: most
	// heartbeats just move last_heartbeat.
	templates := reportTemplates(r)
	s.reg.mu.Lock()
	if ns := s.reg.nodes[r.NodeId]; ns != nil && !registered && sameTemplates(ns.report.Templates, r.Templates) {
		templates = nil
	}
	s.reg.mu.Unlock()
	if err := s.cat.PutNode(ctx, &catalog.Node{ID: r.NodeId, Address: r.Address, Report: raw, RegisteredAt: now, LastHeartbeat: now},
		templates, registered); err != nil {
		return fmt.Errorf("record node %s: %w", r.NodeId, err)
	}
	// A node new to this process keeps the cordon the catalog remembers.
	schedulable := true
	s.reg.mu.Lock()
	_, known := s.reg.nodes[r.NodeId]
	s.reg.mu.Unlock()
	if !known {
		if cn, err := s.cat.GetNode(ctx, r.NodeId); err == nil {
			schedulable = cn.Schedulable
		}
	}
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	ns := s.reg.nodes[r.NodeId]
	if ns == nil {
		ns = &nodeState{schedulable: schedulable, registered: now, pending: map[string]reservation{}}
	}
	if err := ns.setAddress(r.NodeId, r.Address, s.reg.tls); err != nil {
		return err
	}
	if registered {
		ns.registered = now
		// A node registers once it listens: a connection that failed
		// while it was down (a restart) retries now instead of sitting
		// out its backoff, so routes and creates reach it at once.
		ns.conn.ResetConnectBackoff()
	}
	if !registered {
		// Again, under the lock that assigns it: a listing after an
		// import or delete may have landed while the row was written,
		// and its answer to the caller already promised its set.
		r = ns.newerTemplates(r)
	}
	ns.report, ns.lastSeen = r, now
	// Drop the placements the report already counts.
	gen := r.GetGeneratedAt().AsTime()
	for id, p := range ns.pending {
		if !p.created.IsZero() && (r.GeneratedAt == nil || !gen.Before(p.created)) {
			delete(ns.pending, id)
		}
	}
	s.reg.nodes[r.NodeId] = ns
	s.noteHealth(r.NodeId, ns, now)
	if r.Busy != ns.busy {
		ns.busy = r.Busy
		if r.Busy {
			s.log.Info("node busy: placed on only when no other node can", "node_id", r.NodeId, "reason", r.BusyReason)
		} else {
			s.log.Info("node no longer busy", "node_id", r.NodeId)
		}
	}
	if len(r.Dead) > 0 {
		s.noteDead(r.NodeId, r.Dead)
	}
	if len(verdicts) > 0 || len(suppressed) > 0 {
		s.noteEgress(r.NodeId, verdicts, suppressed)
	}
	return nil
}

// refreshNodes keeps the registry of a replica on a shared catalog in
// step with the catalog's node rows: a node heartbeats to one replica
// (any of them), which writes its report and last heartbeat to the
// catalog, and every other replica reads them from there, so each sees
// every node's health, capacity, templates and cordon within
// refreshInterval. A node whose registration is newer than this replica
// knew is reconciled by the lease's holder.
func (s *Service) refreshNodes(ctx context.Context) {
	tick := time.NewTicker(s.refreshInterval())
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		nodes, err := s.cat.ListNodes(ctx)
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("nodes: read the catalog", "err", err)
			}
			continue
		}
		for _, id := range s.followNodeRows(nodes, time.Now()) {
			s.reconcileRegistered(id)
		}
	}
}

// followNodeRows brings the registry up to the catalog's node rows (other
// replicas record the heartbeats of the nodes registered with them). It
// returns the nodes that registered since the last look.
func (s *Service) followNodeRows(nodes []*catalog.Node, now time.Time) (registered []string) {
	s.reg.mu.Lock()
	for _, n := range nodes {
		ns := s.reg.nodes[n.ID]
		if ns != nil {
			ns.schedulable = n.Schedulable
		}
		if ns != nil && !n.LastHeartbeat.After(ns.lastSeen) {
			continue
		}
		var rep masterpb.NodeReport
		if err := protojson.Unmarshal(n.Report, &rep); err != nil {
			continue
		}
		if ns == nil {
			ns = &nodeState{registered: n.RegisteredAt, schedulable: n.Schedulable, pending: map[string]reservation{}}
		}
		if err := ns.setAddress(n.ID, n.Address, s.reg.tls); err != nil {
			s.log.Warn("node address unusable", "node_id", n.ID, "err", err)
			continue
		}
		if n.RegisteredAt.After(ns.registered) || s.reg.nodes[n.ID] == nil {
			registered = append(registered, n.ID)
			ns.registered = n.RegisteredAt
		}
		// Another replica may have recorded a heartbeat generated
		// before this one's own listing after an import or delete.
		ns.report, ns.lastSeen = ns.newerTemplates(&rep), n.LastHeartbeat
		gen := rep.GetGeneratedAt().AsTime()
		for id, p := range ns.pending {
			if !p.created.IsZero() && (rep.GeneratedAt == nil || !gen.Before(p.created)) {
				delete(ns.pending, id)
			}
		}
		s.reg.nodes[n.ID] = ns
		s.noteHealth(n.ID, ns, now)
	}
	s.reg.mu.Unlock()
	return registered
}

// refreshInterval is how often a replica re-reads the node rows: a
// fraction of the heartbeat interval, so the replicas' views lag one
// another by less than a heartbeat.
func (s *Service) refreshInterval() time.Duration {
	return max(s.cfg.Nodes.HeartbeatInterval.Duration/2, 100*time.Millisecond)
}

// healthOf returns "" for a healthy node, else why not. Caller holds mu.
func (s *Service) healthOf(ns *nodeState, now time.Time) string {
	if age := now.Sub(ns.lastSeen); age > s.cfg.Nodes.UnhealthyAfter.Duration {
		return fmt.Sprintf("no heartbeat for %s", age.Round(time.Second))
	}
	if ns.report != nil && !ns.report.Ok {
		var bad []string
		for _, c := range ns.report.Conditions {
			if !c.Ok {
				bad = append(bad, c.Type+": "+c.Message)
			}
		}
		return "conditions failing: " + strings.Join(bad, "; ")
	}
	return ""
}

// noteHealth logs a node's health transitions. Caller holds mu.
func (s *Service) noteHealth(id string, ns *nodeState, now time.Time) {
	reason := s.healthOf(ns, now)
	if healthy := reason == ""; healthy != ns.healthy {
		ns.healthy = healthy
		if healthy {
			s.log.Info("node healthy", "node_id", id)
		} else {
			s.log.Warn("node unhealthy: no new sandboxes go there", "node_id", id, "reason", reason)
		}
	}
}

// watchHealth notices nodes that go silent (nothing else would: a silent
// node sends nothing).
func (s *Service) watchHealth(ctx context.Context) {
	tick := time.NewTicker(max(s.cfg.Nodes.UnhealthyAfter.Duration/4, 50*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			s.reg.mu.Lock()
			for id, ns := range s.reg.nodes {
				s.noteHealth(id, ns, now)
			}
			s.reg.mu.Unlock()
		}
	}
}

// client returns the gRPC client of a node.
func (s *Service) client(nodeID string) (cubeletpb.CubeletServiceClient, error) {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	ns := s.reg.nodes[nodeID]
	if ns == nil || ns.client == nil {
		return nil, fmt.Errorf("node %q is not registered: %w", nodeID, errdefs.ErrUnavailable)
	}
	return ns.client, nil
}

// connDown reports whether a node's connection is in TRANSIENT_FAILURE:
// a call made now fails before anything is sent (its cubelet is down or
// restarting).
func (s *Service) connDown(nodeID string) bool {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	ns := s.reg.nodes[nodeID]
	return ns != nil && ns.conn != nil && ns.conn.GetState() == connectivity.TransientFailure
}

// awaitNode waits, up to nodes.restart_wait, for a healthy node's
// connection to be ready when it is not (its cubelet restarting), so that a verb on a
// sandbox there is made once the node is back rather than failing at
// once. It returns at once when the connection is ready, and without
// error when the wait runs out: the call then fails as it would have.
func (s *Service) awaitNode(ctx context.Context, nodeID string) {
	s.reg.mu.Lock()
	ns := s.reg.nodes[nodeID]
	var conn *grpc.ClientConn
	// A node silent past nodes.unhealthy_after is not restarting: no wait.
	if ns != nil && s.healthOf(ns, time.Now()) == "" {
		conn = ns.conn
	}
	s.reg.mu.Unlock()
	if conn == nil || conn.GetState() == connectivity.Ready || s.cfg.Nodes.RestartWait.Duration <= 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Nodes.RestartWait.Duration)
	defer cancel()
	conn.Connect()
	for st := conn.GetState(); st != connectivity.Ready && st != connectivity.Shutdown; st = conn.GetState() {
		if !conn.WaitForStateChange(ctx, st) {
			return
		}
	}
}

// nodeHealthy reports whether a node is registered and healthy.
func (s *Service) nodeHealthy(nodeID string) bool {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	ns := s.reg.nodes[nodeID]
	return ns != nil && s.healthOf(ns, time.Now()) == ""
}

// schedNodes is the scheduler's view of every node, pending placements
// included.
func (s *Service) schedNodes() []*scheduler.Node {
	now := time.Now()
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	out := make([]*scheduler.Node, 0, len(s.reg.nodes))
	for id, ns := range s.reg.nodes {
		r := ns.report
		n := &scheduler.Node{
			ID: id, Healthy: s.healthOf(ns, now) == "", Busy: r.Busy, Schedulable: ns.schedulable,
			Templates: map[string]bool{}, TemplateRuntimes: map[string]string{}, TemplateSandboxes: map[string]int{}, TemplatePool: map[string]int{},
			MilliCPU: int64(r.Cpus) * 1000, MemoryMiB: r.MemoryBytes >> 20,
			AllocMilliCPU: r.AllocatedMilliCpu, AllocMemoryMiB: r.AllocatedMemoryMib,
			MaxMilliCPU: r.MaxMilliCpu, MaxMemoryMiB: r.MaxMemoryMib,
			DefaultRuntime: r.DefaultRuntime, MemoryOverheadMiB: r.MemoryOverheadMib,
		}
		for _, rt := range r.Runtimes {
			n.Runtimes = append(n.Runtimes, rt.Name)
		}
		for _, t := range r.Templates {
			n.Templates[t.Id] = true
			n.TemplateRuntimes[t.Id] = t.Runtime
			n.TemplatePool[t.Id] = int(t.Pool)
		}
		for st, c := range r.SandboxesByState {
			if st != "destroyed" && st != "failed" {
				n.Sandboxes += int(c)
			}
		}
		for t, c := range r.SandboxesByTemplate {
			n.TemplateSandboxes[t] = int(c)
		}
		for _, p := range ns.pending {
			n.AllocMilliCPU += p.cpu
			n.AllocMemoryMiB += p.mem
			n.Sandboxes++
			n.TemplateSandboxes[p.template]++
		}
		out = append(out, n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// reserve counts a placement against a node until a report counts it;
// the returned func is called with the create's outcome: the sandbox's
// CreatedAt on the node (a report generated at or after it counts the
// sandbox: the node stamps both under one lock), or zero when the create
// failed.
func (s *Service) reserve(nodeID, sandboxID, template, runtime string, cpu, mem int64) func(created time.Time) {
	s.reg.mu.Lock()
	if ns := s.reg.nodes[nodeID]; ns != nil {
		// Counted as the node's report will count it: with the memory
		// its runtime holds beyond the limit.
		if r := ns.report; r != nil {
			n := scheduler.Node{TemplateRuntimes: map[string]string{}, DefaultRuntime: r.DefaultRuntime, MemoryOverheadMiB: r.MemoryOverheadMib}
			for _, t := range r.Templates {
				n.TemplateRuntimes[t.Id] = t.Runtime
			}
			mem = n.MemoryFor(scheduler.Request{TemplateID: template, Runtime: runtime, MemoryMiB: mem})
		}
		ns.pending[sandboxID] = reservation{cpu: cpu, mem: mem, template: template}
	}
	s.reg.mu.Unlock()
	return func(created time.Time) {
		s.reg.mu.Lock()
		defer s.reg.mu.Unlock()
		ns := s.reg.nodes[nodeID]
		if ns == nil {
			return
		}
		if created.IsZero() {
			delete(ns.pending, sandboxID)
			return
		}
		// The last report may already count the sandbox (taken while the
		// create ran): then the reservation would count it twice.
		if gen := ns.report.GetGeneratedAt(); gen != nil && !gen.AsTime().Before(created) {
			delete(ns.pending, sandboxID)
			return
		}
		p := ns.pending[sandboxID]
		p.created = created
		ns.pending[sandboxID] = p
	}
}

// NodeView is a node as the admin API shows it.
type NodeView struct {
	Report        *masterpb.NodeReport
	Healthy       bool
	Reason        string
	Schedulable   bool
	RegisteredAt  time.Time
	LastHeartbeat time.Time
	Sandboxes     int
}

// Nodes lists every registered node.
func (s *Service) Nodes(ctx context.Context) ([]NodeView, error) {
	counts, err := s.cat.CountByNode(ctx)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	out := make([]NodeView, 0, len(s.reg.nodes))
	for id, ns := range s.reg.nodes {
		reason := s.healthOf(ns, now)
		out = append(out, NodeView{
			Report: ns.report, Healthy: reason == "", Reason: reason, Schedulable: ns.schedulable,
			RegisteredAt: ns.registered, LastHeartbeat: ns.lastSeen, Sandboxes: counts[id],
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Report.NodeId < out[j].Report.NodeId })
	return out, nil
}

// SetSchedulable cordons or uncordons a node.
func (s *Service) SetSchedulable(ctx context.Context, nodeID string, on bool) (NodeView, error) {
	if err := s.cat.SetSchedulable(ctx, nodeID, on); err != nil {
		return NodeView{}, err
	}
	s.reg.mu.Lock()
	if ns := s.reg.nodes[nodeID]; ns != nil {
		ns.schedulable = on
	}
	s.reg.mu.Unlock()
	s.log.Info("node schedulable changed", "node_id", nodeID, "schedulable", on)
	views, err := s.Nodes(ctx)
	if err != nil {
		return NodeView{}, err
	}
	for _, v := range views {
		if v.Report.NodeId == nodeID {
			return v, nil
		}
	}
	return NodeView{}, fmt.Errorf("node %q: %w", nodeID, errdefs.ErrNotFound)
}

// isLocal reports whether a node runs on this machine in this PID
// namespace, so its sandboxes' /proc/<pid>/ns/net are ours to enter.
func (s *Service) isLocal(nodeID string) bool {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	ns := s.reg.nodes[nodeID]
	return ns != nil && ns.report.BootId != "" && ns.report.BootId == s.self.bootID && ns.report.PidNamespace == s.self.pidNS
}

// dataAddress is the node data listener a node reported, "" when it
// serves none (its sandboxes are then reachable only on its machine).
func (s *Service) dataAddress(nodeID string) string {
	s.reg.mu.Lock()
	defer s.reg.mu.Unlock()
	if ns := s.reg.nodes[nodeID]; ns != nil && ns.report != nil {
		return ns.report.DataAddress
	}
	return ""
}

// nodeRow is a node's catalog row from its live state.
func nodeRow(r *masterpb.NodeReport, ns *nodeState) *catalog.Node {
	raw, _ := protojson.Marshal(r)
	return &catalog.Node{ID: r.NodeId, Address: r.Address, Report: raw, RegisteredAt: ns.registered, LastHeartbeat: ns.lastSeen}
}

func sameTemplates(a, b []*masterpb.TemplateRef) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Id != b[i].Id || a[i].Digest != b[i].Digest {
			return false
		}
	}
	return true
}
