package cubelet

import (
	"context"

	"github.com/cubesandbox/cube/internal/runtime"
)

// launch starts the sandbox's container: restored from the memory image
// of the snapshot the task works from when its disk holds exactly that
// snapshot and the runtime can restore (clone, rollback), cold-booted
// otherwise (create, disk-only snapshots, runc, and an undone rollback
// whose disk is the old one again).
func launch(ctx context.Context, d runtime.Driver, t *Task, spec runtime.Spec) (runtime.State, error) {
	if dir := memoryImage(d, t); dir != "" {
		return d.Restore(ctx, spec, dir)
	}
	return d.Start(ctx, spec)
}

// memoryImage is the memory image launch restores from, "" for a cold
// boot. The record's SourceSnapshotID names the snapshot the disk was
// cloned from at every instant (clone sets it at create, rollback when it
// swaps the disks and back), which is what makes disk and memory agree.
func memoryImage(d runtime.Driver, t *Task) string {
	if t.snap == nil || t.snap.snap == nil || !d.Capabilities().Restore {
		return ""
	}
	sn := t.snap.snap
	if !sn.HasMemory || sn.MemoryDir == "" || t.Record().SourceSnapshotID != sn.ID {
		return ""
	}
	return sn.MemoryDir
}
