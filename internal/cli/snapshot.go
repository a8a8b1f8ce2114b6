package cli

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

func snapshotCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "snapshot", Aliases: []string{"snap"}, Short: "Take and manage sandbox snapshots"}
	cmd.AddCommand(snapshotCreate(g), snapshotList(g), snapshotInspect(g), snapshotRemove(g))
	return cmd
}

var snapshotHeaders = []string{"ID", "NAME", "SANDBOX", "TEMPLATE", "PARENT", "SIZE", "MEMORY", "AGE", "LABELS"}

func snapshotRow(s *pb.Snapshot) []string {
	mem := "no"
	if s.HasMemory {
		mem = "yes"
	}
	return []string{s.Id, s.Name, s.SandboxId, s.TemplateId, s.ParentSnapshotId, bytesHuman(s.SizeBytes), mem,
		age(s.CreatedAt.AsTime()), labelsString(s.Labels)}
}

func snapshotCreate(g *globals) *cobra.Command {
	var (
		req         pb.SnapshotSandboxRequest
		labels      []string
		showTimings bool
	)
	cmd := &cobra.Command{
		Use:   "create SANDBOX",
		Short: "Snapshot a running or paused sandbox (disk, and memory where the runtime can)",
		Args:  exactArgs(1, "a sandbox ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.SandboxId = args[0]
			var err error
			if req.Labels, err = parseKV(labels, "label"); err != nil {
				return err
			}
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.SnapshotSandbox(ctx, &req)
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp)
				}
				g.table(snapshotHeaders, [][]string{snapshotRow(resp.Snapshot)})
				if showTimings {
					g.printTimings(resp.Timings)
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.SnapshotId, "id", "", "snapshot ID (generated when empty)")
	f.StringVar(&req.Name, "name", "", "a name for people")
	f.StringArrayVarP(&labels, "label", "l", nil, "label KEY=VALUE (repeatable)")
	f.BoolVar(&req.Stop, "stop", false, "destroy the sandbox once the snapshot is taken")
	f.StringVar(&req.RequestId, "request-id", "", "request ID for logs")
	f.BoolVar(&showTimings, "timings", false, "print the duration of every action")
	return cmd
}

func snapshotList(g *globals) *cobra.Command {
	var (
		req    pb.ListSnapshotsRequest
		labels []string
	)
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List snapshots",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if req.Labels, err = parseKV(labels, "label"); err != nil {
				return err
			}
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.ListSnapshots(ctx, &req)
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp)
				}
				rows := make([][]string, 0, len(resp.Snapshots))
				for _, s := range resp.Snapshots {
					rows = append(rows, snapshotRow(s))
				}
				g.table(snapshotHeaders, rows)
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&req.SandboxId, "sandbox", "", "only snapshots of this sandbox")
	cmd.Flags().StringArrayVarP(&labels, "label", "l", nil, "only snapshots with label KEY=VALUE (repeatable)")
	return cmd
}

func snapshotInspect(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "Show one snapshot in full",
		Args:  exactArgs(1, "a snapshot ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.GetSnapshot(ctx, &pb.GetSnapshotRequest{SnapshotId: args[0]})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp.Snapshot)
				}
				s := resp.Snapshot
				mem := "no (disk only)"
				if s.HasMemory {
					mem = "yes"
				}
				g.table([]string{"FIELD", "VALUE"}, [][]string{
					{"ID", s.Id}, {"Name", s.Name}, {"Sandbox", s.SandboxId},
					{"Parent snapshot", s.ParentSnapshotId}, {"Template", s.TemplateId}, {"Runtime", s.Runtime},
					{"Size", fmt.Sprintf("%s (%d bytes allocated)", bytesHuman(s.SizeBytes), s.SizeBytes)},
					{"Memory", mem}, {"Labels", labelsString(s.Labels)},
					{"Created", s.CreatedAt.AsTime().Format("2006-01-02T15:04:05Z")},
				})
				return nil
			})
		},
	}
}

func snapshotRemove(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "rm ID...",
		Aliases: []string{"delete"},
		Short:   "Delete snapshots (sandboxes made from them are unaffected)",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{fmt.Errorf("expected at least one snapshot ID")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				var first error
				for _, id := range args {
					if _, err := c.DeleteSnapshot(ctx, &pb.DeleteSnapshotRequest{SnapshotId: id}); err != nil {
						fmt.Fprintf(cmd.ErrOrStderr(), "%s: %v\n", id, err)
						if first == nil {
							first = err
						}
						continue
					}
					if !g.json() {
						fmt.Fprintln(g.out, id)
					}
				}
				return first
			})
		},
	}
}

func sandboxClone(g *globals) *cobra.Command {
	var (
		req                    pb.CloneSandboxRequest
		count                  int32
		ids, labels, envs, ann []string
		showTimings            bool
	)
	cmd := &cobra.Command{
		Use:   "clone --count N SNAPSHOT",
		Short: "Create N sandboxes from a snapshot (all or nothing)",
		Args:  exactArgs(1, "a snapshot ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			req.SnapshotId, req.Count = args[0], count
			for _, id := range ids {
				req.SandboxIds = append(req.SandboxIds, strings.Split(id, ",")...)
			}
			var err error
			if req.Labels, err = parseKV(labels, "label"); err != nil {
				return err
			}
			if req.Env, err = parseKV(envs, "env"); err != nil {
				return err
			}
			if req.Annotations, err = parseKV(ann, "annotation"); err != nil {
				return err
			}
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.CloneSandbox(ctx, &req)
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp)
				}
				rows := make([][]string, 0, len(resp.Sandboxes))
				for _, s := range resp.Sandboxes {
					rows = append(rows, sandboxRow(s))
				}
				g.table(sandboxHeaders, rows)
				if showTimings {
					g.printTimings(resp.Timings)
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.Int32VarP(&count, "count", "n", 1, "how many sandboxes (1-100)")
	f.StringArrayVar(&ids, "id", nil, "sandbox IDs, one per clone (comma-separated or repeated; generated when absent)")
	f.StringArrayVarP(&labels, "label", "l", nil, "label KEY=VALUE for every clone (repeatable)")
	f.StringArrayVarP(&envs, "env", "e", nil, "environment KEY=VALUE, over the snapshot's (repeatable)")
	f.StringArrayVar(&ann, "annotation", nil, "annotation KEY=VALUE (repeatable)")
	f.StringVar(&req.RequestId, "request-id", "", "request ID for logs")
	f.BoolVar(&showTimings, "timings", false, "print the duration of every action")
	return cmd
}

func sandboxRollback(g *globals) *cobra.Command {
	var showTimings bool
	cmd := &cobra.Command{
		Use:   "rollback ID SNAPSHOT",
		Short: "Put a sandbox back to a snapshot, keeping its ID",
		Args:  exactArgs(2, "a sandbox ID and a snapshot ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.RollbackSandbox(ctx, &pb.RollbackSandboxRequest{SandboxId: args[0], SnapshotId: args[1]})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp)
				}
				g.table(sandboxHeaders, [][]string{sandboxRow(resp.Sandbox)})
				if showTimings {
					g.printTimings(resp.Timings)
				}
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&showTimings, "timings", false, "print the duration of every action")
	return cmd
}

// parseMounts reads --mount SRC:DST[:ro|:rw].
func parseMounts(specs []string) ([]*pb.HostMount, error) {
	var out []*pb.HostMount
	for _, s := range specs {
		parts := strings.Split(s, ":")
		m := &pb.HostMount{}
		switch {
		case len(parts) == 2:
		case len(parts) == 3 && (parts[2] == "ro" || parts[2] == "rw"):
			m.ReadOnly = parts[2] == "ro"
		default:
			return nil, usageError{fmt.Errorf("mount %q: want SRC:DST[:ro|:rw]", s)}
		}
		m.Source, m.Destination = parts[0], parts[1]
		out = append(out, m)
	}
	return out, nil
}
