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
	"sync"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
	"github.com/cubesandbox/cube/internal/network/policy"
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
	// Volumes are the team's volumes mounted into the sandbox (volumes.go).
	Volumes []VolumeMount
	// DiskMiB grows the sandbox's disk to this size when larger than the
	// template's (template builds: room for the packages a step installs).
	DiskMiB int64
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

// ValidateNetwork checks egress rules: CIDRs or IP addresses, and in
// allowOut domain names ("api.github.com", "*.pypi.org"), as E2B accepts
// them; the node validates the whole policy again (package policy).
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
			if _, isDomain, err := policy.ParseDomain(e); isDomain {
				switch {
				case err != nil:
					return errdefs.FieldErrorf(field, "%v", err)
				case field == "network.denyOut":
					return errdefs.FieldErrorf(field, "%q: domain names are accepted in allowOut only (as in E2B); deny the rest with denyOut [\"0.0.0.0/0\"] or allowInternetAccess=false", e)
				}
				continue
			}
			return errdefs.FieldErrorf(field, "%q is not a CIDR or an IP address", e)
		}
	}
	// Credential rules: the node's parser is the one definition. A rule
	// naming a secret is checked with a stand-in value (the secret's own
	// was checked when it was stored; that it exists, by checkSecrets).
	if len(n.Credentials) > 0 {
		spec := policy.Spec{}
		for i, c := range n.Credentials {
			v := c.Value
			if c.SecretName != "" {
				field := fmt.Sprintf("network.credentials[%d]", i)
				if c.Value != "" {
					return errdefs.FieldErrorf(field, "value and secretName: give one")
				}
				if !secretNameRE.MatchString(c.SecretName) {
					return errdefs.FieldErrorf(field+".secretName", "%q is not a secret name", c.SecretName)
				}
				v = "secret"
			}
			spec.Credentials = append(spec.Credentials, policy.Credential{Host: c.Host, Header: c.Header, Value: v})
		}
		if _, err := policy.Parse("network", spec); err != nil {
			return err
		}
	}
	if len(n.Requests) > 0 {
		spec := policy.Spec{}
		for _, r := range n.Requests {
			spec.Requests = append(spec.Requests, policy.RequestRule(r))
		}
		if _, err := policy.Parse("network", spec); err != nil {
			return err
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
		if attempt > 0 {
			return "", nil, fmt.Errorf("template %q not found: %w", name, errdefs.ErrNotFound)
		}
		s.refreshAllTemplates(ctx)
	}
}

// templateNameRE admits template IDs, snapshot IDs and snapshot names
// (which may carry a namespace and a tag, as E2B's do).
var templateNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$`)

// refreshAllTemplates re-reads every healthy node's templates, at most
// once a second (misses from clients must not turn into a storm of node
// calls). Concurrent misses wait for the refresh in progress rather than
// failing before it is done; a miss within a second of the last refresh
// looks again at what it found.
func (s *Service) refreshAllTemplates(ctx context.Context) {
	s.refreshMu.Lock()
	defer s.refreshMu.Unlock()
	if time.Since(s.lastRefresh) < time.Second {
		return
	}
	var wg sync.WaitGroup
	for _, n := range s.schedNodes() {
		if n.Healthy {
			wg.Go(func() { s.refreshTemplates(ctx, n.ID) })
		}
	}
	wg.Wait()
	s.lastRefresh = time.Now()
}

// Create places a new sandbox on a node and returns it running.
//
// The catalog row is written (state creating) before any node is asked,
// and records the node before the node is asked, so a master that dies
// mid-create leaves a row that reconcile resolves. A node that refuses
// (full, over its create limit, unreachable) is skipped for the next;
// when no node can take the sandbox for a reason that passes in seconds
// (a cubelet or network-agent restarting, a node over its create limit)
// the create waits up to nodes.restart_wait and places again
// (placeWaiting). A node whose answer was lost is told, in the
// background, to delete what it may have made, and is not tried again for
// this sandbox until it has; a create that fails keeps its row until
// every such delete is done (forgetAfter), so a create the client saw
// fail leaves no sandbox behind.
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
	if err := s.checkSecrets(ctx, TeamOf(ctx), req.Network); err != nil {
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
	var growMiB int64 // 0: the template's size, nothing to grow
	if req.DiskMiB > sb.DiskMiB && snap == nil {
		sb.DiskMiB, growMiB = req.DiskMiB, req.DiskMiB
	}
	if req.Secure {
		sb.EnvdAccessToken = token()
	}
	if p := req.Network.AllowPublicTraffic; p != nil && !*p {
		sb.TrafficAccessToken = token()
	}
	if snap != nil {
		if len(req.Volumes) > 0 {
			return nil, errdefs.FieldErrorf("volumeMounts", "a sandbox from snapshot %s resumes its disk as it was; volumes are mounted into sandboxes created from a template", snap.ID)
		}
		return s.createFromSnapshot(ctx, sb, snap, req.Env)
	}
	if err := s.cat.CreateSandbox(ctx, sb); err != nil {
		return nil, err
	}
	vols, pin, err := s.claimVolumes(ctx, sb.ID, req.Volumes)
	if err != nil {
		s.forgetFailed(sb.ID)
		return nil, err
	}
	placed := false
	if len(vols) > 0 {
		defer func() {
			if !placed {
				s.releaseVolumes(sb.ID)
			}
		}()
	}
	nodesOf := func() []*scheduler.Node { return pinnedNodes(s.schedNodes(), pin) }
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
	var tr createTrace
	nodes := nodesOf()
	if pin != "" && len(nodes) == 0 {
		s.forgetFailed(sb.ID)
		return nil, fmt.Errorf("its volumes live on node %s, which is not registered now (volumes are node-local): %w", pin, errdefs.ErrUnavailable)
	}
	sreq := scheduler.Request{TemplateID: tmpl, Runtime: req.Runtime, MilliCPU: sb.MilliCPU, MemoryMiB: sb.MemoryMiB}
	if s.log.Enabled(ctx, slog.LevelDebug) {
		cands, rejs := s.sched.Rank(nodes, sreq)
		var order []string
		for _, c := range cands {
			order = append(order, fmt.Sprintf("%s=%.3f(load %.2f, locality %.0f, spread %.2f, pool %.0f)", c.Node.ID, c.Score, c.Load, c.Locality, c.Spread, c.Pool))
		}
		s.log.Debug("placement", "sandbox_id", sb.ID, "candidates", order, "rejected", rejs)
	}
	// undos are the deletes of attempts whose answer was lost, by node:
	// the node is not tried again for this sandbox until its undo is
	// done (so the same ID never runs twice there).
	undos := map[string]<-chan bool{}
	try := func(ctx context.Context, n *scheduler.Node) error {
		if ch, ok := undos[n.ID]; ok {
			select {
			case <-ch:
				delete(undos, n.ID)
			default:
				return fmt.Errorf("node %s: an earlier attempt there is still being undone: %w", n.ID, errdefs.ErrUnavailable)
			}
		}
		var err error
		called := time.Now()
		created, tr.actions, err = s.createOn(ctx, n.ID, sb, req.Env, vols, growMiB)
		tr.placed, tr.node = called.Sub(start), time.Since(called)
		if err != nil && maybeCreated(err) {
			undos[n.ID] = s.undoCreate(n.ID, sb.ID)
		}
		return err
	}
	node, waited, err := s.placeWaiting(ctx, cctx, start, nodesOf, sreq, try)
	if waited > 0 {
		s.log.Info("create waited for a node", "sandbox_id", sb.ID, "waited", waited.Round(time.Millisecond), "placed", err == nil)
	}
	if err != nil {
		s.forgetAfter(ctx, sb.ID, undos)
		err = runtimePlacementErr(err, tmpl, req.Runtime)
		if pin != "" {
			err = fmt.Errorf("its volumes live on node %s (volumes are node-local): %w", pin, err)
		}
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
	err = s.placeVolumes(cctx, vols, node.ID)
	if err == nil {
		err = fpCreatePlaced.Eval(cctx)
	}
	if err == nil {
		initStart := time.Now()
		err = s.initAgent(cctx, sb, created, req.Env)
		tr.agent = time.Since(initStart)
	}
	if err == nil {
		err = fpCreateReady.Eval(cctx)
	}
	if err != nil {
		s.log.Error("agent init failed; destroying the new sandbox", "sandbox_id", sb.ID, "node_id", node.ID, "err", err)
		undos[node.ID] = s.undoCreate(node.ID, sb.ID)
		s.forgetAfter(ctx, sb.ID, undos)
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
	placed = true
	if err := fpCreateDone.Eval(cctx); err != nil {
		return nil, err
	}
	tr.total = time.Since(start)
	// One event (one write on the create's path) carries the trace too.
	fields := tr.fields()
	fields["node"], fields["template"], fields["duration"] = node.ID, tmpl, tr.total.String()
	s.event(sb.ID, "info", "sandbox created", fields)
	s.log.Info("sandbox created", "sandbox_id", sb.ID, "node_id", node.ID, "template", tmpl, "duration", time.Since(start))
	return up, nil
}

// createOn asks one node to create the sandbox; it returns the node's
// record and how long each action of its create flow took.
func (s *Service) createOn(ctx context.Context, nodeID string, sb *catalog.Sandbox, env map[string]string, vols []claimedVolume, growMiB int64) (*cubeletpb.Sandbox, []*cubeletpb.ActionTiming, error) {
	c, err := s.client(nodeID)
	if err != nil {
		return nil, nil, err
	}
	if _, err := s.cat.UpdateSandbox(ctx, sb.ID, func(r *catalog.Sandbox) error { r.NodeID = nodeID; return nil }); err != nil {
		return nil, nil, err
	}
	if err := fpCreateAssigned.Eval(ctx); err != nil {
		return nil, nil, err
	}
	if s.connDown(nodeID) {
		// Nothing would be sent: no undo needed (errNotSent).
		return nil, nil, fmt.Errorf("node %s: not reachable now: %w", nodeID, errNotSent)
	}
	// Nothing is sent when a secret cannot be opened (deleted since the
	// create's check): InvalidArgument, not a node's fault to retry.
	netPolicy, err := s.nodeNetwork(ctx, sb.Team, sb.Network)
	if err != nil {
		return nil, nil, err
	}
	done := s.reserve(nodeID, sb.ID, sb.TemplateID, sb.Runtime, sb.MilliCPU, sb.MemoryMiB)
	resp, err := c.CreateSandbox(ctx, &cubeletpb.CreateSandboxRequest{
		RequestId: sb.ID, SandboxId: sb.ID, TemplateId: sb.TemplateID,
		Labels:    managedLabels(sb),
		Env:       env,
		Resources: &cubeletpb.Resources{MilliCpu: sb.MilliCPU, MemoryMib: sb.MemoryMiB, DiskMib: growMiB},
		Network:   netPolicy,
		Runtime:   sb.Runtime,
		// The agent requires it from its first request: there is no
		// moment between create and /init when it answers without.
		AccessToken: sb.EnvdAccessToken,
		Volumes:     volumesPB(vols),
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
		return nil, nil, err
	}
	return resp.Sandbox, resp.GetTimings(), nil
}

// placeWaiting places the sandbox (try is called on each candidate) and,
// while no node can take it for a reason that passes in seconds
// (scheduler.NoNodeError.Transient: a node unreachable or unhealthy, its
// cubelet or network-agent restarting; a node over its create limit),
// places again with backoff until nodes.restart_wait has passed since
// start. A client that goes away (ctx) ends the wait; cctx bounds the
// whole create. It returns how long it waited.
func (s *Service) placeWaiting(ctx, cctx context.Context, start time.Time, nodesOf func() []*scheduler.Node, sreq scheduler.Request,
	try func(context.Context, *scheduler.Node) error) (*scheduler.Node, time.Duration, error) {
	nodes := nodesOf()
	deadline := start.Add(s.cfg.Nodes.RestartWait.Duration)
	var waitedFrom time.Time
	waited := func() time.Duration {
		if waitedFrom.IsZero() {
			return 0
		}
		return time.Since(waitedFrom)
	}
	refreshed := false
	for backoff := 20 * time.Millisecond; ; backoff = min(2*backoff, 500*time.Millisecond) {
		node, err := s.sched.Place(cctx, nodes, sreq, try)
		var nn *scheduler.NoNodeError
		if err != nil && errors.As(err, &nn) && errdefs.IsNotFound(err) && !refreshed {
			// No node that could take it holds the template by the
			// last heartbeats: one may have imported it since (the
			// template is known on another node, or was imported on
			// this one a moment ago). Ask the nodes once, then place
			// again.
			refreshed = true
			s.refreshAllTemplates(ctx)
			nodes = nodesOf()
			continue
		}
		if err == nil || !errors.As(err, &nn) || !nn.Transient() {
			return node, waited(), err
		}
		pause := min(backoff, time.Until(deadline))
		if pause <= 0 {
			return nil, waited(), err
		}
		if waitedFrom.IsZero() {
			waitedFrom = time.Now()
			s.log.Debug("no node can take the sandbox now; waiting", "err", err, "up_to", time.Until(deadline).Round(time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return nil, waited(), err
		case <-cctx.Done():
			return nil, waited(), err
		case <-time.After(pause):
		}
		nodes = nodesOf()
	}
}

// undoCreate deletes, in the background, what an attempt whose answer was
// lost may have made on a node (a cubelet that died mid-create: its own
// restart undoes an unfinished create, but one that finished and could
// not answer is running). It waits for the node to come back
// (grpc.WaitForReady), retrying for up to undoPatience, and reports on
// the channel whether the node no longer has the sandbox.
func (s *Service) undoCreate(nodeID, id string) <-chan bool {
	done := make(chan bool, 1)
	s.goBackground(func(ctx context.Context) {
		giveUp := time.Now().Add(undoPatience)
		for {
			err := s.deleteOn(ctx, nodeID, id, grpc.WaitForReady(true))
			if err == nil || errdefs.IsNotFound(err) {
				done <- true
				return
			}
			if ctx.Err() != nil || time.Now().After(giveUp) {
				s.log.Warn("undo create: the node did not delete the sandbox; its next reconcile will", "sandbox_id", id, "node_id", nodeID, "err", err)
				done <- false
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	})
	return done
}

// undoPatience bounds how long undoCreate keeps trying a node; after it,
// the sandbox's row (left in state creating) is resolved by the node's
// next reconcile.
const undoPatience = 10 * time.Minute

// forgetAfter removes the row of a create that failed once every undo
// of it has deleted the sandbox from its node. It waits for them up to
// nodes.restart_wait (or until the client goes away), so that a client
// told of the failure finds nothing left; an undo still pending then
// (its node away longer) keeps the row
// in the background (state creating, no create in flight), so a node
// that registers meanwhile destroys the sandbox in its reconcile rather
// than keeping one no client knows of; an undo that gives up leaves the
// row to that reconcile.
func (s *Service) forgetAfter(ctx context.Context, id string, undos map[string]<-chan bool) {
	pending := make([]<-chan bool, 0, len(undos))
	for _, ch := range undos {
		pending = append(pending, ch)
	}
	// wait reports whether every undo deleted its sandbox, and whether
	// it stopped early (stop, or done closed).
	wait := func(stop <-chan time.Time, done <-chan struct{}) (all, early bool) {
		for len(pending) > 0 {
			select {
			case <-stop:
				return false, true
			case <-done:
				return false, true
			case ok := <-pending[0]:
				if !ok {
					return false, false
				}
				pending = pending[1:]
			}
		}
		return true, false
	}
	all, early := wait(time.After(s.cfg.Nodes.RestartWait.Duration), ctx.Done())
	switch {
	case all:
		s.forgetFailed(id)
	case early:
		s.goBackground(func(ctx context.Context) {
			if all, _ := wait(nil, ctx.Done()); all {
				s.forgetFailed(id)
			}
		})
	}
}

// destroyOn deletes a sandbox from a node, best effort: used to undo.
// What it cannot delete, the node's next reconcile does (the sandbox
// carries the managed label and has no catalog row).
//
// It fails fast when the node cannot be reached, except from reconcile,
// which passes grpc.WaitForReady: the node just registered and its
// connection may still be coming up.
func (s *Service) destroyOn(nodeID, id string, opts ...grpc.CallOption) {
	if err := s.deleteOn(context.Background(), nodeID, id, opts...); err != nil && !errdefs.IsNotFound(err) {
		s.log.Warn("undo create: delete on node failed; its reconcile will", "sandbox_id", id, "node_id", nodeID, "err", err)
	}
}

// deleteOn asks a node to delete a sandbox, within a minute.
func (s *Service) deleteOn(ctx context.Context, nodeID, id string, opts ...grpc.CallOption) error {
	c, err := s.client(nodeID)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_, err = c.DeleteSandbox(ctx, &cubeletpb.DeleteSandboxRequest{RequestId: id, SandboxId: id}, opts...)
	return fromGRPC(nodeID, err)
}

// forgetFailed removes the row of a create that did not happen.
func (s *Service) forgetFailed(id string) {
	if err := s.cat.DeleteSandbox(context.Background(), id); err != nil && !errdefs.IsNotFound(err) {
		s.log.Error("remove row of failed create", "sandbox_id", id, "err", err)
	}
}
