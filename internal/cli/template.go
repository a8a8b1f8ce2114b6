package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

func templateCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "template", Aliases: []string{"tpl"}, Short: "Import and manage templates"}
	cmd.AddCommand(templateImport(g), templateList(g), templateInspect(g), templateWarm(g), templateRemove(g))
	return cmd
}

var templateHeaders = []string{"ID", "DIGEST", "SIZE", "RUNTIME", "WARM", "POOL", "AGE", "SOURCE"}

func templateRow(t *pb.Template) []string {
	d := t.Digest
	if len(d) > 19 {
		d = d[:19]
	}
	rt := t.Runtime
	if rt == "" {
		rt = "(default)"
	}
	warm := "no"
	if t.Warm {
		warm = "yes"
	}
	return []string{t.Id, d, bytesHuman(t.SizeBytes), rt, warm, strconv.Itoa(int(t.PoolReady)), age(t.CreatedAt.AsTime()), t.Source}
}

func templateImport(g *globals) *cobra.Command {
	var (
		quiet, insecure, passwordStdin, warm bool
		image, username, password, runtime   string
	)
	cmd := &cobra.Command{
		Use:   "import ID [SOURCE] | import ID --image REF",
		Short: "Import a template from a local OCI layout dir or OCI/docker tar, or from a registry",
		Long: `Import a template. SOURCE is a path on the cubelet's node: an OCI image
layout directory or an OCI/docker-archive tar. --image pulls REF
(host/repo:tag or host/repo@sha256:...) from a registry instead.

Importing an existing ID again with the same image returns the existing
template; an image already imported under another ID is reused (cloned),
not extracted again. Progress (phase, layer i/N, bytes) goes to stderr.`,
		Example: `  cubecli template import busybox /var/lib/cube/images/busybox-oci
  cubecli template import app --image registry.example.com/team/app@sha256:<digest> --username ci --password-stdin <token.txt
  cubecli template import dev --image 127.0.0.1:5000/dev:latest --insecure`,
		Args: func(_ *cobra.Command, args []string) error {
			switch {
			case image == "" && len(args) != 2:
				return usageError{fmt.Errorf("expected a template ID and a source path (or --image REF)")}
			case image != "" && len(args) != 1:
				return usageError{fmt.Errorf("expected a template ID only: --image replaces SOURCE")}
			case image == "" && (username != "" || password != "" || passwordStdin || insecure):
				return usageError{fmt.Errorf("--username, --password, --password-stdin and --insecure need --image")}
			case password != "" && passwordStdin:
				return usageError{fmt.Errorf("--password and --password-stdin are exclusive")}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &pb.ImportTemplateRequest{TemplateId: args[0], ImageRef: image, Insecure: insecure, Runtime: runtime, Warm: warm}
			if len(args) == 2 {
				req.Source = args[1]
			}
			if passwordStdin {
				line, err := bufio.NewReader(cmd.InOrStdin()).ReadString('\n')
				if err != nil && err != io.EOF {
					return fmt.Errorf("read password from stdin: %w", err)
				}
				password = strings.TrimRight(line, "\r\n")
			}
			if username != "" || password != "" {
				req.Auth = &pb.RegistryAuth{Username: username, Password: password}
			}
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				stream, err := c.ImportTemplate(ctx, req)
				if err != nil {
					return err
				}
				pp := newProgressPrinter(cmd.ErrOrStderr(), quiet)
				for {
					ev, err := stream.Recv()
					if errors.Is(err, io.EOF) {
						return fmt.Errorf("import ended without a template")
					}
					if err != nil {
						pp.end()
						return err
					}
					if p := ev.GetProgress(); p != nil {
						pp.show(p)
						continue
					}
					pp.end()
					t := ev.GetTemplate()
					if g.json() {
						return g.printJSON(t)
					}
					g.table(templateHeaders, [][]string{templateRow(t)})
					return nil
				}
			})
		},
	}
	f := cmd.Flags()
	f.BoolVarP(&quiet, "quiet", "q", false, "no progress output")
	f.StringVar(&image, "image", "", "registry image reference to pull instead of a local SOURCE")
	f.StringVar(&username, "username", "", "registry user name")
	f.StringVar(&password, "password", "", "registry password or token (visible in ps: prefer --password-stdin)")
	f.BoolVar(&passwordStdin, "password-stdin", false, "read the registry password or token from the first line of stdin")
	f.BoolVar(&insecure, "insecure", false, "allow plain HTTP to the registry")
	f.StringVar(&runtime, "runtime", "", "runtime creates from this template use when they name none (node default when empty)")
	f.BoolVar(&warm, "warm", false, "warm the template after the import (see 'template warm')")
	return cmd
}

func templateWarm(g *globals) *cobra.Command {
	var runtime string
	cmd := &cobra.Command{
		Use:   "warm ID",
		Short: "Boot the template once and keep a memory snapshot: creates from it restore instead of booting",
		Long: `Boot a sandbox from the template, wait for its agent, take a memory
snapshot and destroy the sandbox. Creates from the template (on that
runtime) then restore the snapshot instead of booting. Warming again
replaces the snapshot; deleting the template deletes it. The runtime must
take memory snapshots (gvisor with checkpoints on, vm); runc cannot.`,
		Example: `  cubecli template warm base --runtime vm`,
		Args:    exactArgs(1, "a template ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.WarmTemplate(ctx, &pb.WarmTemplateRequest{TemplateId: args[0], Runtime: runtime})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp.Template)
				}
				g.table(templateHeaders, [][]string{templateRow(resp.Template)})
				return nil
			})
		},
	}
	cmd.Flags().StringVar(&runtime, "runtime", "", "runtime to warm it on (the template's, else the node default)")
	return cmd
}

// progressPrinter rewrites one status line on a terminal; elsewhere (logs,
// CI) it prints a line per phase or layer, never one per byte count.
type progressPrinter struct {
	w        io.Writer
	tty      bool
	last     string // phase+layer of the last line printed (non-tty)
	shown    bool
	disabled bool
}

func newProgressPrinter(w io.Writer, quiet bool) *progressPrinter {
	p := &progressPrinter{w: w, disabled: quiet}
	if f, ok := w.(*os.File); ok {
		_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
		p.tty = err == nil
	}
	return p
}

func (p *progressPrinter) show(ev *pb.ImportProgress) {
	if p.disabled {
		return
	}
	line := progressLine(ev)
	if p.tty {
		fmt.Fprintf(p.w, "\r%-60s", line)
		p.shown = true
		return
	}
	key := fmt.Sprintf("%s %d", ev.Phase, ev.Layer)
	if key != p.last {
		p.last = key
		fmt.Fprintln(p.w, line)
	}
}

func (p *progressPrinter) end() {
	if p.shown {
		fmt.Fprintln(p.w)
		p.shown = false
	}
}

func progressLine(p *pb.ImportProgress) string {
	var b strings.Builder
	b.WriteString(p.Phase)
	if p.Layers > 0 {
		fmt.Fprintf(&b, " layer %d/%d", p.Layer, p.Layers)
	}
	if p.Total > 0 {
		fmt.Fprintf(&b, " %s/%s", bytesHuman(p.Bytes), bytesHuman(p.Total))
	} else if p.Bytes > 0 {
		fmt.Fprintf(&b, " %s", bytesHuman(p.Bytes))
	}
	return b.String()
}

func templateList(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List templates",
		Args:    exactArgs(0, "no arguments"),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.ListTemplates(ctx, &pb.ListTemplatesRequest{})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp)
				}
				var rows [][]string
				for _, t := range resp.Templates {
					rows = append(rows, templateRow(t))
				}
				g.table(templateHeaders, rows)
				return nil
			})
		},
	}
}

func templateInspect(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "inspect ID",
		Short: "Show one template",
		Args:  exactArgs(1, "a template ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				resp, err := c.GetTemplate(ctx, &pb.GetTemplateRequest{TemplateId: args[0]})
				if err != nil {
					return err
				}
				if g.json() {
					return g.printJSON(resp.Template)
				}
				t := resp.Template
				g.table([]string{"FIELD", "VALUE"}, [][]string{
					{"ID", t.Id}, {"Digest", t.Digest}, {"Source", t.Source}, {"Size", bytesHuman(t.SizeBytes)},
					{"Entrypoint", strings.Join(t.Entrypoint, " ")}, {"Cmd", strings.Join(t.Cmd, " ")},
					{"WorkingDir", t.WorkingDir}, {"User", t.User}, {"Env", strings.Join(t.Env, " ")},
					{"Runtime", t.Runtime}, {"Warm snapshot", t.WarmSnapshotId},
				})
				return nil
			})
		},
	}
}

func templateRemove(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:     "rm ID",
		Aliases: []string{"delete"},
		Short:   "Remove a template no sandbox uses",
		Args:    exactArgs(1, "a template ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				if _, err := c.DeleteTemplate(ctx, &pb.DeleteTemplateRequest{TemplateId: args[0]}); err != nil {
					return err
				}
				if !g.json() {
					fmt.Fprintln(g.out, args[0])
				}
				return nil
			})
		},
	}
}
