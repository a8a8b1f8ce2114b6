package integration

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
)

// TestTemplateAgentRefresh: importing the same image again after the
// node's cube-agent changed (an upgrade) rebuilds the template's image
// with the new agent — what VMs boot — instead of keeping the old one.
func TestTemplateAgentRefresh(t *testing.T) {
	cubelettest.RequireRoot(t)
	ctx := context.Background()
	env := cubelettest.New(t, "")
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	before, err := svc.GetTemplate(ctx, "busybox")
	if err != nil {
		t.Fatal(err)
	}

	// A different, still runnable agent: the same ELF with a byte appended.
	b, err := os.ReadFile(env.AgentBin)
	if err != nil {
		t.Fatal(err)
	}
	upgraded := filepath.Join(t.TempDir(), "cube-agent")
	if err := os.WriteFile(upgraded, append(b, 0), 0o755); err != nil {
		t.Fatal(err)
	}
	svc.Config().Storage.AgentBinary = upgraded
	after, err := svc.ImportTemplate(ctx, "busybox", env.Image, nil)
	if err != nil {
		t.Fatalf("re-import: %v", err)
	}
	sum := sha256.Sum256(append(b, 0))
	want := "sha256:" + hex.EncodeToString(sum[:])
	if after.AgentDigest != want || after.AgentDigest == before.AgentDigest || after.RebuiltAt.IsZero() || !after.CreatedAt.Equal(before.CreatedAt) {
		t.Fatalf("after re-import: agent %s (want %s, was %s), rebuilt %v, created %v (was %v)",
			after.AgentDigest, want, before.AgentDigest, after.RebuiltAt, after.CreatedAt, before.CreatedAt)
	}
	out, err := exec.Command("debugfs", "-R", "cat "+cubelet.AgentPath, after.ImagePath).Output()
	if err != nil {
		t.Fatalf("read the agent out of the image: %v", err)
	}
	if got := sha256.Sum256(out); "sha256:"+hex.EncodeToString(got[:]) != want {
		t.Fatalf("the template image still holds the old agent")
	}
	// Importing again with the same agent is the no-op it always was.
	again, err := svc.ImportTemplate(ctx, "busybox", env.Image, nil)
	if err != nil || !again.RebuiltAt.Equal(after.RebuiltAt) {
		t.Fatalf("second re-import rebuilt again: %v %v", again.RebuiltAt, err)
	}
	sb := mustCreate(t, svc, cubelet.CreateRequest{TemplateID: "busybox"})
	if _, err := svc.Delete(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
	env.AssertNoLeaks(t)
}
