package master

import (
	"fmt"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// TraceMessage is the message of the event that records where a create's
// time went (in the sandbox's log, beside "sandbox created").
const TraceMessage = "create trace"

// createTrace is where one create's time went: placement (choosing a
// node, waiting for one), the node's create flow action by action, the
// rest of the node call (the RPC), and the agent's init.
type createTrace struct {
	placed, node, agent, total time.Duration
	actions                    []*cubeletpb.ActionTiming
}

// ms is a duration in milliseconds with microsecond precision, as trace
// fields carry it.
func ms(d time.Duration) string { return fmt.Sprintf("%.3f", float64(d.Microseconds())/1000) }

// fields is the trace as event fields, each a duration in milliseconds:
// "total", "placement", "node" (the whole node call), "agent_init", and
// one "action.<step>.<name>" per action the node ran (step zero-padded,
// so the keys sort in flow order; an undo's name ends in ".undo"),
// plus "flow" (the node's flow).
func (t createTrace) fields() map[string]string {
	f := map[string]string{
		"total": ms(t.total), "placement": ms(t.placed), "node": ms(t.node), "agent_init": ms(t.agent),
	}
	for _, a := range t.actions {
		k := fmt.Sprintf("action.%02d.%s", a.GetStep(), a.GetAction())
		if a.GetPhase() == "undo" {
			k += ".undo"
		}
		f[k] = ms(a.GetDuration().AsDuration())
		f["flow"] = a.GetFlow()
	}
	return f
}
