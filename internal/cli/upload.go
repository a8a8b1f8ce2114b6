package cli

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
)

// uploadChunk is the size of each message of an upload, under gRPC's
// 4 MiB message limit.
const uploadChunk = 1 << 20

// uploadTemplate sends the image at src (an archive, or an OCI layout
// directory, tarred on the fly) to cubemaster's UploadTemplate.
func uploadTemplate(ctx context.Context, a masterpb.AdminServiceClient, req *masterpb.ImportTemplateRequest, src string) (*masterpb.ClusterTemplate, error) {
	st, err := os.Stat(src)
	if err != nil {
		return nil, usageError{err}
	}
	var body io.ReadCloser
	if st.IsDir() {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(tarDir(pw, src)) }()
		body = pr
	} else {
		if body, err = os.Open(src); err != nil {
			return nil, err
		}
	}
	defer body.Close()
	stream, err := a.UploadTemplate(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&masterpb.UploadTemplateRequest{Part: &masterpb.UploadTemplateRequest_Request{Request: req}}); err != nil {
		_, err = stream.CloseAndRecv() // the server's reason, if it gave one
		return nil, err
	}
	buf := make([]byte, uploadChunk)
	for {
		n, rerr := io.ReadFull(body, buf)
		if n > 0 {
			if err := stream.Send(&masterpb.UploadTemplateRequest{Part: &masterpb.UploadTemplateRequest_Chunk{Chunk: buf[:n]}}); err != nil {
				_, err = stream.CloseAndRecv()
				return nil, err
			}
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			return nil, fmt.Errorf("read %s: %w", src, rerr)
		}
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		return nil, err
	}
	return resp.Template, nil
}

// tarDir writes the files under dir (an OCI layout) as a tar, names
// relative to dir; anything but a regular file or directory is an error.
func tarDir(w io.Writer, dir string) error {
	tw := tar.NewWriter(w)
	if err := tw.AddFS(os.DirFS(dir)); err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	return tw.Close()
}
