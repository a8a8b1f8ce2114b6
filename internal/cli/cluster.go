package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// Cluster commands talk to cubemaster (its admin API) instead of the local
// cubelet:
//
//	cubecli apikey create NAME [--team T] [--admin] | ls | rm KEY
//	cubecli team create NAME [--max-sandboxes N --max-vcpu N --max-memory-mib N] | ls | quota NAME ... | delete NAME [--force]
//	cubecli node ls | cordon NODE | uncordon NODE | join-token [--node-id N] [--ttl D]
//	cubecli node drain NODE [--wait] [--parallel N]
//	cubecli sandbox ls --all-nodes
//	cubecli template ls|import|rm --all-nodes   (import: --node N for one node,
//	                                            --source-on-nodes for a path on each node,
//	                                            --upload for a path here)
//
// The master is --master (env CUBEMASTER_ADDR): its unix socket (the
// default, root only) or host:port with --admin-token (env CUBEMASTER_TOKEN).

type cluster struct {
	g     *globals
	addr  string
	token string
}

// addCluster adds the cluster commands and the --all-nodes forms of the
// node commands that have one.
func addCluster(root *cobra.Command, g *globals) {
	c := &cluster{g: g}
	def := os.Getenv("CUBEMASTER_ADDR")
	if def == "" {
		def = "/run/cube/cubemaster.sock"
	}
	root.PersistentFlags().StringVar(&c.addr, "master", def, "cubemaster admin address: socket path, unix:///path or host:port (env CUBEMASTER_ADDR)")
	root.PersistentFlags().StringVar(&c.token, "admin-token", os.Getenv("CUBEMASTER_TOKEN"), "cubemaster admin token, for host:port (env CUBEMASTER_TOKEN)")
	root.AddCommand(apikeyCmd(c), teamCmd(c))
	if node := findCmd(root, "node"); node != nil {
		node.AddCommand(nodeList(c), nodeCordon(c, "cordon", false), nodeCordon(c, "uncordon", true), nodeDrain(c), nodeJoinToken(c))
	}
	allNodes(findCmd(root, "sandbox", "ls"), "list the catalog of cubemaster: every sandbox on every node", c.sandboxList)
	allNodes(findCmd(root, "template", "ls"), "list the templates of every node, through cubemaster", c.templateList)
	allNodes(findCmd(root, "template", "rm"), "remove the template from every node that has it, through cubemaster", c.templateRemove)
	if imp := findCmd(root, "template", "import"); imp != nil {
		imp.Flags().String("node", "", "with --all-nodes: import on this node only")
		imp.Flags().Bool("upload", false, "with --all-nodes: SOURCE is a path here (OCI layout dir, OCI or docker archive), sent to cubemaster")
		imp.Flags().Bool("source-on-nodes", false, "with --all-nodes: SOURCE is a path on each node, imported there (cubemaster's template store is left out)")
		allNodes(imp, "import through cubemaster: it reads SOURCE (a path on the master) or pulls --image into its template store, and every node, later ones included, pulls it from there", c.templateImport)
	}
}

func findCmd(root *cobra.Command, path ...string) *cobra.Command {
	cmd, rest, err := root.Find(path)
	if err != nil || len(rest) > 0 || cmd == root {
		return nil
	}
	return cmd
}

// allNodes gives a node command an --all-nodes flag that runs cluster
// instead of the command's own RunE.
func allNodes(cmd *cobra.Command, usage string, cluster func(*cobra.Command, []string) error) {
	if cmd == nil {
		return
	}
	var all bool
	cmd.Flags().BoolVar(&all, "all-nodes", false, usage)
	own := cmd.RunE
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if all {
			return cluster(cmd, args)
		}
		return own(cmd, args)
	}
}

// call dials cubemaster's admin API and runs fn with a deadline.
func (c *cluster) call(cmd *cobra.Command, fn func(ctx context.Context, a masterpb.AdminServiceClient) error) error {
	target := c.addr
	if strings.HasPrefix(target, "/") {
		target = "unix://" + target
	}
	tc, err := c.g.tls.Client("--tls-*")
	if err != nil {
		return usageError{err}
	}
	creds := insecure.NewCredentials()
	if tc != nil && !strings.HasPrefix(target, "unix:") {
		// Only a master's certificate answers for the master.
		creds = serve.ClientCredentials(pki.ExpectPeer(tc, "", pki.RoleMaster))
	}
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(creds))
	if err != nil {
		return usageError{fmt.Errorf("--master %q: %v", c.addr, err)}
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(cmd.Context(), c.g.timeout)
	defer cancel()
	if c.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, masterpb.AdminTokenHeader, c.token)
	}
	return fn(ctx, masterpb.NewAdminServiceClient(conn))
}

func apikeyCmd(c *cluster) *cobra.Command {
	cmd := &cobra.Command{Use: "apikey", Short: "API keys for the E2B API (X-API-Key), through cubemaster"}
	var admin bool
	var team string
	create := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a key; its secret is printed once and only its hash is kept",
		Args:  exactArgs(1, "a key name"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.CreateAPIKey(ctx, &masterpb.CreateAPIKeyRequest{Name: args[0], Admin: admin, Team: team})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp)
				}
				fmt.Fprintln(c.g.out, resp.Secret)
				return nil
			})
		},
	}
	create.Flags().BoolVar(&admin, "admin", false, "an admin key: may also do the E2B API's admin operations (template delete)")
	create.Flags().StringVar(&team, "team", "", "the team the key belongs to (cubecli team create); it sees only that team's sandboxes (default \"default\")")
	cmd.AddCommand(create, &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List keys (never their secrets)",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.ListAPIKeys(ctx, &masterpb.ListAPIKeysRequest{})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp)
				}
				rows := [][]string{}
				for _, k := range resp.Keys {
					used := "never"
					if k.LastUsedAt != nil {
						used = age(k.LastUsedAt.AsTime()) + " ago"
					}
					rows = append(rows, []string{k.Id, k.Name, k.Team, k.Prefix + "…", strconv.FormatBool(k.Admin), age(k.CreatedAt.AsTime()), used})
				}
				c.g.table([]string{"ID", "NAME", "TEAM", "PREFIX", "ADMIN", "AGE", "LAST USED"}, rows)
				return nil
			})
		},
	}, &cobra.Command{
		Use:     "rm KEY",
		Aliases: []string{"delete"},
		Short:   "Revoke a key by ID or name",
		Args:    exactArgs(1, "a key ID or name"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				if _, err := a.DeleteAPIKey(ctx, &masterpb.DeleteAPIKeyRequest{Key: args[0]}); err != nil {
					return err
				}
				if !c.g.json() {
					fmt.Fprintln(c.g.out, args[0])
				}
				return nil
			})
		},
	})
	return cmd
}

func nodeRow(n *masterpb.Node) []string {
	r := n.Report
	health := "healthy"
	if !n.Healthy {
		health = "unhealthy: " + n.Reason
	}
	sched := "yes"
	if !n.Schedulable {
		sched = "cordoned"
	}
	var rts []string
	for _, rt := range r.Runtimes {
		rts = append(rts, rt.Name)
	}
	seen := "-"
	if n.LastHeartbeat != nil {
		seen = age(n.LastHeartbeat.AsTime()) + " ago"
	}
	return []string{r.NodeId, health, sched, r.Address, strings.Join(rts, ","),
		fmt.Sprintf("%d/%d", r.AllocatedMilliCpu, r.Cpus*1000), fmt.Sprintf("%dMiB/%s", r.AllocatedMemoryMib, bytesHuman(r.MemoryBytes)),
		fmt.Sprint(n.Sandboxes), fmt.Sprint(len(r.Templates)), seen}
}

var nodeHeaders = []string{"NODE", "HEALTH", "SCHEDULABLE", "ADDRESS", "RUNTIMES", "CPU(m)", "MEMORY", "SANDBOXES", "TEMPLATES", "HEARTBEAT"}

func nodeList(c *cluster) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the nodes registered with cubemaster, with health and usage",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.ListNodes(ctx, &masterpb.ListNodesRequest{})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp)
				}
				rows := [][]string{}
				for _, n := range resp.Nodes {
					rows = append(rows, nodeRow(n))
				}
				c.g.table(nodeHeaders, rows)
				return nil
			})
		},
	}
}

func nodeCordon(c *cluster, verb string, on bool) *cobra.Command {
	short := "Stop placing new sandboxes on a node (its sandboxes keep running)"
	if on {
		short = "Place new sandboxes on a node again"
	}
	return &cobra.Command{
		Use:   verb + " NODE",
		Short: short,
		Args:  exactArgs(1, "a node ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.SetNodeSchedulable(ctx, &masterpb.SetNodeSchedulableRequest{NodeId: args[0], Schedulable: on})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp.Node)
				}
				c.g.table(nodeHeaders, [][]string{nodeRow(resp.Node)})
				return nil
			})
		},
	}
}

// drainRow is one progress line of a drain, in the columns of
// drainHeaders (fixed widths: lines are printed as they come).
func drainRow(p *masterpb.DrainNodeProgress) string {
	took := "-"
	if d := p.GetTook().AsDuration(); d > 0 {
		took = d.Round(time.Millisecond).String()
	}
	left := fmt.Sprintf("%d/%d", p.Remaining, p.Total)
	return fmt.Sprintf("%-26s  %-8s  %-8s  %-24s  %-9s  %-7s  %s", orDash(p.SandboxId), orDash(p.State), p.Phase,
		orDash(p.ToNode), took, left, p.Error)
}

var drainHeaders = fmt.Sprintf("%-26s  %-8s  %-8s  %-24s  %-9s  %-7s  %s", "SANDBOX", "STATE", "PHASE", "TO", "TOOK", "LEFT", "ERROR")

func nodeDrain(c *cluster) *cobra.Command {
	var wait bool
	var parallel int32
	var requestWait time.Duration
	cmd := &cobra.Command{
		Use:   "drain NODE",
		Short: "Cordon a node and move its sandboxes to other nodes (same ID and URL), showing each step",
		Long: `Cordon NODE, then move each of its sandboxes to another node under the same
ID, so clients reach it at the same URL through the route: a running sandbox
is paused, shipped through the object store and runs again elsewhere with
its deadline (its clients see a pause); a paused one moves and stays paused.
With --wait, running sandboxes are left to end and only paused ones move.
Before a running sandbox freezes, new requests to it through the proxies
wait for the move and those in flight get up to --request-wait (the
master's [drain] request_wait when not given; 0: none) to finish.

The drain is refused, with nothing changed, when some sandbox has no other
node that could take it (template, runtime, room). A sandbox whose move
fails stays on the node, running; the command then exits non-zero naming
it. The drain lasts as long as the command (--timeout); the node stays
cordoned, and running drain again continues. One line per step (-o json:
one JSON object per line).`,
		Args: exactArgs(1, "a node ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				req := &masterpb.DrainNodeRequest{NodeId: args[0], Wait: wait, Parallel: parallel, RequestWaitMs: requestWait.Milliseconds()}
				if cmd.Flags().Changed("request-wait") && requestWait <= 0 {
					req.RequestWaitMs = -1 // no wait (0 in the request is the master's setting)
				}
				st, err := a.DrainNode(ctx, req)
				if err != nil {
					return err
				}
				header := false
				for {
					p, err := st.Recv()
					if errors.Is(err, io.EOF) {
						return nil
					}
					if err != nil {
						return err
					}
					if c.g.json() {
						b, err := protojson.Marshal(p)
						if err != nil {
							return err
						}
						fmt.Fprintln(c.g.out, string(b))
						continue
					}
					if !header {
						fmt.Fprintln(c.g.out, drainHeaders)
						header = true
					}
					if p.Phase == "done" {
						fmt.Fprintf(c.g.out, "node %s drained: %d sandboxes moved or ended\n", p.NodeId, p.Total)
						continue
					}
					fmt.Fprintln(c.g.out, drainRow(p))
				}
			})
		},
	}
	cmd.Flags().BoolVar(&wait, "wait", false, "leave running sandboxes to end (deadline, kill) instead of moving them; paused ones still move")
	cmd.Flags().Int32Var(&parallel, "parallel", 4, "sandboxes moved at once")
	cmd.Flags().DurationVar(&requestWait, "request-wait", 0, "how long a running sandbox's move waits for requests in flight to it to finish before it freezes, at most 1m (default: the master's [drain] request_wait; 0: no wait)")
	return cmd
}

func nodeJoinToken(c *cluster) *cobra.Command {
	var nodeID string
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:   "join-token",
		Short: "Make a one-time token with which a new node gets its certificate (cube join on the node)",
		Args:  exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
				resp, err := a.CreateJoinToken(ctx, &masterpb.CreateJoinTokenRequest{NodeId: nodeID, Ttl: durationpb.New(ttl)})
				if err != nil {
					return err
				}
				if c.g.json() {
					return c.g.printJSON(resp)
				}
				fmt.Fprintln(c.g.out, resp.Token)
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&nodeID, "node-id", "", "the only node ID the token may be used for (needed for a node already registered)")
	cmd.Flags().DurationVar(&ttl, "ttl", time.Hour, "how long the token is valid")
	return cmd
}

func (c *cluster) sandboxList(cmd *cobra.Command, _ []string) error {
	states, _ := cmd.Flags().GetStringSlice("state")
	labels, _ := cmd.Flags().GetStringArray("label")
	md, err := parseKV(labels, "label")
	if err != nil {
		return err
	}
	req := &masterpb.ListSandboxesRequest{Metadata: md}
	for _, s := range states {
		req.States = append(req.States, strings.ToLower(s))
	}
	return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
		resp, err := a.ListSandboxes(ctx, req)
		if err != nil {
			return err
		}
		if c.g.json() {
			return c.g.printJSON(resp)
		}
		rows := [][]string{}
		for _, s := range resp.Sandboxes {
			left := "-"
			if s.State == "running" && s.EndAt != nil {
				left = time.Until(s.EndAt.AsTime()).Round(time.Second).String()
			}
			rows = append(rows, []string{s.SandboxId, s.Team, s.TemplateId, s.State, s.NodeId, orDash(s.Runtime),
				fmt.Sprintf("%.2f", float64(s.MilliCpu)/1000), fmt.Sprintf("%dMiB", s.MemoryMib),
				age(s.StartedAt.AsTime()), left, labelsString(s.Metadata)})
		}
		c.g.table([]string{"ID", "TEAM", "TEMPLATE", "STATE", "NODE", "RUNTIME", "CPU", "MEMORY", "AGE", "EXPIRES IN", "METADATA"}, rows)
		return nil
	})
}

func (c *cluster) printTemplates(ts []*masterpb.ClusterTemplate) error {
	if c.g.json() {
		return c.g.printJSON(&masterpb.ListTemplatesResponse{Templates: ts})
	}
	sort.Slice(ts, func(i, j int) bool { return ts[i].TemplateId < ts[j].TemplateId })
	rows := [][]string{}
	for _, t := range ts {
		d := t.Digest
		if len(d) > 19 {
			d = d[:19]
		}
		rows = append(rows, []string{t.TemplateId, d, bytesHuman(t.SizeBytes), clusterTemplateRuntime(t),
			fmt.Sprintf("%d/%d", len(t.WarmNodes), len(t.Nodes)), strings.Join(t.Nodes, ",")})
	}
	c.g.table([]string{"ID", "DIGEST", "SIZE", "RUNTIME", "WARM", "NODES"}, rows)
	return nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// clusterTemplateRuntime is the runtime the nodes' copies are for: one
// name when they agree, "default" for the node default, else per node.
func clusterTemplateRuntime(t *masterpb.ClusterTemplate) string {
	seen := map[string]bool{}
	for _, n := range t.Nodes {
		seen[t.Runtimes[n]] = true
	}
	if len(seen) == 1 {
		for rt := range seen {
			if rt == "" {
				return "default"
			}
			return rt
		}
	}
	var parts []string
	for _, n := range t.Nodes {
		rt := t.Runtimes[n]
		if rt == "" {
			rt = "default"
		}
		parts = append(parts, n+"="+rt)
	}
	return strings.Join(parts, ",")
}

func (c *cluster) templateList(cmd *cobra.Command, _ []string) error {
	return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
		resp, err := a.ListTemplates(ctx, &masterpb.ListTemplatesRequest{})
		if err != nil {
			return err
		}
		return c.printTemplates(resp.Templates)
	})
}

func (c *cluster) templateImport(cmd *cobra.Command, args []string) error {
	img, _ := cmd.Flags().GetString("image")
	onNodes, _ := cmd.Flags().GetBool("source-on-nodes")
	if onNodes && img != "" {
		return usageError{fmt.Errorf("--source-on-nodes imports a path present on each node; --image is pulled by cubemaster")}
	}
	node, _ := cmd.Flags().GetString("node")
	runtime, _ := cmd.Flags().GetString("runtime")
	warm, _ := cmd.Flags().GetBool("warm")
	insecure, _ := cmd.Flags().GetBool("insecure")
	username, _ := cmd.Flags().GetString("username")
	password, _ := cmd.Flags().GetString("password")
	if stdin, _ := cmd.Flags().GetBool("password-stdin"); stdin {
		line, err := bufio.NewReader(cmd.InOrStdin()).ReadString('\n')
		if err != nil && err != io.EOF {
			return fmt.Errorf("read password from stdin: %w", err)
		}
		password = strings.TrimRight(line, "\r\n")
	}
	req := &masterpb.ImportTemplateRequest{TemplateId: args[0], NodeId: node, Runtime: runtime, Warm: warm,
		ImageRef: img, Insecure: insecure, SourceOnNodes: onNodes}
	if len(args) == 2 {
		req.Source = args[1]
	}
	if username != "" || password != "" {
		req.Auth = &cubeletpb.RegistryAuth{Username: username, Password: password}
	}
	if up, _ := cmd.Flags().GetBool("upload"); up {
		if len(args) != 2 || img != "" || onNodes {
			return usageError{fmt.Errorf("--upload sends SOURCE (a path here) to cubemaster: give ID SOURCE, without --image or --source-on-nodes")}
		}
		req.Source = ""
		return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
			t, err := uploadTemplate(ctx, a, req, args[1])
			if err != nil {
				return err
			}
			return c.printTemplates([]*masterpb.ClusterTemplate{t})
		})
	}
	return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
		resp, err := a.ImportTemplate(ctx, req)
		if err != nil {
			return err
		}
		return c.printTemplates([]*masterpb.ClusterTemplate{resp.Template})
	})
}

func (c *cluster) templateRemove(cmd *cobra.Command, args []string) error {
	return c.call(cmd, func(ctx context.Context, a masterpb.AdminServiceClient) error {
		resp, err := a.DeleteTemplate(ctx, &masterpb.DeleteTemplateRequest{TemplateId: args[0]})
		if err != nil {
			return err
		}
		if c.g.json() {
			return c.g.printJSON(resp)
		}
		fmt.Fprintf(c.g.out, "%s removed from %s\n", args[0], strings.Join(resp.Nodes, ","))
		return nil
	})
}
