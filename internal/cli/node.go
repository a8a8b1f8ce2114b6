package cli

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/spf13/cobra"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

func nodeCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "node", Short: "This node's cubelet"}
	cmd.AddCommand(&cobra.Command{
		Use:   "info",
		Short: "Identity, capacity, runtimes, storage and sandbox counts",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				info, err := c.Info(ctx, &pb.InfoRequest{})
				if err != nil {
					return err
				}
				health, err := c.Health(ctx, &pb.HealthRequest{})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(info)
				}
				var rts []string
				for _, r := range info.Runtimes {
					caps := []string{}
					if r.Pause {
						caps = append(caps, "pause")
					}
					if r.Checkpoint {
						caps = append(caps, "checkpoint")
					}
					if r.Restore {
						caps = append(caps, "restore")
					}
					if r.Detail != "" {
						caps = append(caps, r.Detail)
					}
					rts = append(rts, fmt.Sprintf("%s(%s)", r.Name, strings.Join(caps, ",")))
				}
				var states []string
				for k, v := range info.SandboxesByState {
					states = append(states, fmt.Sprintf("%s=%d", k, v))
				}
				sort.Strings(states)
				var conds []string
				for _, c := range health.Conditions {
					s := c.Type + "=ok"
					if !c.Ok {
						s = c.Type + "=FAIL: " + c.Message
					}
					conds = append(conds, s)
				}
				g.table([]string{"FIELD", "VALUE"}, [][]string{
					{"Node", info.NodeId}, {"Hostname", info.Hostname}, {"Version", info.Version},
					{"CPUs", fmt.Sprint(info.Cpus)}, {"Memory", bytesHuman(info.MemoryBytes)},
					{"Runtimes", strings.Join(rts, " ")},
					{"Storage", fmt.Sprintf("%s at %s (%s free of %s)", info.StorageMode, info.StorageDir,
						bytesHuman(info.StorageFreeBytes), bytesHuman(info.StorageTotalBytes))},
					{"Templates", fmt.Sprint(info.Templates)}, {"Sandboxes", strings.Join(states, " ")},
					{"Health", strings.Join(conds, " ")},
				})
				return nil
			})
		},
	})
	return cmd
}

func flowCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "flow", Short: "Workflow flows and their concurrency limits"}
	printFlows := func(flows []*pb.Flow) {
		var rows [][]string
		for _, f := range flows {
			var steps []string
			for _, s := range f.Steps {
				steps = append(steps, strings.Join(s.Actions, "+"))
			}
			limit := fmt.Sprint(f.Limit)
			if f.Limit == 0 {
				limit = "unlimited"
			}
			rows = append(rows, []string{f.Name, limit, fmt.Sprint(f.InFlight), strings.Join(steps, " > ")})
		}
		g.table([]string{"FLOW", "LIMIT", "IN-FLIGHT", "STEPS"}, rows)
	}
	cmd.AddCommand(&cobra.Command{
		Use:   "ls",
		Short: "List flows",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.ListFlows(ctx, &pb.ListFlowsRequest{})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp)
				}
				printFlows(resp.Flows)
				return nil
			})
		},
	}, &cobra.Command{
		Use:   "set-limit FLOW N",
		Short: "Change a flow's concurrency limit now (0 = unlimited)",
		Args:  exactArgs(2, "a flow name and a limit"),
		RunE: func(cmd *cobra.Command, args []string) error {
			var n int32
			if _, err := fmt.Sscan(args[1], &n); err != nil {
				return usageError{fmt.Errorf("limit %q: %v", args[1], err)}
			}
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.SetFlowLimit(ctx, &pb.SetFlowLimitRequest{Flow: args[0], Limit: n})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp.Flow)
				}
				printFlows([]*pb.Flow{resp.Flow})
				return nil
			})
		},
	})
	return cmd
}
