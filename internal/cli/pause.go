package cli

import (
	"context"

	"github.com/spf13/cobra"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

// sandboxPause is `sandbox pause [--to-disk] ID`.
func sandboxPause(g *globals) *cobra.Command {
	var toDisk bool
	cmd := &cobra.Command{
		Use:   "pause ID",
		Short: "Freeze a running sandbox (--to-disk: write its memory to disk and free it)",
		Args:  exactArgs(1, "a sandbox ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				mode := pb.PauseMode_PAUSE_MODE_MEMORY
				if toDisk {
					mode = pb.PauseMode_PAUSE_MODE_DISK
				}
				resp, err := c.PauseSandbox(ctx, &pb.PauseSandboxRequest{SandboxId: args[0], Mode: mode})
				if err != nil {
					return err
				}
				return g.printSandbox(resp.Sandbox, resp.Timings)
			})
		},
	}
	cmd.Flags().BoolVar(&toDisk, "to-disk", false, "write the memory image to disk and stop the runtime (gvisor, vm); resume restores it")
	return cmd
}
