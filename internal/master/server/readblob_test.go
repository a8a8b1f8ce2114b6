package server_test

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"testing"
	"time"

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
