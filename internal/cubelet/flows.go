package cubelet

import (
	"github.com/cubesandbox/cube/internal/cubelet/actions"
)

// Flow names, as the API reports them in timings; the verb table that
// defines them is actions.Verbs.
const (
	FlowInit       = actions.FlowInit
	FlowCreate     = actions.FlowCreate
	FlowDestroy    = actions.FlowDestroy
	FlowCleanup    = actions.FlowCleanup
	FlowPause      = actions.FlowPause
	FlowResume     = actions.FlowResume
	FlowPauseDisk  = actions.FlowPauseDisk
	FlowResumeDisk = actions.FlowResumeDisk
	FlowSnapshot   = actions.FlowSnapshot
	FlowClone      = actions.FlowClone
	FlowRollback   = actions.FlowRollback
)

// AgentPath is where templates carry the agent.
const AgentPath = actions.AgentPath
