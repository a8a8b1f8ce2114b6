package masterlink

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"google.golang.org/grpc/metadata"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
)

// maxManifest bounds a manifest read before its digest can be checked.
const maxManifest = 4 << 20

var digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

// ErrDigestMismatch marks a blob from the master whose bytes do not hash
// to the digest it was asked for (it is also errdefs.ErrInternal).
var ErrDigestMismatch = errors.New("blob does not match its digest")

// PullImage copies the image whose manifest has digest from the master's
// template store into an OCI image layout at dir (which must not exist),
// over the node's link to the master, as node. Every blob (manifest,
// config, layers) is checked against the digest and size that name it, and
// refused on a mismatch: the layout then holds nothing that failed. It
// returns the bytes pulled.
func (h *Link) PullImage(ctx context.Context, node, digest, dir string) (int64, error) {
	if h == nil {
		return 0, fmt.Errorf("template from the master's store: this node has no master (master.addr): %w", errdefs.ErrFailedPrecondition)
	}
	if !digestRE.MatchString(digest) {
		return 0, fmt.Errorf("artifact %q: want sha256:<64 hex>: %w", digest, errdefs.ErrInvalidArgument)
	}
	if h.cfg.Token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, masterpb.NodeTokenHeader, h.cfg.Token)
	}
	blobs := filepath.Join(dir, "blobs", "sha256")
	if err := os.MkdirAll(blobs, 0o700); err != nil {
		return 0, err
	}
	var raw bytes.Buffer
	if err := h.fetch(ctx, node, digest, -1, maxManifest, &raw); err != nil {
		return 0, err
	}
	m, err := v1.ParseManifest(bytes.NewReader(raw.Bytes()))
	if err != nil {
		return 0, fmt.Errorf("manifest %s from the master: %v: %w", digest, err, errdefs.ErrInvalidArgument)
	}
	total := int64(raw.Len())
	for _, d := range append([]v1.Descriptor{m.Config}, m.Layers...) {
		if err := h.fetchFile(ctx, node, d.Digest.String(), d.Size, filepath.Join(blobs, d.Digest.Hex)); err != nil {
			return total, err
		}
		total += d.Size
	}
	if err := os.WriteFile(filepath.Join(blobs, strings.TrimPrefix(digest, "sha256:")), raw.Bytes(), 0o600); err != nil {
		return total, err
	}
	mt := m.MediaType
	if mt == "" {
		mt = types.OCIManifestSchema1
	}
	idx, err := json.Marshal(v1.IndexManifest{SchemaVersion: 2, MediaType: types.OCIImageIndex, Manifests: []v1.Descriptor{{
		MediaType: mt, Size: int64(raw.Len()), Digest: v1.Hash{Algorithm: "sha256", Hex: strings.TrimPrefix(digest, "sha256:")},
	}}})
	if err != nil {
		return total, err
	}
	if err := os.WriteFile(filepath.Join(dir, "index.json"), idx, 0o600); err != nil {
		return total, err
	}
	return total, os.WriteFile(filepath.Join(dir, "oci-layout"), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o600)
}

func (h *Link) fetchFile(ctx context.Context, node, digest string, size int64, path string) error {
	if !digestRE.MatchString(digest) {
		return fmt.Errorf("blob digest %q in the manifest: only sha256 is supported: %w", digest, errdefs.ErrInvalidArgument)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = h.fetch(ctx, node, digest, size, size, f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path)
	}
	return err
}

// fetch reads blob digest from the master into w, refusing it unless it
// is want bytes long (want < 0: any length up to limit) and hashes to
// digest.
func (h *Link) fetch(ctx context.Context, node, digest string, want, limit int64, w io.Writer) error {
	hash := sha256.New()
	var off int64
	for {
		resp, err := h.client.ReadBlob(ctx, &masterpb.ReadBlobRequest{NodeId: node, Digest: digest, Offset: off})
		if err != nil {
			return fmt.Errorf("blob %s from the master: %w", digest, grpcerr.FromGRPC(err))
		}
		if want >= 0 && resp.Size != want {
			return fmt.Errorf("blob %s from the master is %d bytes; the manifest says %d: %w: %w", digest, resp.Size, want, ErrDigestMismatch, errdefs.ErrInternal)
		}
		if resp.Size > limit {
			return fmt.Errorf("blob %s from the master is %d bytes, over the %d allowed: %w", digest, resp.Size, limit, errdefs.ErrInvalidArgument)
		}
		if len(resp.Data) == 0 || off+int64(len(resp.Data)) > resp.Size {
			if off != resp.Size {
				return fmt.Errorf("blob %s from the master ended at %d of %d bytes: %w", digest, off, resp.Size, errdefs.ErrUnavailable)
			}
			break
		}
		if _, err := w.Write(resp.Data); err != nil {
			return err
		}
		hash.Write(resp.Data)
		off += int64(len(resp.Data))
		if off == resp.Size {
			break
		}
	}
	if got := "sha256:" + hex.EncodeToString(hash.Sum(nil)); got != digest {
		return fmt.Errorf("blob %s from the master hashes to %s: refused: %w: %w", digest, got, ErrDigestMismatch, errdefs.ErrInternal)
	}
	return nil
}
