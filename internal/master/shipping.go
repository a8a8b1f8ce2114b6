package master

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/scheduler"
)

// Snapshots across nodes. Nodes move snapshot files through the object
// store of their own [store] config (cubelet ExportSnapshot and
// ImportSnapshot); the master decides when. With store.export_snapshots a
// snapshot taken through the master is exported as soon as it is taken,
// so it outlives its node. A create from a snapshot whose node cannot take
// it (unhealthy, cordoned, or refusing the clone for lack of room) imports
// the snapshot on another node with the snapshot's runtime and template,
// clones there, and deletes the imported copy: the clone's disk is its
// own, and the catalog keeps one home for the snapshot, its original node.

// exportSnapshot uploads snap from its node to the store, when configured.
func (s *Service) exportSnapshot(ctx context.Context, snap *catalog.Snapshot) error {
	if !s.cfg.Store.ExportSnapshots {
		return nil
	}
	c, err := s.client(snap.NodeID)
	if err != nil {
		return err
	}
	start := time.Now()
	resp, err := c.ExportSnapshot(ctx, &cubeletpb.ExportSnapshotRequest{SnapshotId: snap.ID})
	if err != nil {
		return fromGRPC(snap.NodeID, err)
	}
	tr := resp.GetTransfer()
	s.log.Info("snapshot exported", "snapshot_id", snap.ID, "node", snap.NodeID, "logical_bytes", tr.GetLogicalBytes(),
		"sent_bytes", tr.GetMovedBytes(), "duration", time.Since(start))
	return nil
}

// snapshotHomeUsable reports whether snap's own node can clone it now.
func (s *Service) snapshotHomeUsable(snap *catalog.Snapshot) bool {
	for _, n := range s.schedNodes() {
		if n.ID == snap.NodeID {
			return n.Healthy && n.Schedulable
		}
	}
	return false
}

// moveTargets ranks the nodes other than from that could take sb (or a
// clone of its snapshot) now, best first, the scheduler's way (healthy,
// schedulable, its template and runtime, room for its size), with why
// every other node cannot.
func (s *Service) moveTargets(from string, sb *catalog.Sandbox) ([]scheduler.Candidate, []scheduler.Rejection) {
	var nodes []*scheduler.Node
	for _, n := range s.schedNodes() {
		if n.ID != from {
			nodes = append(nodes, n)
		}
	}
	return s.sched.Rank(nodes, scheduler.Request{TemplateID: sb.TemplateID, Runtime: sb.Runtime, MilliCPU: sb.MilliCPU, MemoryMiB: sb.MemoryMiB})
}

// noTarget says why no node can take sb, naming each node's reason.
func noTarget(sb *catalog.Sandbox, rejs []scheduler.Rejection) error {
	var why []string
	for _, r := range rejs {
		why = append(why, r.NodeID+": "+r.Reason)
	}
	if len(why) == 0 {
		why = append(why, "no other node is registered")
	}
	return fmt.Errorf("no other node can take sandbox %s (template %s, runtime %q, %d milli-CPU, %d MiB): %s: %w",
		sb.ID, sb.TemplateID, sb.Runtime, sb.MilliCPU, sb.MemoryMiB, strings.Join(why, "; "), errdefs.ErrFailedPrecondition)
}

// importElsewhere imports snap from the store onto a node other than its
// own that can take sb (moveTargets), trying them in the scheduler's
// order; it returns the node, with sb's size reserved on it until the
// returned func is called with the clone's outcome (reserve). The import
// is refused (FAILED_PRECONDITION, naming why) where a memory image
// cannot be restored; such a node is skipped.
func (s *Service) importElsewhere(ctx context.Context, snap *catalog.Snapshot, sb *catalog.Sandbox) (string, func(time.Time), error) {
	want := *sb
	if want.Runtime == "" {
		want.Runtime = snap.Runtime
	}
	want.TemplateID = snap.TemplateID
	cands, rejs := s.moveTargets(snap.NodeID, &want)
	var errs []error
	for _, cand := range cands {
		n := cand.Node
		c, err := s.client(n.ID)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		done := s.reserve(n.ID, sb.ID, want.TemplateID, want.Runtime, sb.MilliCPU, sb.MemoryMiB)
		start := time.Now()
		resp, err := c.ImportSnapshot(ctx, &cubeletpb.ImportSnapshotRequest{SnapshotId: snap.ID})
		if err != nil {
			done(time.Time{})
			err = fromGRPC(n.ID, err)
			if errdefs.IsNotFound(err) {
				return "", nil, fmt.Errorf("snapshot %s was never exported to the object store: %w", snap.ID, err)
			}
			errs = append(errs, fmt.Errorf("node %s: %w", n.ID, err))
			continue
		}
		s.log.Info("snapshot imported on another node", "snapshot_id", snap.ID, "from", snap.NodeID, "to", n.ID,
			"received_bytes", resp.GetTransfer().GetMovedBytes(), "duration", time.Since(start))
		return n.ID, done, nil
	}
	if len(errs) == 0 {
		return "", nil, fmt.Errorf("snapshot %s: %w", snap.ID, noTarget(&want, rejs))
	}
	return "", nil, fmt.Errorf("snapshot %s could not be imported on another node: %w", snap.ID, errors.Join(errs...))
}

// createFromSnapshotElsewhere clones sb from snap on another node.
func (s *Service) createFromSnapshotElsewhere(ctx context.Context, sb *catalog.Sandbox, snap *catalog.Snapshot, env map[string]string) (*catalog.Sandbox, error) {
	nodeID, done, err := s.importElsewhere(ctx, snap, sb)
	if err != nil {
		return nil, err
	}
	done(time.Time{}) // the clone's row and the next report count it
	moved := *snap
	moved.NodeID = nodeID
	sb.NodeID = nodeID
	if sb.Runtime == "" {
		sb.Runtime = snap.Runtime
	}
	res := s.cloneOnto(ctx, &moved, []*catalog.Sandbox{sb}, env)
	// The clone's disk is its own: the imported copy goes.
	if c, err := s.client(nodeID); err == nil {
		if _, err := c.DeleteSnapshot(context.WithoutCancel(ctx), &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID}); err != nil {
			s.log.Warn("delete imported snapshot copy", "snapshot_id", snap.ID, "node", nodeID, "err", err)
		}
	}
	return res[0].Sandbox, res[0].Err
}

// resumeElsewhere resumes a paused sandbox whose node is cordoned (healthy,
// taking nothing new) on another node, keeping its ID (and so its URL
// through the route), with deadline now+timeout: moveElsewhere.
func (s *Service) resumeElsewhere(ctx context.Context, sb *catalog.Sandbox, timeout time.Duration) (*catalog.Sandbox, error) {
	unmark, err := s.markMoving(ctx, sb.ID)
	if err != nil {
		return nil, err
	}
	defer unmark()
	// Read again under the mark: another replica may have moved it
	// (or resumed it) meanwhile.
	cur, err := s.cat.GetSandbox(ctx, sb.ID)
	if err != nil {
		return nil, err
	}
	if cur.State == catalog.StateRunning && cur.NodeID != sb.NodeID {
		return cur, nil
	}
	if cur.State != catalog.StatePaused || cur.NodeID != sb.NodeID {
		return nil, fmt.Errorf("sandbox %s is %s on node %s now: %w", sb.ID, cur.State, cur.NodeID, errdefs.ErrFailedPrecondition)
	}
	return s.moveElsewhere(ctx, cur, time.Now().UTC().Add(timeout))
}

// moveElsewhere starts a paused sandbox on another node under its own ID
// (and so its URL through the route), running with deadline endAt, and,
// where the runtime has memory snapshots and the nodes share a memory
// fingerprint, its memory. The state it ships:
//
//   - the snapshot exported as it paused (PauseSnapshot, with
//     store.export_on_pause), when it has one: it has not run since, so
//     the store already holds its state and nothing is uploaded;
//   - otherwise its node snapshots it (the fork-labelled kind, so
//     reconcile removes one a crash leaves) and exports the snapshot.
//
// Another node imports the snapshot and clones it under the sandbox's own
// ID and token, then the catalog moves the sandbox. Until the catalog
// moves it, any failure leaves the sandbox paused where it was. What only
// tidies up (the original destroyed, the move's snapshot deleted from its
// node, the store and the catalog, the imported copy deleted) runs after
// the answer, in the background (tidyAfterMove); a later move of the same
// sandbox waits for it. The caller holds the sandbox's lock, and marks
// the move (markMoving) so that the route waits for it instead of calling
// the sandbox paused.
func (s *Service) moveElsewhere(ctx context.Context, sb *catalog.Sandbox, endAt time.Time) (*catalog.Sandbox, error) {
	// Ended when the move's lease is lost: another replica may move it.
	ctx, stop := s.moveContext(ctx, sb.ID)
	defer stop()
	if err := s.waitLeft(ctx, sb.ID); err != nil {
		return nil, err
	}
	if err := s.pinnedByVolumes(ctx, sb); err != nil {
		return nil, err
	}
	if sb.State == catalog.StatePaused && sb.PauseSnapshot != "" {
		up, err := s.moveExported(ctx, sb, endAt)
		if err == nil {
			return up, nil
		}
		// The store lost it, or no node could import it: a snapshot of
		// its own (the sandbox is still paused where it was).
		s.log.Warn("move from the snapshot exported at pause failed; taking a new one", "sandbox_id", sb.ID, "snapshot_id", sb.PauseSnapshot, "err", err)
	}
	from := sb.NodeID
	begin := time.Now()
	snap, err := s.snapshot(ctx, sb, "", true)
	if err != nil {
		return nil, fmt.Errorf("move sandbox %s off node %s: snapshot: %w", sb.ID, from, err)
	}
	snapped := time.Since(begin)
	// The move's snapshot goes from the store (and the node's copy with
	// it), then from the catalog, whatever happens next.
	dropSnap := func() {
		if c, err := s.client(from); err == nil {
			if _, err := c.DeleteSnapshot(context.Background(), &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID, DeleteExported: true}); err != nil {
				s.log.Warn("delete a move's snapshot from the store", "snapshot_id", snap.ID, "node", from, "err", err)
			}
		}
		s.dropForkSnapshot(context.Background(), snap)
		s.forking.Delete(snap.ID)
	}
	c, err := s.client(from)
	if err != nil {
		s.tidyAfterMove(sb.ID, dropSnap)
		return nil, err
	}
	resp, err := c.ExportSnapshot(ctx, &cubeletpb.ExportSnapshotRequest{SnapshotId: snap.ID})
	if err != nil {
		s.tidyAfterMove(sb.ID, dropSnap)
		return nil, fmt.Errorf("move sandbox %s off node %s: export: %w", sb.ID, from, fromGRPC(from, err))
	}
	exported := time.Since(begin) - snapped
	up, tidy, err := s.startElsewhere(ctx, sb, snap, endAt)
	if err != nil {
		s.tidyAfterMove(sb.ID, dropSnap)
		return nil, fmt.Errorf("move sandbox %s off node %s: %w", sb.ID, from, err)
	}
	s.tidyAfterMove(sb.ID, func() { s.destroyOn(from, sb.ID) }, tidy, dropSnap)
	s.log.Info("sandbox resumed on another node", "sandbox_id", sb.ID, "from", from, "to", up.NodeID,
		"snapshot", snapped, "export", exported, "sent_bytes", resp.GetTransfer().GetMovedBytes(),
		"start_elsewhere", time.Since(begin)-snapped-exported, "total", time.Since(begin))
	s.event(sb.ID, "info", "sandbox resumed on another node", map[string]string{"from": from, "to": up.NodeID, "end_at": endAt.Format(time.RFC3339)})
	return up, nil
}

// moveExported is moveElsewhere from the snapshot sb's node exported as it
// paused: import and clone on another node, nothing taken or uploaded.
// The store's copy is deleted once the sandbox runs elsewhere.
func (s *Service) moveExported(ctx context.Context, sb *catalog.Sandbox, endAt time.Time) (*catalog.Sandbox, error) {
	from := sb.NodeID
	begin := time.Now()
	snap := &catalog.Snapshot{ID: sb.PauseSnapshot, SandboxID: sb.ID, NodeID: from, TemplateID: sb.TemplateID,
		Runtime: sb.Runtime, Team: sb.Team, EnvdAccessToken: sb.EnvdAccessToken}
	up, tidy, err := s.startElsewhere(ctx, sb, snap, endAt)
	if err != nil {
		return nil, fmt.Errorf("move sandbox %s off node %s from its pause's export %s: %w", sb.ID, from, snap.ID, err)
	}
	s.tidyAfterMove(sb.ID, func() { s.destroyOn(from, sb.ID) }, tidy, func() { s.dropExported(context.Background(), snap.ID, up.NodeID) })
	s.log.Info("sandbox resumed on another node", "sandbox_id", sb.ID, "from", from, "to", up.NodeID,
		"from_pause_export", snap.ID, "total", time.Since(begin))
	s.event(sb.ID, "info", "sandbox resumed on another node", map[string]string{"from": from, "to": up.NodeID,
		"snapshot": snap.ID, "end_at": endAt.Format(time.RFC3339)})
	return up, nil
}

// tidyAfterMove runs steps, in order, in the background, after a move of
// sandbox id answered: nothing the moved sandbox needs, only tidying up.
// Until they are done a new move of id waits (waitLeft), so that the
// original is gone from its node before the sandbox could come back there.
func (s *Service) tidyAfterMove(id string, steps ...func()) {
	done := make(chan struct{})
	if prev, loaded := s.leaving.Swap(id, done); loaded {
		// A move's own cleanup after its failure, then another's: the
		// later one waits for the earlier.
		steps = append([]func(){func() { <-prev.(chan struct{}) }}, steps...)
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer func() {
			s.leaving.CompareAndDelete(id, done)
			close(done)
		}()
		for _, f := range steps {
			if f != nil {
				f()
			}
		}
	}()
}

// waitLeft waits for the cleanup of an earlier move of sandbox id
// (tidyAfterMove), if one is still running.
func (s *Service) waitLeft(ctx context.Context, id string) error {
	v, ok := s.leaving.Load(id)
	if !ok {
		return nil
	}
	select {
	case <-v.(chan struct{}):
		return nil
	case <-ctx.Done():
		return fmt.Errorf("sandbox %s: waiting for its last move's cleanup: %w", id, ctx.Err())
	}
}

// startElsewhere starts sb, paused on its node, from snap (exported to
// the store) on another node under sb's ID and token, running until
// endAt, and moves its row there. It returns tidy, for the caller to run
// (tidyAfterMove): it deletes the imported copy from the new node and, when
// the row named a pause export other than snap, that one from the store.
// The store's copy of snap and the original sandbox are the caller's.
// Until the row moves, a failure leaves the row as it was and nothing on
// the new node.
func (s *Service) startElsewhere(ctx context.Context, sb *catalog.Sandbox, snap *catalog.Snapshot, endAt time.Time) (up *catalog.Sandbox, tidy func(), err error) {
	ctx, stop := s.moveContext(ctx, sb.ID)
	defer stop()
	to, done, err := s.importElsewhere(ctx, snap, sb)
	if err != nil {
		return nil, nil, err
	}
	var created time.Time
	defer func() { done(created) }()
	dropCopy := func() {
		tc, err := s.client(to)
		if err == nil {
			_, err = tc.DeleteSnapshot(context.Background(), &cubeletpb.DeleteSnapshotRequest{SnapshotId: snap.ID})
		}
		if err != nil {
			s.log.Warn("delete imported snapshot copy", "snapshot_id", snap.ID, "node", to, "err", err)
		}
	}
	defer func() {
		if err != nil {
			dropCopy()
		}
	}()
	tc, err := s.client(to)
	if err != nil {
		return nil, nil, err
	}
	s.creating.Store(sb.ID, true) // reconcile leaves the new copy alone
	defer s.creating.Delete(sb.ID)
	var tokens []string
	if sb.EnvdAccessToken != "" {
		tokens = []string{sb.EnvdAccessToken}
	}
	netPolicy, err := s.nodeNetwork(ctx, sb.Team, sb.Network)
	if err != nil {
		return nil, nil, err
	}
	resp, err := tc.CloneSandbox(ctx, &cubeletpb.CloneSandboxRequest{
		RequestId: sb.ID, SnapshotId: snap.ID, Count: 1, SandboxIds: []string{sb.ID},
		Labels: managedLabels(sb), Network: netPolicy, AccessTokens: tokens,
	})
	if err == nil && len(resp.GetSandboxes()) != 1 {
		err = fmt.Errorf("node %s did not start the sandbox: %w", to, errdefs.ErrInternal)
	}
	if err != nil {
		err = fromGRPC(to, err)
		if maybeCreated(err) {
			s.destroyOn(to, sb.ID)
		}
		return nil, nil, fmt.Errorf("start sandbox %s on node %s: %w", sb.ID, to, err)
	}
	created = resp.Sandboxes[0].GetCreatedAt().AsTime()
	moved := *sb
	moved.NodeID = to
	if err = s.initAgent(ctx, &moved, resp.Sandboxes[0], nil); err != nil {
		s.destroyOn(to, sb.ID)
		return nil, nil, fmt.Errorf("start sandbox %s on node %s: agent: %w", sb.ID, to, err)
	}
	pauseSnap := ""
	up, err = s.commitMove(ctx, sb.ID, func(r *catalog.Sandbox) error {
		pauseSnap = r.PauseSnapshot
		r.NodeID, r.State, r.EndAt, r.PauseSnapshot = to, catalog.StateRunning, endAt, ""
		return nil
	})
	if err != nil {
		s.destroyOn(to, sb.ID)
		return nil, nil, err
	}
	s.routes.drop(sb.ID)
	s.activity.touch(sb.ID, time.Now())
	tidy = func() {
		dropCopy()
		if pauseSnap != "" && pauseSnap != snap.ID {
			// Running again: the snapshot exported at its pause is stale.
			s.dropExported(context.Background(), pauseSnap, to)
		}
	}
	return up, tidy, nil
}

// dropExported deletes an exported snapshot from the object store
// through a node with a store: node first, then any other healthy node
// (the store's copy needs no node's copy). A failure is logged: the
// object stays in the store.
func (s *Service) dropExported(ctx context.Context, snapID, node string) {
	ctx = context.WithoutCancel(ctx)
	var tried []string
	for _, n := range s.schedNodes() {
		switch {
		case !n.Healthy: // a lost node would hold the call up
		case n.ID == node:
			tried = append([]string{n.ID}, tried...)
		default:
			tried = append(tried, n.ID)
		}
	}
	var errs []error
	for _, id := range tried {
		c, err := s.client(id)
		if err == nil {
			dctx, cancel := context.WithTimeout(ctx, time.Minute)
			_, err = c.DeleteSnapshot(dctx, &cubeletpb.DeleteSnapshotRequest{SnapshotId: snapID, DeleteExported: true})
			cancel()
			err = fromGRPC(id, err)
		}
		if err == nil || errdefs.IsNotFound(err) {
			return
		}
		errs = append(errs, fmt.Errorf("node %s: %w", id, err))
	}
	s.log.Warn("delete an exported pause snapshot from the store; it stays there", "snapshot_id", snapID, "err", errors.Join(errs...))
}

// How a move is known beyond the replica making it. This replica's verb
// lock and its moving set make its own verbs and route resolves wait for
// the move; on a shared catalog the move also holds the lease
// "move/<sandbox ID>" in the catalog, which the other replicas' verbs and
// route resolves wait on (awaitMove), so that none of them answers that
// the sandbox is paused (409, or a resume of its frozen original) while
// it moves, and none starts a second move of it.
const (
	// moveLeaseTTL is how long a move's lease outlives the last renewal
	// of its replica (renewed every third of it): a replica that died
	// mid-move holds the others up no longer than this.
	moveLeaseTTL = 10 * time.Second
	// moveLeasePrefix begins the name of every move's lease
	// (moveLeaseName), which pruneShared deletes moveLeaseKeep after the
	// move ended (released, or expired). Until then a lease keeps its
	// token, raised by each move; a deleted one starts again at 1. It
	// outlasts by far a replica's answer to a quiesce (which carries the
	// token for at most quiesceAnswerKeep) and the window in which a
	// quiesce reads the answers (quiesceAnswerFrom), so no answer to an
	// earlier move can carry the token of a later one.
	moveLeasePrefix = "move"
	moveLeaseKeep   = 10 * time.Minute
	movePoll        = 100 * time.Millisecond
	// routeMoveWait bounds how long a route resolve waits for a move
	// (within cubeproxy's own bound on a resolve): then the route answers
	// 503 with Retry-After. verbMoveWait bounds a verb's wait (then 503).
	routeMoveWait = 30 * time.Second
	verbMoveWait  = 2 * time.Minute
)

// moveLeaseName names the lease of a move of sandbox id; a lease name
// holds 64 characters, so a long ID (up to 63) is named by its digest.
func moveLeaseName(id string) string {
	if n := "move/" + id; len(n) <= 64 {
		return n
	}
	sum := sha256.Sum256([]byte(id))
	return "move#" + hex.EncodeToString(sum[:])[:59]
}

// moveMark is a move under way (Service.moving): on a shared catalog the
// lease it holds, and lost, ended when that lease is lost (taken by
// another holder, or not renewed in time): the move must stop, and its
// catalog row may be written only under the lease (commitMove).
type moveMark struct {
	name, holder string
	token        int64 // 0: no lease (a catalog of its own)
	lost         context.Context
}

// errMoveLeaseLost ends a move whose lease another replica may hold now.
var errMoveLeaseLost = fmt.Errorf("the move's lease was lost; another replica may move the sandbox: %w", errdefs.ErrAborted)

// markMoving records that sandbox id is being moved, until the returned
// func is called. On a shared catalog it takes the move's lease, waiting
// while another replica's move of the sandbox holds it, and renews it
// until then. A renewal that finds the lease taken by another holder, or
// that failed for so long that the lease may have expired before the
// next one, loses it: the move's context ends (moveContext).
func (s *Service) markMoving(ctx context.Context, id string) (func(), error) {
	s.moving.Store(id, &moveMark{})
	if !s.shared() {
		return func() { s.moving.Delete(id) }, nil
	}
	name, holder := moveLeaseName(id), s.lead.holder
	var lease catalog.Lease
	renewedAt := time.Now()
	for {
		renewedAt = time.Now()
		l, ok, err := s.cat.AcquireLease(ctx, name, holder, s.lead.replica, moveLeaseTTL, false)
		if err != nil {
			s.moving.Delete(id)
			return nil, fmt.Errorf("sandbox %s: take its move's lease: %w", id, err)
		}
		if ok {
			lease = l
			break
		}
		select {
		case <-ctx.Done():
			s.moving.Delete(id)
			return nil, fmt.Errorf("sandbox %s: another replica is moving it: %w", id, ctx.Err())
		case <-time.After(movePoll):
		}
	}
	lost, lose := context.WithCancelCause(context.Background())
	s.moving.Store(id, &moveMark{name: name, holder: holder, token: lease.Token, lost: lost})
	stop, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		every := moveLeaseTTL / 3
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			at := time.Now()
			l, ok, err := s.cat.AcquireLease(context.WithoutCancel(ctx), name, holder, s.lead.replica, moveLeaseTTL, false)
			switch {
			case err == nil && ok && l.Token == lease.Token:
				renewedAt = at
				continue
			case err == nil:
				s.log.Warn("move: its lease was taken by another holder; the move stops", "sandbox_id", id,
					"holder", l.Holder, "replica", l.Replica, "token", l.Token)
				lose(errMoveLeaseLost)
				return
			case time.Since(renewedAt)+every >= moveLeaseTTL:
				// The lease may expire before the next renewal: another
				// replica may take it and move the sandbox too.
				s.log.Warn("move: its lease could not be renewed within its TTL; the move stops", "sandbox_id", id, "err", err)
				lose(errMoveLeaseLost)
				return
			}
			s.log.Warn("move: renew its lease (other replicas may stop waiting for the move)", "sandbox_id", id, "err", err)
		}
	}()
	return func() {
		close(stop)
		<-stopped
		lose(nil)
		// Released, not deleted: the row keeps its token, so the next
		// move's is higher and no replica's answer to this move's
		// quiesce counts for it (quiesce.go; pruneShared deletes the
		// row after moveLeaseKeep).
		if err := s.cat.ReleaseLease(context.WithoutCancel(ctx), name, holder); err != nil {
			s.log.Warn("move: release its lease (the other replicas wait until it expires)", "sandbox_id", id, "err", err)
		}
		s.moving.Delete(id)
	}, nil
}

// moveContext is ctx, ended also when the lease of the move of sandbox id
// (markMoving) is lost; stop releases it.
func (s *Service) moveContext(ctx context.Context, id string) (context.Context, func()) {
	m, ok := s.moving.Load(id)
	if !ok || m.(*moveMark).lost == nil {
		return ctx, func() {}
	}
	lost := m.(*moveMark).lost
	mctx, cancel := context.WithCancelCause(ctx)
	stopAfter := context.AfterFunc(lost, func() {
		if cause := context.Cause(lost); errors.Is(cause, errMoveLeaseLost) {
			cancel(cause)
		}
	})
	return mctx, func() { stopAfter(); cancel(nil) }
}

// commitMove writes the row of sandbox id that switches it to its new
// node: on a shared catalog only while this replica still holds the
// move's lease with the token it took (checked in the same statement as
// the write), so that a move whose lease was lost, and which another
// replica may have started again, cannot commit.
func (s *Service) commitMove(ctx context.Context, id string, fn func(*catalog.Sandbox) error) (*catalog.Sandbox, error) {
	if err := fpMoveCommit.Eval(ctx); err != nil {
		return nil, err
	}
	m, ok := s.moving.Load(id)
	if !ok || m.(*moveMark).token == 0 {
		if s.shared() {
			return nil, fmt.Errorf("sandbox %s: moved without its move's lease: %w", id, errdefs.ErrInternal)
		}
		return s.cat.UpdateSandbox(ctx, id, fn)
	}
	mk := m.(*moveMark)
	if err := context.Cause(mk.lost); errors.Is(err, errMoveLeaseLost) {
		return nil, fmt.Errorf("sandbox %s: %w", id, err)
	}
	up, err := s.cat.UpdateSandboxUnderLease(ctx, id, mk.name, mk.holder, mk.token, fn)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: the move did not commit: %w", id, err)
	}
	return up, nil
}

// fpMoveCommit sits right before a move's row switches the sandbox's node
// (commitMove): a test takes the move's lease away there.
var fpMoveCommit = failpoint.Register("move/commit")

// awaitMove waits, on a shared catalog, while another replica moves
// sandbox id (its move's lease is held), up to bound; then the error
// carries kind (what the caller's client should read: try again). A move
// of this replica's is not waited for here: the verb lock and the moving
// set do that.
func (s *Service) awaitMove(ctx context.Context, id string, bound time.Duration, kind error) (waited bool, err error) {
	if !s.shared() {
		return false, nil
	}
	name := moveLeaseName(id)
	var began time.Time
	for {
		l, held, err := s.cat.LeaseHeld(ctx, name)
		if err != nil {
			return !began.IsZero(), err
		}
		if !held || l.Holder == s.lead.holder {
			if !began.IsZero() {
				s.log.Info("waited for another replica's move of the sandbox", "sandbox_id", id, "waited", time.Since(began))
			}
			return !began.IsZero(), nil
		}
		if began.IsZero() {
			began = time.Now()
		}
		if time.Since(began) >= bound {
			return true, fmt.Errorf("sandbox %s is being moved to another node (by master replica %s) and still was after %s; try again: %w",
				id, l.Replica, bound, kind)
		}
		select {
		case <-ctx.Done():
			return true, fmt.Errorf("sandbox %s: waiting for its move to another node: %w", id, ctx.Err())
		case <-time.After(movePoll):
		}
	}
}

// nodeCordoned reports whether nodeID is healthy but takes nothing new: a
// paused sandbox there resumes on another node.
func (s *Service) nodeCordoned(nodeID string) bool {
	for _, n := range s.schedNodes() {
		if n.ID == nodeID {
			return n.Healthy && !n.Schedulable
		}
	}
	return false
}
