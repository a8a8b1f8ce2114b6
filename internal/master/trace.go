package master

import (
	"fmt"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// createTrace is where one create's time went: placement (choosing a
// node, waiting for one), the node's create flow action by action, the
// rest of the node call (the RPC), and the agent's init. It rides in the
// fields of the sandbox's "sandbox created" event (its log).
type createTrace struct {
	placed, node, agent, total time.Duration
	actions                    []*cubeletpb.ActionTiming
}

// ms is a duration in milliseconds with microsecond precision, as trace
// fields carry it.
func ms(d time.Duration) string { return fmt.Sprintf("%.3f", float64(d.Microseconds())/1000) }

// TracePrefix starts the keys of the trace's fields.
const TracePrefix = "trace."

// fields is the trace as event fields, each a duration in milliseconds:
// "trace.total", "trace.placement", "trace.node_call" (the whole call to
// the node), "trace.agent_init", and one "trace.action.<step>.<name>"
// per action the node ran (step zero-padded, so the keys sort in flow
// order; actions of one step ran in parallel; an undo's name ends in
// ".undo"), plus "trace.flow" (the node's flow).
func (t createTrace) fields() map[string]string {
	f := map[string]string{
		TracePrefix + "total": ms(t.total), TracePrefix + "placement": ms(t.placed),
		TracePrefix + "node_call": ms(t.node), TracePrefix + "agent_init": ms(t.agent),
	}
	for _, a := range t.actions {
		k := fmt.Sprintf("%saction.%02d.%s", TracePrefix, a.GetStep(), a.GetAction())
		if a.GetPhase() == "undo" {
			k += ".undo"
		}
		f[k] = ms(a.GetDuration().AsDuration())
		f[TracePrefix+"flow"] = a.GetFlow()
	}
	return f
}
