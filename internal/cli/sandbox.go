package cli

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/spf13/cobra"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubeletclient"
)

func sandboxCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "sandbox", Aliases: []string{"sb"}, Short: "Create and manage sandboxes"}
	cmd.AddCommand(sandboxCreate(g), sandboxList(g), sandboxInspect(g),
		sandboxPause(g),
		sandboxResume(g),
		sandboxClone(g), sandboxRollback(g),
		sandboxRemove(g))
	return cmd
}

func sandboxRow(s *pb.Sandbox) []string {
	return []string{s.Id, s.TemplateId, cubeletclient.StateName(s.State), s.Runtime,
		fmt.Sprintf("%.2f", float64(s.Resources.GetMilliCpu())/1000), fmt.Sprintf("%dMiB", s.Resources.GetMemoryMib()),
		age(s.CreatedAt.AsTime()), labelsString(s.Labels)}
}

var sandboxHeaders = []string{"ID", "TEMPLATE", "STATE", "RUNTIME", "CPU", "MEMORY", "AGE", "LABELS"}

func labelsString(m map[string]string) string {
	var kv []string
	for k, v := range m {
		kv = append(kv, k+"="+v)
	}
	sort.Strings(kv)
	return strings.Join(kv, ",")
}

func (g *globals) printSandbox(s *pb.Sandbox, timings []*pb.ActionTiming) error {
	if g.json() {
		return g.printJSON(s)
	}
	g.table(sandboxHeaders, [][]string{sandboxRow(s)})
	return nil
}

func sandboxCreate(g *globals) *cobra.Command {
	var (
		req          pb.CreateSandboxRequest
		res          pb.Resources
		labels, envs []string
		annots       []string
		mounts       []string
		showTimings  bool
	)
	cmd := &cobra.Command{
		Use:   "create --template ID",
		Short: "Create a sandbox and wait until its agent answers",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if req.TemplateId == "" {
				return usageError{fmt.Errorf("--template is required")}
			}
			var err error
			if req.Labels, err = parseKV(labels, "label"); err != nil {
				return err
			}
			if req.Env, err = parseKV(envs, "env"); err != nil {
				return err
			}
			if req.Annotations, err = parseKV(annots, "annotation"); err != nil {
				return err
			}
			req.Resources = &res
			if req.HostMounts, err = parseMounts(mounts); err != nil {
				return err
			}
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.CreateSandbox(ctx, &req)
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp)
				}
				g.table(sandboxHeaders, [][]string{sandboxRow(resp.Sandbox)})
				for _, w := range resp.Warnings {
					fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w)
				}
				if showTimings {
					g.printTimings(resp.Timings)
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.StringVarP(&req.TemplateId, "template", "t", "", "template ID (required)")
	f.StringVar(&req.SandboxId, "id", "", "sandbox ID (generated when empty)")
	f.StringVar(&req.Runtime, "runtime", "", "runtime driver (node default when empty)")
	f.StringVar(&req.RequestId, "request-id", "", "request ID for logs")
	f.Int64Var(&res.MilliCpu, "cpu-milli", 0, "CPU limit in millicores (1000 = 1 vCPU)")
	f.Int64Var(&res.MemoryMib, "memory", 0, "memory limit in MiB")
	f.Int64Var(&res.Pids, "pids", 0, "max processes")
	f.Int64Var(&res.DiskMib, "disk", 0, "disk size in MiB (grown from the template's)")
	f.StringArrayVarP(&labels, "label", "l", nil, "label KEY=VALUE (repeatable)")
	f.StringArrayVarP(&envs, "env", "e", nil, "environment KEY=VALUE (repeatable)")
	f.StringArrayVar(&annots, "annotation", nil, "annotation KEY=VALUE (repeatable)")
	f.StringArrayVar(&mounts, "mount", nil, "bind a host path SRC:DST[:ro] (repeatable; the node's storage.host_mount_allow must permit SRC)")
	f.BoolVar(&showTimings, "timings", false, "print the duration of every action")
	return cmd
}

func (g *globals) printTimings(ts []*pb.ActionTiming) {
	var rows [][]string
	for _, t := range ts {
		rows = append(rows, []string{t.Flow, fmt.Sprint(t.Step), t.Action, t.Phase, t.Duration.AsDuration().String(), t.Error})
	}
	fmt.Fprintln(g.out)
	g.table([]string{"FLOW", "STEP", "ACTION", "PHASE", "DURATION", "ERROR"}, rows)
}

func sandboxList(g *globals) *cobra.Command {
	var states, labels []string
	cmd := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List sandboxes",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			req := &pb.ListSandboxesRequest{}
			for _, s := range states {
				st, ok := cubeletclient.ParseState(s)
				if !ok {
					return usageError{fmt.Errorf("unknown state %q", s)}
				}
				req.States = append(req.States, st)
			}
			var err error
			if req.Labels, err = parseKV(labels, "label"); err != nil {
				return err
			}
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.ListSandboxes(ctx, req)
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
				return nil
			})
		},
	}
	cmd.Flags().StringSliceVar(&states, "state", nil, "only these states (running,paused,...)")
	cmd.Flags().StringArrayVarP(&labels, "label", "l", nil, "only sandboxes with label KEY=VALUE (repeatable)")
	return cmd
}

func sandboxInspect(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "Show one sandbox in full",
		Args:  exactArgs(1, "a sandbox ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.GetSandbox(ctx, &pb.GetSandboxRequest{SandboxId: args[0]})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp.Sandbox)
				}
				s := resp.Sandbox
				rows := [][]string{
					{"ID", s.Id}, {"Template", s.TemplateId}, {"State", cubeletclient.StateName(s.State)},
					{"Runtime", s.Runtime}, {"PID", fmt.Sprint(s.Pid)}, {"Pause mode", s.PauseMode},
					{"CPU (milli)", fmt.Sprint(s.Resources.GetMilliCpu())}, {"Memory (MiB)", fmt.Sprint(s.Resources.GetMemoryMib())},
					{"Pids", fmt.Sprint(s.Resources.GetPids())}, {"Disk (MiB)", fmt.Sprint(s.Resources.GetDiskMib())},
					{"Labels", labelsString(s.Labels)}, {"Created", s.CreatedAt.AsTime().Format("2006-01-02T15:04:05Z")},
				}
				if s.Error != "" {
					rows = append(rows, []string{"Error", s.Error})
				}
				g.table([]string{"FIELD", "VALUE"}, rows)
				return nil
			})
		},
	}
}

func sandboxResume(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "resume ID",
		Short: "Thaw a paused sandbox (or restore one paused to disk)",
		Args:  exactArgs(1, "a sandbox ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.ResumeSandbox(ctx, &pb.ResumeSandboxRequest{SandboxId: args[0]})
				if err != nil {
					return err
				}
				return g.printSandbox(resp.Sandbox, resp.Timings)
			})
		},
	}
}

func sandboxRemove(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "rm ID...",
		Aliases: []string{"delete"},
		Short:   "Destroy sandboxes and everything they hold",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError{fmt.Errorf("expected at least one sandbox ID")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				var first error
				for _, id := range args {
					if _, err := c.DeleteSandbox(ctx, &pb.DeleteSandboxRequest{SandboxId: id}); err != nil {
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
