package qmp

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
)

// TestExecuteFD passes a pipe to a real QEMU with getfd: QEMU then holds
// it under the name (closefd finds it). Controls: getfd without a
// descriptor and closefd of a name never passed both fail.
func TestExecuteFD(t *testing.T) {
	testenv.RequireBinary(t, "qemu-system-x86_64", "qemu-system-x86")
	sock := filepath.Join(t.TempDir(), "q.sock")
	cmd := exec.Command("qemu-system-x86_64", "-M", "none", "-S", "-display", "none", "-nodefaults", "-qmp", "unix:"+sock+",server=on,wait=off")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var c *Client
	for {
		var err error
		if c, err = Dial(ctx, sock); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	defer c.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if err := c.ExecuteFD(ctx, "getfd", map[string]any{"fdname": "p"}, nil, w); err != nil {
		t.Fatalf("getfd with a descriptor: %v", err)
	}
	if err := c.Execute(ctx, "closefd", map[string]any{"fdname": "p"}, nil); err != nil {
		t.Errorf("QEMU does not hold the passed descriptor: %v", err)
	}
	if err := c.Execute(ctx, "getfd", map[string]any{"fdname": "q"}, nil); err == nil || !strings.Contains(err.Error(), "SCM_RIGHTS") {
		t.Errorf("control: getfd without a descriptor = %v, want an SCM_RIGHTS error", err)
	}
	if err := c.Execute(ctx, "closefd", map[string]any{"fdname": "q"}, nil); err == nil {
		t.Errorf("control: closefd of a name never passed succeeded")
	}
}
