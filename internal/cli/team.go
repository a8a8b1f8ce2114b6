package cli

import (
	"context"
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
)

// quotaFlags are a team's limits on the command line; 0 is no limit.
type quotaFlags struct {
	sandboxes, vcpu, memoryMiB int64
}

func (q *quotaFlags) add(cmd *cobra.Command) {
	cmd.Flags().Int64Var(&q.sandboxes, "max-sandboxes", 0, "most sandboxes the team may hold at once (creating, running and paused); 0: no limit")
	cmd.Flags().Int64Var(&q.vcpu, "max-vcpu", 0, "most vCPUs its sandboxes may hold together; 0: no limit")
	cmd.Flags().Int64Var(&q.memoryMiB, "max-memory-mib", 0, "most memory (MiB) its sandboxes may hold together; 0: no limit")
}

func (q *quotaFlags) pb() *masterpb.TeamQuota {
	return &masterpb.TeamQuota{MaxSandboxes: q.sandboxes, MaxMilliCpu: q.vcpu * 1000, MaxMemoryMib: q.memoryMiB}
}

func limit(v int64, unit string) string {
	if v == 0 {
		return "-"
	}
	return strconv.FormatInt(v, 10) + unit
}

func teamRow(t *masterpb.Team) []string {
	q := t.GetQuota()
	return []string{
		t.Name,
		fmt.Sprintf("%d/%s", t.Sandboxes, limit(q.GetMaxSandboxes(), "")),
		fmt.Sprintf("%d/%s", t.MilliCpu, limit(q.GetMaxMilliCpu(), "")),
		fmt.Sprintf("%dMiB/%s", t.MemoryMib, limit(q.GetMaxMemoryMib(), "MiB")),
		age(t.CreatedAt.AsTime()),
	}
}

var teamHeader = []string{"NAME", "SANDBOXES", "MILLICPU", "MEMORY", "AGE"}

// teamCmd: teams are the E2B API's tenants. A key belongs to one and sees
// only its sandboxes and snapshots; quotas bound what the team holds.
func teamCmd(c *cluster) *cobra.Command {
	cmd := &cobra.Command{Use: "team", Short: "Teams (tenants of the E2B API) and their quotas, through cubemaster"}
	var cq, sq quotaFlags
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a team; give it keys with cubecli apikey create --team NAME",
		Args:  exactArgs(1, "a team name"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.CreateTeam(ctx, &masterpb.CreateTeamRequest{Name: args[0], Quota: cq.pb()})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp)
				}
				fmt.Fprintln(c.g.out, resp.Team.Name)
				return nil
			})
		},
	}
	cq.add(create)
	quota := &cobra.Command{
		Use:   "quota NAME",
		Short: "Replace a team's quota (flags left out: no limit)",
		Args:  exactArgs(1, "a team name"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				if _, err := a.SetTeamQuota(ctx, &masterpb.SetTeamQuotaRequest{Name: args[0], Quota: sq.pb()}); err != nil {
					return err
				}
				if !c.g.json() {
					fmt.Fprintln(c.g.out, args[0])
				}
				return nil
			})
		},
	}
	sq.add(quota)
	var force bool
	del := &cobra.Command{
		Use:     "delete NAME",
		Aliases: []string{"rm"},
		Short:   "Delete a team and revoke its API keys; refused while it holds sandboxes or snapshots unless --force",
		Args:    exactArgs(1, "a team name"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.DeleteTeam(ctx, &masterpb.DeleteTeamRequest{Name: args[0], Force: force})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp)
				}
				fmt.Fprintf(c.g.out, "%s: %d keys revoked, %d sandboxes killed, %d snapshots deleted\n",
					args[0], len(resp.RevokedKeys), len(resp.KilledSandboxes), len(resp.DeletedSnapshots))
				return nil
			})
		},
	}
	del.Flags().BoolVar(&force, "force", false, "kill the team's sandboxes and delete its snapshots first")
	cmd.AddCommand(create, quota, del, &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List teams with what they hold and their limits (used/limit, - for none)",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.ListTeams(ctx, &masterpb.ListTeamsRequest{})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp)
				}
				rows := [][]string{}
				for _, t := range resp.Teams {
					rows = append(rows, teamRow(t))
				}
				c.g.table(teamHeader, rows)
				return nil
			})
		},
	})
	return cmd
}
