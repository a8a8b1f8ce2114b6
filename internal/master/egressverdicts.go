package master

import (
	"context"
	"fmt"
	"strings"
	"time"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
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
		for _, v := range verdicts {
			if !mine(v.SandboxId) {
				continue
			}
			target := v.Name
			if v.Addr != "" {
				target = strings.TrimSpace(target + " " + v.Addr)
			}
			msg := fmt.Sprintf("egress %s (%s) %s", v.Verdict, v.Kind, target)
			if v.Reason != "" {
				msg += ": " + v.Reason
			}
			fields := map[string]string{"node": nodeID, "kind": v.Kind, "verdict": v.Verdict}
			for k, val := range map[string]string{"name": v.Name, "addr": v.Addr, "rule": v.Rule, "reason": v.Reason} {
				if val != "" {
					fields[k] = val
				}
			}
			if v.Time != nil {
				fields["at"] = v.Time.AsTime().Format(time.RFC3339Nano)
			}
			s.event(v.SandboxId, "warn", msg, fields)
		}
		for id, n := range suppressed {
			if n > 0 && mine(id) {
				s.event(id, "warn", fmt.Sprintf("egress: %d more denied or failed verdicts not reported (rate limit); the node's audit log has them", n),
					map[string]string{"node": nodeID, "suppressed": fmt.Sprint(n)})
			}
		}
	})
}
