package server_test

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/server"
	"github.com/cubesandbox/cube/internal/master/tmplstore"
	"github.com/cubesandbox/cube/internal/pki"
)

// TestReadBlobNeedsTheNodesCertificate: over mutual TLS, the template
// store's blobs are served to a node certificate asking as itself, with
// the node token (the control); the same request with another node's
// certificate, a proxy's, an admin's, or without the token is refused.
func TestReadBlobNeedsTheNodesCertificate(t *testing.T) {
	ca, err := pki.NewCA("test cluster")
	if err != nil {
		t.Fatal(err)
	}
	certs := t.TempDir()
	issue := func(base, name string, role pki.Role) *tls.Config {
		f, err := ca.Issue(certs, base, name, role, "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		tc, err := f.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		return tc
	}
	masterFiles, err := ca.Issue(certs, "master", "cubemaster", pki.RoleMaster, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	cfg := config(t, func(c *master.Config) {
		c.API.Node, c.TLS, c.Nodes.Token = "127.0.0.1:"+port, masterFiles, "node-secret"
		c.Templates.StoreDir = t.TempDir()
	})
	s, err := server.Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop() })
	img, err := random.Image(4096, 2)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := s.Service.TemplateStore().Put(img, tmplstore.Record{ID: "probe"})
	if err != nil {
		t.Fatal(err)
	}
	dial := func(tc *tls.Config) masterpb.NodeServiceClient {
		conn, err := grpc.NewClient("127.0.0.1:"+port, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return masterpb.NewNodeServiceClient(conn)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	withToken := metadata.AppendToOutgoingContext(ctx, masterpb.NodeTokenHeader, "node-secret")
	req := &masterpb.ReadBlobRequest{NodeId: "node-1", Digest: rec.Digest}

	for _, c := range []struct {
		name string
		tc   *tls.Config
		ctx  context.Context
		want codes.Code
	}{
		{"node-2's certificate", issue("node2", "node-2", pki.RoleNode), withToken, codes.PermissionDenied},
		{"a proxy certificate named node-1", issue("proxy", "node-1", pki.RoleProxy), withToken, codes.PermissionDenied},
		{"an admin certificate named node-1", issue("admin", "node-1", pki.RoleAdmin), withToken, codes.PermissionDenied},
		{"node-1's certificate without the node token", issue("node1a", "node-1", pki.RoleNode), ctx, codes.Unauthenticated},
	} {
		_, err := dial(c.tc).ReadBlob(c.ctx, req)
		if status.Code(err) != c.want {
			t.Fatalf("ReadBlob as node-1 with %s: %v, want %s", c.name, err, c.want)
		}
		t.Logf("ReadBlob as node-1 with %s: %v", c.name, err)
	}
	resp, err := dial(issue("node1", "node-1", pki.RoleNode)).ReadBlob(withToken, req)
	if err != nil {
		t.Fatalf("control: node-1 reading with its own certificate and the token: %v", err)
	}
	h := sha256.Sum256(resp.Data)
	if got := "sha256:" + hex.EncodeToString(h[:]); got != rec.Digest || int64(len(resp.Data)) != resp.Size {
		t.Fatalf("control: read %d of %d bytes hashing to %s, want all of %s", len(resp.Data), resp.Size, got, rec.Digest)
	}
	t.Logf("control: node-1's certificate reads the manifest (%d bytes, digest checked)", resp.Size)
}

// TestUploadTemplateNeedsAdmin: UploadTemplate, a client stream on the
// master's api.node, needs an admin certificate and the admin token there,
// like the unary admin calls; with both, an OCI archive sent by the caller
// lands in the template store (the control).
func TestUploadTemplateNeedsAdmin(t *testing.T) {
	ca, err := pki.NewCA("test cluster")
	if err != nil {
		t.Fatal(err)
	}
	certs := t.TempDir()
	issue := func(base, name string, role pki.Role) *tls.Config {
		f, err := ca.Issue(certs, base, name, role, "127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		tc, err := f.Client("tls")
		if err != nil {
			t.Fatal(err)
		}
		return tc
	}
	masterFiles, err := ca.Issue(certs, "master", "cubemaster", pki.RoleMaster, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	cfg := config(t, func(c *master.Config) {
		c.API.Node, c.TLS, c.API.AdminToken = "127.0.0.1:"+port, masterFiles, "admin-secret"
		c.Templates.StoreDir = t.TempDir()
	})
	s, err := server.Start(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Stop() })

	// An OCI archive of a random image.
	img, err := random.Image(4096, 2)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "oci")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img); err != nil {
		t.Fatal(err)
	}
	var archive bytes.Buffer
	tw := tar.NewWriter(&archive)
	if err := tw.AddFS(os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	upload := func(tc *tls.Config, ctx context.Context) (*masterpb.ImportTemplateResponse, error) {
		conn, err := grpc.NewClient("127.0.0.1:"+port, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		st, err := masterpb.NewAdminServiceClient(conn).UploadTemplate(ctx)
		if err != nil {
			return nil, err
		}
		msgs := []*masterpb.UploadTemplateRequest{
			{Part: &masterpb.UploadTemplateRequest_Request{Request: &masterpb.ImportTemplateRequest{TemplateId: "up"}}},
			{Part: &masterpb.UploadTemplateRequest_Chunk{Chunk: archive.Bytes()}},
		}
		for _, m := range msgs {
			if err := st.Send(m); err != nil {
				break // the server's answer says why
			}
		}
		return st.CloseAndRecv()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	withToken := metadata.AppendToOutgoingContext(ctx, masterpb.AdminTokenHeader, "admin-secret")
	admin := issue("admin", "ops", pki.RoleAdmin)
	for _, c := range []struct {
		name string
		tc   *tls.Config
		ctx  context.Context
		want codes.Code
	}{
		{"a node certificate and the token", issue("node1", "node-1", pki.RoleNode), withToken, codes.PermissionDenied},
		{"a proxy certificate and the token", issue("proxy", "proxy-1", pki.RoleProxy), withToken, codes.PermissionDenied},
		{"an admin certificate without the token", admin, ctx, codes.Unauthenticated},
	} {
		_, err := upload(c.tc, c.ctx)
		if status.Code(err) != c.want {
			t.Fatalf("UploadTemplate with %s: %v, want %s", c.name, err, c.want)
		}
		t.Logf("UploadTemplate with %s: %v", c.name, err)
	}
	if _, err := s.Service.TemplateStore().Get("up"); err == nil {
		t.Fatal("a refused upload reached the store")
	}
	resp, err := upload(admin, withToken)
	if err != nil {
		t.Fatalf("control: upload with an admin certificate and the token: %v", err)
	}
	want, _ := img.Digest()
	if !resp.Template.Stored || resp.Template.Digest != want.String() {
		t.Fatalf("control: %+v, want stored with digest %s", resp.Template, want)
	}
	t.Logf("control: an admin certificate and the token upload %d bytes; stored as %s", archive.Len(), resp.Template.Digest)
}
