// Package cli is cubecli: operator commands against a cubelet. Output is a
// table by default and JSON with -o json; the exit code tells scripts what
// went wrong (see ExitCode).
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// Exit codes. Stable: scripts depend on them.
const (
	ExitOK                 = 0
	ExitError              = 1 // anything not below
	ExitUsage              = 2 // bad flags or arguments, InvalidArgument
	ExitNotFound           = 3
	ExitAlreadyExists      = 4
	ExitFailedPrecondition = 5 // e.g. pausing a paused sandbox
	ExitResourceExhausted  = 6 // over a concurrency limit: retry later
	ExitUnavailable        = 7 // cubelet unreachable or a sandbox not ready
)

// ExitCode maps an error from a command to the process exit code. A
// status from cubelet or cubemaster is classified by its errdefs kind
// (grpcerr.FromGRPC); any other error is ExitError.
func ExitCode(err error) int {
	if err == nil {
		return ExitOK
	}
	var ue usageError
	if errors.As(err, &ue) {
		return ExitUsage
	}
	if _, ok := status.FromError(err); !ok {
		return ExitError
	}
	err = grpcerr.FromGRPC(err)
	switch {
	case errdefs.IsInvalidArgument(err):
		return ExitUsage
	case errdefs.IsNotFound(err):
		return ExitNotFound
	case errdefs.IsAlreadyExists(err):
		return ExitAlreadyExists
	case errdefs.IsFailedPrecondition(err):
		return ExitFailedPrecondition
	case errdefs.IsResourceExhausted(err):
		return ExitResourceExhausted
	case errdefs.IsUnavailable(err), errors.Is(err, context.DeadlineExceeded):
		return ExitUnavailable
	}
	return ExitError
}

type usageError struct{ error }

// Main runs cubecli with args and returns the exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	root := NewRoot(stdout)
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := root.ExecuteContext(ctx)
	if err != nil {
		msg := err.Error()
		if st, ok := status.FromError(err); ok {
			msg = fmt.Sprintf("%s (%s)", st.Message(), st.Code())
		}
		fmt.Fprintln(stderr, "error:", msg)
	}
	return ExitCode(err)
}

type globals struct {
	addr    string
	tls     serve.TLSFiles
	output  string
	timeout time.Duration
	out     io.Writer
}

// NewRoot builds the command tree.
func NewRoot(out io.Writer) *cobra.Command {
	g := &globals{out: out}
	root := &cobra.Command{
		Use:           "cubecli",
		Short:         "Operate cube sandboxes, templates and nodes",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			if g.output != "table" && g.output != "json" {
				return usageError{fmt.Errorf("-o must be table or json, not %q", g.output)}
			}
			return nil
		},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	def := os.Getenv("CUBELET_ADDR")
	if def == "" {
		def = "/run/cube/cubelet.sock"
	}
	root.PersistentFlags().StringVar(&g.addr, "addr", def, "cubelet address: socket path, unix:///path or host:port (env CUBELET_ADDR)")
	root.PersistentFlags().StringVarP(&g.output, "output", "o", "table", "output format: table or json")
	root.PersistentFlags().StringVar(&g.tls.Cert, "tls-cert", os.Getenv("CUBE_TLS_CERT"), "certificate (PEM, signed by the cluster CA) for a cubelet or master at host:port with [tls] (env CUBE_TLS_CERT)")
	root.PersistentFlags().StringVar(&g.tls.Key, "tls-key", os.Getenv("CUBE_TLS_KEY"), "its key (PEM; env CUBE_TLS_KEY)")
	root.PersistentFlags().StringVar(&g.tls.CA, "tls-ca", os.Getenv("CUBE_TLS_CA"), "the cluster CA (PEM; env CUBE_TLS_CA)")
	root.PersistentFlags().DurationVar(&g.timeout, "timeout", 5*time.Minute, "give up after this long")
	root.AddCommand(sandboxCmd(g), templateCmd(g), nodeCmd(g), flowCmd(g), snapshotCmd(g))
	addCluster(root, g)
	return root
}

// call dials cubelet and runs fn with a client and a deadline.
func (g *globals) call(cmd *cobra.Command, fn func(ctx context.Context, c pb.CubeletServiceClient) error) error {
	tc, err := g.tls.Client("--tls-*")
	if err != nil {
		return usageError{err}
	}
	// Only a node's certificate answers for a cubelet.
	conn, err := cubeletclient.DialTLS(g.addr, pki.ExpectPeer(tc, "", pki.RoleNode))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(cmd.Context(), g.timeout)
	defer cancel()
	return fn(ctx, cubeletclient.New(conn))
}

// printJSON writes a protobuf message as indented JSON.
func (g *globals) printJSON(m proto.Message) error {
	b, err := protojson.MarshalOptions{Multiline: true, Indent: "  ", EmitUnpopulated: false}.Marshal(m)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(g.out, string(b))
	return err
}

// table prints rows under headers, aligned.
func (g *globals) table(headers []string, rows [][]string) {
	tw := tabwriter.NewWriter(g.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(headers, "\t"))
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	tw.Flush()
}

func (g *globals) json() bool { return g.output == "json" }

func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != n {
			return usageError{fmt.Errorf("expected %s", what)}
		}
		return nil
	}
}

func parseKV(pairs []string, what string) (map[string]string, error) {
	if len(pairs) == 0 {
		return nil, nil
	}
	m := map[string]string{}
	for _, p := range pairs {
		k, v, ok := strings.Cut(p, "=")
		if !ok || k == "" {
			return nil, usageError{fmt.Errorf("%s %q: want KEY=VALUE", what, p)}
		}
		m[k] = v
	}
	return m, nil
}

func age(t time.Time) string {
	d := time.Since(t).Round(time.Second)
	switch {
	case d < time.Minute:
		return d.String()
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

func bytesHuman(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%dB", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f%ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
