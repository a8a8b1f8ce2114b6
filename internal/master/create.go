package master

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// CreateRequest asks for a new sandbox.
type CreateRequest struct {
	// Template is a template ID, an alias (templates.aliases), or the ID
	// or name of a snapshot.
	Template string
	// Timeout is the time to live; 0 = sandbox.default_timeout.
	Timeout    time.Duration
	Metadata   map[string]string
	Env        map[string]string
	AutoPause  bool
	AutoResume bool
	// IdleTimeout pauses the sandbox after this long without traffic
	// (cube's extension); 0: no idle policy.
	IdleTimeout time.Duration
	// Runtime is the driver to run on (cube's extension); "": the
	// template's runtime, else the node default. See runtime.go.
	Runtime string
	// Secure issues an envd access token the SDK must send.
	Secure   bool
	Network  catalog.Network
	APIKeyID string
}

// Limits on what clients store in the catalog.
const (
	maxMetadata      = 64
	maxMetadataKey   = 128
	maxMetadataValue = 512
	maxEnv           = 256
	maxEnvValue      = 128 << 10
	maxNetworkRules  = 256
)

func validText(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return false
		}
	}
	return true
}

// ValidateMetadata checks sandbox metadata (also used for list filters).
func ValidateMetadata(md map[string]string) error {
	if len(md) > maxMetadata {
		return errdefs.FieldErrorf("metadata", "%d entries, at most %d", len(md), maxMetadata)
	}
	for k, v := range md {
		if k == "" || len(k) > maxMetadataKey || !validText(k) {
			return errdefs.FieldErrorf("metadata", "key %q: 1-%d printable characters", k, maxMetadataKey)
		}
		if len(v) > maxMetadataValue || !validText(v) {
			return errdefs.FieldErrorf("metadata", "value of %q: at most %d printable characters", k, maxMetadataValue)
		}
	}
	return nil
}

func validateEnv(env map[string]string) error {
	if len(env) > maxEnv {
		return errdefs.FieldErrorf("envVars", "%d entries, at most %d", len(env), maxEnv)
	}
	for k, v := range env {
		if !sandbox.EnvKeyRE.MatchString(k) {
			return errdefs.FieldErrorf("envVars", "invalid name %q", k)
		}
		if len(v) > maxEnvValue || strings.ContainsRune(v, 0) {
			return errdefs.FieldErrorf("envVars", "value of %q: at most %d bytes, no NUL", k, maxEnvValue)
		}
	}
	return nil
}

// ValidateNetwork checks egress rules: CIDRs or IP addresses. Domain names
// need the egress proxy, which does not exist yet.
func ValidateNetwork(n catalog.Network) error {
	for field, list := range map[string][]string{"network.allowOut": n.AllowOut, "network.denyOut": n.DenyOut} {
		if len(list) > maxNetworkRules {
			return errdefs.FieldErrorf(field, "%d entries, at most %d", len(list), maxNetworkRules)
		}
		for _, e := range list {
			if _, err := netip.ParsePrefix(e); err == nil {
				continue
			}
			if _, err := netip.ParseAddr(e); err == nil {
				continue
			}
			if strings.ContainsAny(e, "abcdefghijklmnopqrstuvwxyz*") {
				return errdefs.FieldErrorf(field, "%q: domain names are not supported yet, only CIDRs and IP addresses", e)
			}
			return errdefs.FieldErrorf(field, "%q is not a CIDR or an IP address", e)
		}
	}
	return nil
}

func (s *Service) validateTimeout(field string, d time.Duration) error {
	if d < 0 {
		return errdefs.FieldErrorf(field, "must not be negative")
	}
	if d > s.cfg.Sandbox.MaxTimeout.Duration {
		return errdefs.FieldErrorf(field, "%s exceeds the maximum %s", d, s.cfg.Sandbox.MaxTimeout.Duration)
	}
	return nil
}

func token() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// resolveTemplate turns the name a client used into a template ID present
// on some node, or a snapshot. Neither found: NotFound (a malformed name:
// InvalidArgument).
func (s *Service) resolveTemplate(ctx context.Context, name string) (tmpl string, snap *catalog.Snapshot, err error) {
	if name == "" {
		return "", nil, errdefs.FieldErrorf("templateID", "required")
	}
	if !templateNameRE.MatchString(name) {
		if _, alias := s.cfg.Templates.Aliases[name]; !alias {
			return "", nil, errdefs.FieldErrorf("templateID", "%q is not a valid template or snapshot name", name)
		}
	}
	for attempt := 0; ; attempt++ {
		present := map[string]bool{}
		for _, n := range s.schedNodes() {
			for t := range n.Templates {
				present[t] = true
			}
		}
		if present[name] {
			return name, nil, nil
		}
		if id, ok := s.cfg.Templates.Aliases[name]; ok && present[id] {
			return id, nil, nil
		}
		if snap, err := s.cat.GetTeamSnapshot(ctx, TeamOf(ctx), name); err == nil {
			return snap.TemplateID, snap, nil
		} else if !errdefs.IsNotFound(err) {
			return "", nil, err
		}
		// A template imported on a node since its last heartbeat: ask the
		// nodes once before saying no.
		if attempt > 0 || !s.refreshAllTemplates(ctx) {
			return "", nil, fmt.Errorf("template %q not found: %w", name, errdefs.ErrNotFound)
		}
	}
}

// templateNameRE admits template IDs, snapshot IDs and snapshot names
// (which may carry a namespace and a tag, as E2B's do).
var templateNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$`)

// refreshAllTemplates re-reads every healthy node's templates, at most
// once a second (misses from clients must not turn into a storm of node
// calls). It reports whether it refreshed.
func (s *Service) refreshAllTemplates(ctx context.Context) bool {
	s.refreshMu.Lock()
	if time.Since(s.lastRefresh) < time.Second {
		s.refreshMu.Unlock()
		return false
	}
	s.lastRefresh = time.Now()
	s.refreshMu.Unlock()
	for _, n := range s.schedNodes() {
		if n.Healthy {
			s.refreshTemplates(ctx, n.ID)
		}
	}
	return true
}

// Create places a new sandbox on a node and returns it running.
//
// The catalog row is written (state creating) before any node is asked,
// and records the node before the node is asked, so a master that dies
// mid-create leaves a row that reconcile resolves. A node that refuses
// (full, over its create limit, unreachable) is skipped for the next; a
// node whose answer was lost is told to delete what it may have made
// before the next is tried, so one ID never runs twice.
func (s *Service) Create(ctx context.Context, req CreateRequest) (*catalog.Sandbox, error) {
	if req.Timeout == 0 {
		req.Timeout = s.cfg.Sandbox.DefaultTimeout.Duration
	}
	if err := s.validateTimeout("timeout", req.Timeout); err != nil {
		return nil, err
	}
	if req.IdleTimeout < 0 {
		return nil, errdefs.FieldErrorf("idleTimeout", "must not be negative")
	}
	if req.IdleTimeout > 0 {
		if err := s.validateTimeout("idleTimeout", req.IdleTimeout); err != nil {
			return nil, err
		}
	}
	if err := ValidateMetadata(req.Metadata); err != nil {
		return nil, err
	}
	if err := validateEnv(req.Env); err != nil {
		return nil, err
	}
	if err := ValidateNetwork(req.Network); err != nil {
		return nil, err
	}
	if err := s.validateRuntime(req.Runtime); err != nil {
		return nil, err
	}
	tmpl, snap, err := s.resolveTemplate(ctx, req.Template)
	if err != nil {
		return nil, err
	}
	// The scheduler places only on nodes that hold the template; the
	// others pull it from the store meanwhile, for later creates.
	s.pullMissing(tmpl)
	if snap != nil && req.Runtime != "" && snap.Runtime != "" && snap.Runtime != req.Runtime {
		return nil, errdefs.FieldErrorf("runtime", "snapshot %s was taken on runtime %q; sandboxes from it run there, not on %q", snap.ID, snap.Runtime, req.Runtime)
	}
	now := time.Now().UTC()
	sb := &catalog.Sandbox{
		ID: sandboxid.New(), TemplateID: tmpl, State: catalog.StateCreating,
		MilliCPU: s.cfg.Sandbox.MilliCPU, MemoryMiB: s.cfg.Sandbox.MemoryMiB, DiskMiB: s.templateSizeMiB(tmpl),
		StartedAt: now, EndAt: now.Add(req.Timeout),
		AutoPause: req.AutoPause, AutoResume: req.AutoResume, IdleTimeout: req.IdleTimeout,
		Network: req.Network, APIKeyID: req.APIKeyID, Metadata: req.Metadata, Runtime: req.Runtime,
		Team: TeamOf(ctx), // the catalog checks the team's quota as it writes the row
	}
	if req.Template != tmpl || snap != nil {
		sb.Alias = req.Template
	}
	if req.Secure {
		sb.EnvdAccessToken = token()
	}
	if p := req.Network.AllowPublicTraffic; p != nil && !*p {
		sb.TrafficAccessToken = token()
	}
	if snap != nil {
		return s.createFromSnapshot(ctx, sb, snap, req.Env)
	}
	if err := s.cat.CreateSandbox(ctx, sb); err != nil {
		return nil, err
	}
	s.creating.Store(sb.ID, true)
	defer s.creating.Delete(sb.ID)
	// The create runs to its end even if the client goes away: a half-made
	// sandbox is worse than an unwanted one, which its deadline collects.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.Sandbox.CreateTimeout.Duration)
	defer cancel()
	if err := fpCreateRow.Eval(cctx); err != nil {
		s.forgetFailed(sb.ID)
		return nil, err
	}
	start := time.Now()
	var created *cubeletpb.Sandbox
	nodes := s.schedNodes()
	sreq := scheduler.Request{TemplateID: tmpl, Runtime: req.Runtime, MilliCPU: sb.MilliCPU, MemoryMiB: sb.MemoryMiB}
	if s.log.Enabled(ctx, slog.LevelDebug) {
		cands, rejs := s.sched.Rank(nodes, sreq)
		var order []string
		for _, c := range cands {
			order = append(order, fmt.Sprintf("%s=%.3f(load %.2f, locality %.0f, spread %.2f)", c.Node.ID, c.Score, c.Load, c.Locality, c.Spread))
		}
		s.log.Debug("placement", "sandbox_id", sb.ID, "candidates", order, "rejected", rejs)
	}
	node, err := s.sched.Place(cctx, nodes, sreq,
		func(ctx context.Context, n *scheduler.Node) error {
			var err error
			created, err = s.createOn(ctx, n.ID, sb, req.Env)
			return err
		})
	if err != nil {
		s.forgetFailed(sb.ID)
		err = runtimePlacementErr(err, tmpl, req.Runtime)
		var nn *scheduler.NoNodeError
		if errors.As(err, &nn) && errdefs.IsNotFound(err) {
			return nil, fmt.Errorf("template %q not found on any node: %w", req.Template, errdefs.ErrNotFound)
		}
		return nil, err
	}
	sb.NodeID = node.ID
	if sb.Runtime == "" {
		sb.Runtime = created.GetRuntime()
	}
	err = fpCreatePlaced.Eval(cctx)
	if err == nil {
		err = s.initAgent(cctx, sb, created, req.Env)
	}
	if err == nil {
		err = fpCreateReady.Eval(cctx)
	}
	if err != nil {
		s.log.Error("agent init failed; destroying the new sandbox", "sandbox_id", sb.ID, "node_id", node.ID, "err", err)
		s.destroyOn(node.ID, sb.ID)
		s.forgetFailed(sb.ID)
		return nil, err
	}
	up, err := s.cat.UpdateSandbox(cctx, sb.ID, func(r *catalog.Sandbox) error {
		r.State, r.NodeID, r.EnvdVersion, r.Runtime = catalog.StateRunning, node.ID, sb.EnvdVersion, sb.Runtime
		// The deadline counts from when the sandbox is ready.
		r.EndAt = time.Now().UTC().Add(req.Timeout)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := fpCreateDone.Eval(cctx); err != nil {
		return nil, err
	}
	s.event(sb.ID, "info", "sandbox created", map[string]string{"node": node.ID, "template": tmpl, "duration": time.Since(start).String()})
	s.log.Info("sandbox created", "sandbox_id", sb.ID, "node_id", node.ID, "template", tmpl, "duration", time.Since(start))
	return up, nil
}

// createOn asks one node to create the sandbox.
func (s *Service) createOn(ctx context.Context, nodeID string, sb *catalog.Sandbox, env map[string]string) (*cubeletpb.Sandbox, error) {
	c, err := s.client(nodeID)
	if err != nil {
		return nil, err
	}
	if _, err := s.cat.UpdateSandbox(ctx, sb.ID, func(r *catalog.Sandbox) error { r.NodeID = nodeID; return nil }); err != nil {
		return nil, err
	}
	if err := fpCreateAssigned.Eval(ctx); err != nil {
		return nil, err
	}
	done := s.reserve(nodeID, sb.ID, sb.TemplateID, sb.MilliCPU, sb.MemoryMiB)
	resp, err := c.CreateSandbox(ctx, &cubeletpb.CreateSandboxRequest{
		RequestId: sb.ID, SandboxId: sb.ID, TemplateId: sb.TemplateID,
		Labels:    managedLabels(sb),
		Env:       env,
		Resources: &cubeletpb.Resources{MilliCpu: sb.MilliCPU, MemoryMib: sb.MemoryMiB},
		Network:   networkPolicy(sb.Network),
		Runtime:   sb.Runtime,
		// The agent requires it from its first request: there is no
		// moment between create and /init when it answers without.
		AccessToken: sb.EnvdAccessToken,
	})
	err = fromGRPC(nodeID, err)
	var created time.Time
	if err == nil {
		// The node stamps CreatedAt and a report's generated_at under
		// the same lock: a report generated at or after it counts the
		// sandbox, one generated before does not (so the reservation
		// neither lapses uncounted nor counts twice).
		created = resp.Sandbox.GetCreatedAt().AsTime()
		if resp.GetWarm() || len(resp.GetWarnings()) > 0 {
			s.log.Info("node created the sandbox", "sandbox_id", sb.ID, "node_id", nodeID, "warm", resp.GetWarm(), "warnings", resp.GetWarnings())
		}
		for _, w := range resp.GetWarnings() {
			s.event(sb.ID, "warn", w, map[string]string{"node": nodeID})
		}
	}
	done(created)
	if err != nil {
		s.log.Warn("node refused create", "sandbox_id", sb.ID, "node_id", nodeID, "err", err)
		if maybeCreated(err) {
			s.destroyOn(nodeID, sb.ID)
		}
		return nil, err
	}
	return resp.Sandbox, nil
}

// destroyOn deletes a sandbox from a node, best effort: used to undo.
// What it cannot delete, the node's next reconcile does (the sandbox
// carries the managed label and has no catalog row).
//
// It fails fast when the node cannot be reached, except from reconcile,
// which passes grpc.WaitForReady: the node just registered and its
// connection may still be coming up.
func (s *Service) destroyOn(nodeID, id string, opts ...grpc.CallOption) {
	c, err := s.client(nodeID)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{RequestId: id, SandboxId: id}, opts...); err != nil {
		if err := fromGRPC(nodeID, err); !errdefs.IsNotFound(err) {
			s.log.Warn("undo create: delete on node failed; its reconcile will", "sandbox_id", id, "node_id", nodeID, "err", err)
		}
	}
}

// forgetFailed removes the row of a create that did not happen.
func (s *Service) forgetFailed(id string) {
	if err := s.cat.DeleteSandbox(context.Background(), id); err != nil && !errdefs.IsNotFound(err) {
		s.log.Error("remove row of failed create", "sandbox_id", id, "err", err)
	}
}

// networkPolicy is the node's form of the egress rules; nil when the
// sandbox keeps the node default (nodes refuse policies they cannot
// apply, e.g. without a network-agent, so none is sent unless asked for).
func networkPolicy(n catalog.Network) *cubeletpb.NetworkPolicy {
	if n.AllowInternet == nil && len(n.AllowOut) == 0 && len(n.DenyOut) == 0 {
		return nil
	}
	return &cubeletpb.NetworkPolicy{AllowInternetAccess: n.AllowInternet, AllowOut: n.AllowOut, DenyOut: n.DenyOut}
}
