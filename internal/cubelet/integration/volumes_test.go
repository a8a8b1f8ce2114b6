package integration

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestVolumesGvisor: a volume mounted into a gVisor sandbox takes a file
// through the agent's upload, a write past its size fails (a smaller one
// is the control), and the next sandbox (runc) reads the file; the node
// then deletes the volume and nothing is left.
func TestVolumesGvisor(t *testing.T) {
	cubelettest.RequireRoot(t)
	requireRunsc(t)
	env := cubelettest.New(t, "[gvisor]\ncheckpoint = false\n")
	env.StartNetworkAgent(t, nettest.Options{PoolSize: 2})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	vol := []sandbox.Volume{{ID: "vol-gv", Path: "/vol", SizeMiB: 8}}

	a := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "vol-a", Runtime: "gvisor", Volumes: vol})
	c := agentClient()
	defer c.CloseIdleConnections()
	upload := func(id, path string, data []byte) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, agentURL(t, svc, id, "/files?path="+path), bytes.NewReader(data))
		req.Header.Set("Content-Type", "application/octet-stream")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(body)
	}
	if code, body := upload(a.ID, "/vol/hello", []byte("from gVisor")); code/100 != 2 {
		t.Fatalf("upload into the volume in gVisor: %d %s", code, body)
	}
	if code, body := upload(a.ID, "/vol/fits", make([]byte, 2<<20)); code/100 != 2 {
		t.Fatalf("control: 2 MiB into an 8 MiB volume: %d %s", code, body)
	}
	code, body := upload(a.ID, "/vol/big", make([]byte, 16<<20))
	t.Logf("16 MiB into an 8 MiB volume in gVisor: %d %s", code, body)
	if code/100 == 2 {
		t.Fatal("16 MiB went into an 8 MiB volume")
	}
	if _, err := svc.Delete(ctx, a.ID); err != nil {
		t.Fatal(err)
	}

	b := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "vol-b", Runtime: "runc", Volumes: vol})
	resp, err := c.Get(agentURL(t, svc, b.ID, "/files?path=/vol/hello"))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(got) != "from gVisor" {
		t.Fatalf("runc sandbox reads %d %q", resp.StatusCode, got)
	}
	if _, err := svc.DeleteVolume(ctx, "vol-gv"); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("delete while b holds it: %v, want FailedPrecondition", err)
	}
	if _, err := svc.Delete(ctx, b.ID); err != nil {
		t.Fatal(err)
	}
	if existed, err := svc.DeleteVolume(ctx, "vol-gv"); err != nil || !existed {
		t.Fatalf("delete: %v %v", existed, err)
	}
	env.AssertNoLeaks(t)
}

// TestVolumesVMRefused: a VM boots its own disk and binds no host
// directory, so a create with a volume on runtime vm is NotImplemented
// before anything is made; the same volume on runc is the control.
func TestVolumesVMRefused(t *testing.T) {
	env, svc := vmEnv(t, "")
	ctx := context.Background()
	vol := []sandbox.Volume{{ID: "vol-vm", Path: "/vol", SizeMiB: 8}}
	_, err := svc.Create(ctx, cubelet.CreateRequest{SandboxID: "vol-vm", TemplateID: "busybox", Runtime: "vm", Volumes: vol})
	t.Logf("vm create with a volume: %v", err)
	if !errdefs.IsNotImplemented(err) {
		t.Fatalf("vm create with a volume: %v, want NotImplemented", err)
	}
	if _, err := os.Stat(env.Config.Node.DataDir + "/pool/volumes/vol-vm"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the refused create made the volume: %v", err)
	}
	sb := mustCreate(t, svc, cubelet.CreateRequest{SandboxID: "vol-runc", Runtime: "runc", Volumes: vol})
	if _, err := svc.Delete(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.DeleteVolume(ctx, "vol-vm"); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}
