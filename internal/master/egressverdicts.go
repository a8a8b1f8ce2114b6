package master

import (
	"context"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
)

// Bounds on what one node report's egress verdicts become: a node (or a
// sandbox feeding its proxy long Host headers) cannot flood the catalog.
// The agent bounds them too (audit.MaxNotable, audit.MaxNotableField);
// the master does not rely on it.
const (
	maxEgressVerdicts   = 1024 // verdicts taken from one report; the rest are counted
	maxEgressSuppressed = 1024 // sandboxes whose suppressed counts are taken
	maxEgressField      = 256  // bytes of a verdict's name, addr, rule or reason
)

// noteEgress records the notable egress verdicts a node reported (denied,
// failed or cut connections and queries of its sandboxes, rate-limited
// per sandbox by its network-agent) as the sandboxes' events, where the
// sandbox's team reads them (its log, the console). A verdict for a
// sandbox the catalog does not place on that node is dropped: a node
// speaks for its own sandboxes only. Runs in the background.
func (s *Service) noteEgress(nodeID string, verdicts []*masterpb.EgressVerdict, suppressed map[string]int32) {
	s.goBackground(func(ctx context.Context) {
		placed := map[string]bool{}
		mine := func(id string) bool {
			ok, seen := placed[id]
			if !seen {
				sb, err := s.cat.GetSandbox(ctx, id)
				ok = err == nil && sb.NodeID == nodeID
				placed[id] = ok
			}
			return ok
		}
		for _, e := range egressEvents(nodeID, verdicts, suppressed, mine) {
			s.event(e.sandboxID, "warn", e.msg, e.fields)
		}
	})
}

type egressEvent struct {
	sandboxID, msg string
	fields         map[string]string
}

// egressEvents turns a report's verdicts into sandbox events, bounded:
// at most maxEgressVerdicts verdicts (the rest are counted with the
// suppressed ones of their sandbox), fields cut to maxEgressField bytes,
// suppressed counts of at most maxEgressSuppressed sandboxes. mine says
// whether the node may speak for a sandbox.
func egressEvents(nodeID string, verdicts []*masterpb.EgressVerdict, suppressed map[string]int32, mine func(string) bool) []egressEvent {
	var out []egressEvent
	over := map[string]int32{}
	for i, v := range verdicts {
		if i >= maxEgressVerdicts {
			if len(over) < maxEgressSuppressed || over[v.SandboxId] > 0 {
				over[v.SandboxId]++
			}
			continue
		}
		if !mine(v.SandboxId) {
			continue
		}
		name, addr, rule, reason := cutField(v.Name), cutField(v.Addr), cutField(v.Rule), cutField(v.Reason)
		kind, verdict := cutField(v.Kind), cutField(v.Verdict)
		target := name
		if addr != "" {
			target = strings.TrimSpace(target + " " + addr)
		}
		msg := fmt.Sprintf("egress %s (%s) %s", verdict, kind, target)
		if reason != "" {
			msg += ": " + reason
		}
		fields := map[string]string{"node": nodeID, "kind": kind, "verdict": verdict}
		for k, val := range map[string]string{"name": name, "addr": addr, "rule": rule, "reason": reason} {
			if val != "" {
				fields[k] = val
			}
		}
		if v.Time != nil {
			fields["at"] = v.Time.AsTime().Format(time.RFC3339Nano)
		}
		out = append(out, egressEvent{sandboxID: v.SandboxId, msg: msg, fields: fields})
	}
	taken := 0
	for id, n := range suppressed {
		if taken >= maxEgressSuppressed {
			break
		}
		taken++
		if n > 0 {
			over[id] += n
		}
	}
	for id, n := range over {
		if n > 0 && mine(id) {
			out = append(out, egressEvent{sandboxID: id,
				msg:    fmt.Sprintf("egress: %d more denied or failed verdicts not reported (rate limit); the node's audit log has them", n),
				fields: map[string]string{"node": nodeID, "suppressed": fmt.Sprint(n)}})
		}
	}
	return out
}

// cutField cuts s to maxEgressField bytes on a UTF-8 boundary, marked
// with "…".
func cutField(s string) string {
	if len(s) <= maxEgressField {
		return s
	}
	const mark = "…"
	cut := maxEgressField - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}
