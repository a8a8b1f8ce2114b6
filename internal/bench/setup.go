package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/bench/node"
	"github.com/cubesandbox/cube/internal/bench/report"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/testimage"
)

// NewRunID returns a short random ID for a run (sandbox labels, cgroup
// and directory names).
func NewRunID() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// KnownRuntimes are the values --runtime accepts.
var KnownRuntimes = []string{"runc", "gvisor", "vm"}

// CheckRuntime rejects a runtime the bench does not know how to set up.
func CheckRuntime(rt string) error {
	for _, k := range KnownRuntimes {
		if rt == k {
			return nil
		}
	}
	return fmt.Errorf("--runtime %q: want one of %v: %w", rt, KnownRuntimes, errdefs.ErrInvalidArgument)
}

// Setup says what a run drives.
type Setup struct {
	// Addr is a running cubelet ("" = start a private one from BinDir).
	Addr string
	// MetricsAddr is that cubelet's metrics listener (host:port), for
	// profiles and its RSS; CubeletPID, when known, is read from /proc.
	MetricsAddr string
	CubeletPID  int
	// TLS is the certificate Addr (host:port) and MetricsAddr take when
	// that cubelet has [tls] (cube up's: <state>/pki/admin.*).
	TLS serve.TLSFiles
	// BinDir holds cubelet and cube-agent.
	BinDir string
	// WorkDir holds everything the run makes; removed at the end.
	WorkDir  string
	RunID    string
	Opts     report.Options
	Progress *Progress
	Log      *slog.Logger
	// NodeTOML is appended to a private cubelet's config.
	NodeTOML string
	// VMGuestDir holds the VM guest artifacts for --runtime vm ("" = the
	// default place, else built into WorkDir).
	VMGuestDir string
}

// Prepare builds the test image, starts (or dials) the cubelet, makes
// sure the template exists, and returns the Env with its cleanup, which
// removes everything the run made (it must be called, also on failure of
// the run itself).
func Prepare(ctx context.Context, s Setup) (env *Env, cleanup func(context.Context) error, err error) {
	if err := s.Opts.Validate(); err != nil {
		return nil, nil, err
	}
	if s.RunID == "" {
		s.RunID = NewRunID()
	}
	if s.WorkDir == "" {
		s.WorkDir = filepath.Join(os.TempDir(), "cube-bench-"+s.RunID)
	}
	if s.Log == nil {
		s.Log = slog.Default()
	}
	if err := os.MkdirAll(s.WorkDir, 0o755); err != nil {
		return nil, nil, err
	}
	e := &Env{RunID: s.RunID, Opts: s.Opts, Progress: s.Progress, Log: s.Log, WorkDir: s.WorkDir, CubeletPID: s.CubeletPID}
	var nd *node.Node
	var net *node.NetAgent
	var netProc *node.NetAgentProcess
	var closeConn func() error
	cleanup = func(ctx context.Context) error {
		ctx = context.WithoutCancel(ctx)
		var errs []error
		errs = append(errs, e.Close(ctx))
		if nd != nil {
			errs = append(errs, nd.Stop(ctx))
			node.SweepRunsc(ctx, filepath.Join(nd.RunDir, "runsc"))
			errs = append(errs, nd.Teardown(ctx))
		}
		if net != nil {
			errs = append(errs, net.Close(ctx))
		}
		if netProc != nil {
			errs = append(errs, netProc.Close(ctx))
		}
		if closeConn != nil {
			errs = append(errs, closeConn())
		}
		if err := os.RemoveAll(s.WorkDir); err != nil {
			errs = append(errs, err)
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, cleanup(ctx))
			cleanup = nil
		}
	}()

	images := filepath.Join(s.WorkDir, "images")
	if e.Opts.ImageLayout, err = testimage.Busybox(ctx, images); err != nil {
		return nil, cleanup, err
	}
	e.Opts.DockerTar = filepath.Join(images, "busybox.tar")
	if err := testimage.BusyboxDockerTar(ctx, e.Opts.DockerTar); err != nil {
		return nil, cleanup, err
	}
	if e.Opts.AgentBinary == "" {
		e.Opts.AgentBinary = filepath.Join(s.BinDir, "cube-agent")
	}

	if s.Addr == "" {
		extra, err := s.runtimeSetup(ctx, &net, &netProc)
		if err != nil {
			return nil, cleanup, err
		}
		s.Progress.Note("starting a private cubelet in %s", filepath.Join(s.WorkDir, "node"))
		// node.Start removes what it made when it fails.
		n, err := node.Start(ctx, node.Config{RunID: s.RunID, BinDir: s.BinDir, Dir: filepath.Join(s.WorkDir, "node"), ExtraTOML: extra + poolTOML(e.Opts) + s.NodeTOML})
		if err != nil {
			return nil, cleanup, err
		}
		nd = n
		e.Client, e.CubeletPID, e.MetricsURL = nd.Client, nd.PID(), nd.MetricsURL
		e.node, e.net = nd, net
		if netProc != nil {
			e.NetworkAgentPID = netProc.PID()
		}
	} else {
		tc, err := s.TLS.Client("--tls-*")
		if err != nil {
			return nil, cleanup, err
		}
		// Only a node's certificate answers for a cubelet.
		tc = pki.ExpectPeer(tc, "", pki.RoleNode)
		conn, err := cubeletclient.DialTLS(s.Addr, tc)
		if err != nil {
			return nil, cleanup, err
		}
		closeConn = conn.Close
		e.Client = cubeletclient.New(conn)
		if s.MetricsAddr != "" {
			e.MetricsURL = "http://" + s.MetricsAddr
			if tc != nil {
				e.MetricsURL = "https://" + s.MetricsAddr
				e.MetricsHTTP = &http.Client{Transport: &http.Transport{TLSClientConfig: tc}}
			}
		}
	}
	if rt := e.Opts.Runtime; rt != "" {
		// Fail now, with the node's reason, rather than in every scenario.
		if err := hasRuntime(ctx, e, rt); err != nil {
			return nil, cleanup, fmt.Errorf("--runtime %s: %w (see the cubelet log)", rt, err)
		}
	}
	if _, err := e.Client.GetTemplate(ctx, &pb.GetTemplateRequest{TemplateId: e.Opts.Template}); status.Code(err) == codes.NotFound {
		if e.Opts.Template != "busybox" {
			return nil, cleanup, fmt.Errorf("template %q does not exist on the cubelet", e.Opts.Template)
		}
		// The baselines run this very image; import it so both sides
		// start the same rootfs (the cubelet must be on this host).
		s.Progress.Note("importing template busybox from %s", e.Opts.ImageLayout)
		if err := importTemplate(ctx, e.Client, "busybox", e.Opts.ImageLayout); err != nil {
			return nil, cleanup, err
		}
	} else if err != nil {
		return nil, cleanup, fmt.Errorf("template %s: %w", e.Opts.Template, err)
	}
	return e, cleanup, nil
}

// runtimeSetup starts what a private node needs for s.Opts.Runtime
// (network-agent, the VM guest) and returns the config it adds.
func (s Setup) runtimeSetup(ctx context.Context, net **node.NetAgent, proc **node.NetAgentProcess) (string, error) {
	rt := s.Opts.Runtime
	if s.Opts.DensityNet {
		s.Progress.Note("starting network-agent as its own process (--density-net)")
		n, err := node.StartNetAgentProcess(ctx, s.RunID, s.BinDir, filepath.Join(s.WorkDir, "net"))
		if err != nil {
			return "", err
		}
		*proc = n
		guest := ""
		if rt == "vm" {
			if guest, err = node.GuestDir(ctx, s.VMGuestDir, s.WorkDir); err != nil {
				return "", err
			}
		}
		return node.RuntimeTOML(rt, n.Socket(), guest), nil
	}
	if rt == "" || rt == "runc" {
		return "", nil
	}
	guest := ""
	if rt == "vm" {
		g, err := node.GuestDir(ctx, s.VMGuestDir, s.WorkDir)
		if err != nil {
			return "", err
		}
		guest = g
	}
	s.Progress.Note("starting network-agent for the %s runtime", rt)
	n, err := node.StartNetAgent(ctx, s.RunID, filepath.Join(s.WorkDir, "net"), s.Log)
	if err != nil {
		return "", err
	}
	*net = n
	return node.RuntimeTOML(rt, n.Socket(), guest), nil
}

// importTemplate imports template id on the node's default runtime.
func importTemplate(ctx context.Context, c pb.CubeletServiceClient, id, source string) error {
	return importTemplateOn(ctx, c, id, source, "")
}
