package actions

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os/exec"
	"sync"

	"github.com/cubesandbox/cube/internal/agentchan"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/gvisor"
	"github.com/cubesandbox/cube/internal/runtime/runc"
	"github.com/cubesandbox/cube/internal/runtime/vm"
	"github.com/cubesandbox/cube/internal/vmguest"
)

// runtimesAction finds the runtime drivers this node can run (init): runc
// always, gVisor and QEMU VMs when their binaries (and guest artifacts)
// are there.
type runtimesAction struct{ n *Node }

func (*runtimesAction) Name() string { return "runtimes" }

func (a *runtimesAction) Init(ctx context.Context) error {
	c := a.n.Cfg
	if _, err := exec.LookPath(c.Runc.Binary); err != nil {
		return fmt.Errorf("runc runtime: %w", err)
	}
	d, err := runc.New(runc.Config{Binary: c.Runc.Binary, Root: c.Runc.Root})
	if err != nil {
		return err
	}
	a.n.Drivers = map[string]runtime.Driver{d.Name(): d}
	if g := a.gvisor(ctx); g != nil {
		a.n.Drivers[g.Name()] = g
	}
	if v := a.vm(ctx); v != nil {
		a.n.Drivers[v.Name()] = v
	}
	if _, ok := a.n.Drivers[c.Node.DefaultRuntime]; !ok {
		return fmt.Errorf("node.default_runtime %q is not available: %w", c.Node.DefaultRuntime, errdefs.ErrInvalidArgument)
	}
	return nil
}

// gvisor returns the gvisor driver, or nil (with a log line) when this
// node cannot run it: gVisor is optional, runc is not.
func (a *runtimesAction) gvisor(ctx context.Context) runtime.Driver {
	c := a.n.Cfg.Gvisor
	if _, err := exec.LookPath(c.Binary); err != nil {
		slog.InfoContext(ctx, "gvisor runtime skipped: runsc not found", "binary", c.Binary)
		return nil
	}
	d, err := gvisor.New(gvisor.Config{Binary: c.Binary, Root: c.Root, Platform: c.Platform, Debug: c.Debug, Checkpoint: c.Checkpoint, SentryOverhead: c.SentryOverhead()})
	if err != nil {
		slog.WarnContext(ctx, "gvisor runtime skipped", "error", err)
		return nil
	}
	slog.InfoContext(ctx, "gvisor runtime", "checkpoint", c.Checkpoint, "sentry_overhead_mib", d.MemoryOverhead()>>20)
	return d
}

// vm returns the vm driver, or nil (with a log line) when this node cannot
// run VMs: QEMU missing, or no guest artifacts built yet.
func (a *runtimesAction) vm(ctx context.Context) runtime.Driver {
	c := a.n.Cfg.VM
	if !c.Enabled {
		return nil
	}
	if _, err := exec.LookPath(c.QEMU); err != nil {
		slog.InfoContext(ctx, "vm runtime skipped: qemu not found", "binary", c.QEMU)
		return nil
	}
	if _, err := vmguest.Load(c.GuestDir); err != nil {
		slog.InfoContext(ctx, "vm runtime skipped: no guest kernel (build it with `go run ./hack/vm-guest`)", "guest_dir", c.GuestDir, "error", err)
		return nil
	}
	d, err := vm.New(vm.Config{QEMU: c.QEMU, GuestDir: c.GuestDir, Accel: c.Accel, Root: c.Root, Vhost: c.Vhost, ExtraCmdline: c.ExtraCmdline})
	if err != nil {
		slog.WarnContext(ctx, "vm runtime skipped", "error", err)
		return nil
	}
	return &vmRuntime{Driver: d, clients: map[string]*agentchan.Channel{}}
}

// vmRuntime is the QEMU driver as cubelet uses it: the driver plus one
// agent-channel client per VM. QEMU's chardev socket takes one client at a
// time, so every cubelet call to a VM's agent shares that client's single
// HTTP/2 connection.
type vmRuntime struct {
	*vm.Driver
	mu      sync.Mutex
	clients map[string]*agentchan.Channel
}

var (
	_ runtime.Driver       = (*vmRuntime)(nil)
	_ runtime.AgentChannel = (*vmRuntime)(nil)
)

// AgentClient is the client of id's agent channel: vsock where the host
// has it, else the virtio-serial socket.
func (r *vmRuntime) AgentClient(id string) (*http.Client, error) {
	c, err := r.channel(id)
	if err != nil {
		return nil, err
	}
	return c.HTTP, nil
}

// SpareAgentSession has id's agent channel handshake the session its
// next call will use (agentchan.Channel.Spare).
func (r *vmRuntime) SpareAgentSession(ctx context.Context, id string) error {
	c, err := r.channel(id)
	if err != nil {
		return err
	}
	return c.Spare(ctx)
}

func (r *vmRuntime) channel(id string) (*agentchan.Channel, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.clients[id]; ok {
		return c, nil
	}
	var c *agentchan.Channel
	if cid, err := r.AgentCID(id); err == nil && cid != 0 {
		c = agentchan.NewVsock(cid, agentchan.VsockPort)
	} else {
		sock, err := r.AgentSocket(id)
		if err != nil {
			return nil, err
		}
		c = agentchan.NewSerial(sock)
	}
	r.clients[id] = c
	return c, nil
}

func (r *vmRuntime) forget(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.clients[id]; ok {
		c.Close()
		delete(r.clients, id)
	}
}

// Stop also drops the VM's channel client: the next VM of that ID has new
// sockets.
func (r *vmRuntime) Stop(ctx context.Context, id string) error {
	r.forget(id)
	return r.Driver.Stop(ctx, id)
}

// Checkpoint without leaveRunning ends the VM: drop its client too.
func (r *vmRuntime) Checkpoint(ctx context.Context, id, dir string, leaveRunning bool) error {
	if !leaveRunning {
		r.forget(id)
	}
	return r.Driver.Checkpoint(ctx, id, dir, leaveRunning)
}
