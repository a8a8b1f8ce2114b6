package nettest

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	toml "github.com/pelletier/go-toml/v2"

	"github.com/cubesandbox/cube/internal/failpoint"
	"github.com/cubesandbox/cube/internal/network/client"
	"github.com/cubesandbox/cube/internal/testbin"
)

// Binary builds cmd/network-agent once per test process with the
// failpoints tag: the tests drive its faults through CUBE_FAILPOINTS,
// which release builds ignore.
func Binary(t testing.TB) string {
	t.Helper()
	return testbin.Build(t, "network-agent", "failpoints")
}

// ReleaseBinary builds cmd/network-agent once per test process as
// release builds are made: without the failpoints tag.
func ReleaseBinary(t testing.TB) string {
	t.Helper()
	return testbin.Build(t, "network-agent", "")
}

// Process is network-agent running as a process on an Env's state.
type Process struct {
	cmd  *exec.Cmd
	out  bytes.Buffer
	done chan struct{}
	err  error
}

// NewProcessEnv makes an Env whose agent the test runs as processes
// (StartProcess); its cleanup purges whatever they left.
func NewProcessEnv(t testing.TB, o Options) *Env {
	t.Helper()
	cfg, dir := NewConfig(t, o)
	e := &Env{Dir: dir, Config: cfg, Socket: cfg.API.Socket, started: true,
		log: testLogger(t)}
	t.Cleanup(func() { e.teardown(t) })
	return e
}

// StartProcess runs network-agent on the env's state with the given
// failpoints (CUBE_FAILPOINTS syntax) and waits until it answers Health.
func (e *Env) StartProcess(t testing.TB, failpoints string) *Process {
	t.Helper()
	p := e.spawn(t, failpoints)
	p.waitHealthy(t, e.Socket)
	return p
}

// SpawnProcess is StartProcess without waiting: for failpoints that fire
// in the background (the pool filler) and may kill it during start-up.
func (e *Env) SpawnProcess(t testing.TB, failpoints string) *Process {
	t.Helper()
	return e.spawn(t, failpoints)
}

// SpawnBinary is SpawnProcess with another network-agent binary (e.g.
// ReleaseBinary).
func (e *Env) SpawnBinary(t testing.TB, bin, failpoints string) *Process {
	t.Helper()
	return e.spawnBinary(t, bin, failpoints)
}

// WaitHealthy waits until the process answers Health on the env's
// socket; it fails t if the process exits first.
func (e *Env) WaitHealthy(t testing.TB, p *Process) {
	t.Helper()
	p.waitHealthy(t, e.Socket)
}

func (e *Env) spawn(t testing.TB, failpoints string) *Process {
	t.Helper()
	return e.spawnBinary(t, Binary(t), failpoints)
}

func (e *Env) spawnBinary(t testing.TB, bin, failpoints string) *Process {
	t.Helper()
	data, err := toml.Marshal(e.Config)
	if err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(e.Dir, "agent.toml")
	if err := os.WriteFile(cfgPath, data, 0o644); err != nil {
		t.Fatal(err)
	}
	p := &Process{done: make(chan struct{})}
	p.cmd = exec.Command(bin, "--config", cfgPath)
	p.cmd.Env = append(os.Environ(), failpoint.EnvVar+"="+failpoints)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() { p.Kill() })
	return p
}

func (p *Process) waitHealthy(t testing.TB, socket string) {
	t.Helper()
	c, err := client.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		h, err := c.Health(ctx)
		cancel()
		if err == nil && h.Ok {
			return
		}
		select {
		case <-p.done:
			t.Fatalf("network-agent exited during start-up: %v\n%s", p.err, p.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("network-agent not healthy: %v\n%s", err, p.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Exited waits up to d for the process to exit (a failpoint killed it).
func (p *Process) Exited(d time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(d):
		return false
	}
}

// Output is what the process logged.
func (p *Process) Output() string { return p.out.String() }

// Err waits for the process to end and says how (exec's Wait error).
func (p *Process) Err() error {
	<-p.done
	return p.err
}

// Kill SIGKILLs the process and waits for it.
func (p *Process) Kill() {
	if p.cmd.Process != nil {
		_ = p.cmd.Process.Kill()
	}
	<-p.done
}
