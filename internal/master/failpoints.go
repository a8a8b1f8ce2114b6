package master

import "github.com/cubesandbox/cube/internal/failpoint"

// The master's failpoints: each sits between two effects of a verb (a
// catalog write, a node call, the reply), where a crash leaves a state of
// its own for the restarted master's reconcile to resolve. TestMasterKilled
// SIGKILLs a real cubemaster at every one of them (it enumerates them with
// failpoint.Registered("master/") and fails on one without a case).
var (
	fpCreateRow      = failpoint.Register("master/create/row")      // row written (creating, no node)
	fpCreateAssigned = failpoint.Register("master/create/assigned") // row names the node; the node not asked yet
	fpCreatePlaced   = failpoint.Register("master/create/placed")   // the node made it; its agent not initialised
	fpCreateReady    = failpoint.Register("master/create/ready")    // agent initialised; the row still creating
	fpCreateDone     = failpoint.Register("master/create/done")     // the row running; the client not answered

	fpKillBegin   = failpoint.Register("master/kill/begin")   // nothing done yet
	fpKillDeleted = failpoint.Register("master/kill/deleted") // gone from the node; the row still there
	fpKillDone    = failpoint.Register("master/kill/done")    // the row gone; the client not answered

	fpPauseBegin  = failpoint.Register("master/pause/begin")  // nothing done yet
	fpPausePaused = failpoint.Register("master/pause/paused") // paused on the node; the row still running
	fpPauseDone   = failpoint.Register("master/pause/done")   // the row paused; the client not answered

	fpResumeBegin   = failpoint.Register("master/resume/begin")   // nothing done yet
	fpResumeResumed = failpoint.Register("master/resume/resumed") // running on the node; the row still paused
	fpResumeDone    = failpoint.Register("master/resume/done")    // the row running; the client not answered

	fpSnapshotBegin = failpoint.Register("master/snapshot/begin") // nothing done yet
	fpSnapshotTaken = failpoint.Register("master/snapshot/taken") // the node has it; no row
	fpSnapshotDone  = failpoint.Register("master/snapshot/done")  // the row written; the client not answered

	fpForkSnapshotted = failpoint.Register("master/fork/snapshotted") // the fork's snapshot taken; no clone rows
	fpCloneRows       = failpoint.Register("master/clone/rows")       // clone rows written (creating); the node not asked
	fpCloneMade       = failpoint.Register("master/clone/made")       // the node made the clones; agents not initialised
	fpCloneDone       = failpoint.Register("master/clone/done")       // clone rows running; the fork's snapshot still there
	fpForkDone        = failpoint.Register("master/fork/done")        // the fork's snapshot deleted; the client not answered
)
