package cli

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
)

func templateCmd(g *globals) *cobra.Command {
	cmd := &cobra.Command{Use: "template", Aliases: []string{"tpl"}, Short: "Import and manage templates"}
	cmd.AddCommand(templateImport(g), templateList(g), templateInspect(g), templateRemove(g))
	return cmd
}

var templateHeaders = []string{"ID", "DIGEST", "SIZE", "AGE", "SOURCE"}

func templateRow(t *pb.Template) []string {
	d := t.Digest
	if len(d) > 19 {
		d = d[:19]
	}
	return []string{t.Id, d, bytesHuman(t.SizeBytes), age(t.CreatedAt.AsTime()), t.Source}
}

func templateImport(g *globals) *cobra.Command {
	var quiet bool
	cmd := &cobra.Command{
		Use:   "import ID SOURCE",
		Short: "Import a local OCI image layout dir or OCI/docker tar as a template",
		Args:  exactArgs(2, "a template ID and a source path"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.call(cmd, func(ctx context.Context, c pb.CubeletServiceClient) error {
				stream, err := c.ImportTemplate(ctx, &pb.ImportTemplateRequest{TemplateId: args[0], Source: args[1]})
				if err != nil {
					return err
				}
				progress := cmd.ErrOrStderr()
				if quiet {
					progress = io.Discard
				}
				for {
					ev, err := stream.Recv()
					if err == io.EOF {
						return fmt.Errorf("import ended without a template")
					}
					if err != nil {
						fmt.Fprintln(progress)
						return err
					}
					if p := ev.GetProgress(); p != nil {
						fmt.Fprintf(progress, "\r%-40s", progressLine(p))
						continue
					}
					fmt.Fprintln(progress)
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
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "no progress output")
	return cmd
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
