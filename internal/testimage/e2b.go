package testimage

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// bashShim stands in for bash in the busybox image: the E2B SDK runs every
// command as `/bin/bash -l -c CMD` and every PTY as `/bin/bash -i -l`, and
// busybox's ash understands both. A real template (base) ships real bash.
const bashShim = "#!/bin/sh\n# cube e2e: the E2B SDK wants bash; busybox ash speaks the flags it uses.\nexec /bin/sh \"$@\"\n"

// WriteE2BBusybox writes the busybox test image plus a /bin/bash shim as
// an OCI layout at dir (replacing what is there): the smallest image the
// unmodified E2B SDK can drive.
func WriteE2BBusybox(dir string) error {
	base, err := BusyboxImage()
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: "bin/bash", Mode: 0o755, Size: int64(len(bashShim)),
		ModTime: time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC), Format: tar.FormatPAX}
	if err := tw.WriteHeader(hdr); err != nil {
		return err
	}
	if _, err := tw.Write([]byte(bashShim)); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(buf.Bytes())), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return fmt.Errorf("bash layer: %w", err)
	}
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return fmt.Errorf("append bash layer: %w", err)
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	return p.AppendImage(img)
}
