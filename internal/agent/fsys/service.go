// Package fsys is the sandbox's files over envd's API: the Connect service
// filesystem.Filesystem (stat, mkdir, move, list, remove, watches) and the
// HTTP /files upload and download.
//
// Every filesystem call runs with the acting user's credentials
// (identity.AsUser), so the kernel decides what that user may see and
// change, and what the user creates is the user's. The agent stays root and
// never re-implements permission checks.
package fsys

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"connectrpc.com/connect"

	pb "github.com/cubesandbox/cube/api/envd/filesystem"
	"github.com/cubesandbox/cube/api/envd/filesystem/filesystemconnect"
	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// Defaults are the sandbox-wide settings /init provides.
type Defaults interface {
	Workdir() string
}

// Service implements filesystem.Filesystem and /files.
type Service struct {
	db       identity.DB
	defaults Defaults
	log      *slog.Logger
	watchers *watchers
}

var _ filesystemconnect.FilesystemHandler = (*Service)(nil)

// New returns the service; db names file owners, d gives the default
// working directory.
func New(db identity.DB, d Defaults, log *slog.Logger) *Service {
	if log == nil {
		log = slog.Default()
	}
	return &Service{db: db, defaults: d, log: log, watchers: newWatchers()}
}

// Close stops every polling watcher.
func (s *Service) Close() { s.watchers.closeAll() }

// request is the acting user and a resolved path.
func (s *Service) resolve(ctx context.Context, path string) (*identity.User, string, error) {
	u := identity.FromContext(ctx)
	if u == nil {
		return nil, "", fmt.Errorf("no user for this request: %w", errdefs.ErrUnauthenticated)
	}
	p, err := u.Resolve(path, s.defaults.Workdir())
	return u, p, err
}

func (s *Service) Stat(ctx context.Context, req *connect.Request[pb.StatRequest]) (*connect.Response[pb.StatResponse], error) {
	u, path, err := s.resolve(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	var e *pb.EntryInfo
	err = identity.AsUser(u, func() (err error) {
		e, err = entryInfo(path, s.db.Names())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	return connect.NewResponse(&pb.StatResponse{Entry: e}), nil
}

func (s *Service) MakeDir(ctx context.Context, req *connect.Request[pb.MakeDirRequest]) (*connect.Response[pb.MakeDirResponse], error) {
	u, path, err := s.resolve(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	var e *pb.EntryInfo
	err = identity.AsUser(u, func() error {
		if fi, err := os.Stat(path); err == nil {
			if fi.IsDir() {
				return fmt.Errorf("directory %s already exists: %w", path, errdefs.ErrAlreadyExists)
			}
			return fmt.Errorf("%s exists and is not a directory: %w", path, errdefs.ErrInvalidArgument)
		}
		if err := os.MkdirAll(path, 0o755); err != nil {
			return rpcerr.FromOS(err)
		}
		var err error
		e, err = entryInfo(path, s.db.Names())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("make dir %s: %w", path, err)
	}
	return connect.NewResponse(&pb.MakeDirResponse{Entry: e}), nil
}

func (s *Service) Move(ctx context.Context, req *connect.Request[pb.MoveRequest]) (*connect.Response[pb.MoveResponse], error) {
	u, src, err := s.resolve(ctx, req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	_, dst, err := s.resolve(ctx, req.Msg.GetDestination())
	if err != nil {
		return nil, err
	}
	if req.Msg.GetSource() == "" || req.Msg.GetDestination() == "" {
		return nil, fmt.Errorf("move needs a source and a destination: %w", errdefs.ErrInvalidArgument)
	}
	var e *pb.EntryInfo
	err = identity.AsUser(u, func() error {
		if _, err := os.Lstat(src); err != nil {
			return rpcerr.FromOS(err)
		}
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return rpcerr.FromOS(err)
		}
		if err := os.Rename(src, dst); err != nil {
			return rpcerr.FromOS(err)
		}
		var err error
		e, err = entryInfo(dst, s.db.Names())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("move %s to %s: %w", src, dst, err)
	}
	return connect.NewResponse(&pb.MoveResponse{Entry: e}), nil
}

func (s *Service) ListDir(ctx context.Context, req *connect.Request[pb.ListDirRequest]) (*connect.Response[pb.ListDirResponse], error) {
	u, path, err := s.resolve(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.GetDepth())
	if depth == 0 {
		depth = 1
	}
	var entries []*pb.EntryInfo
	err = identity.AsUser(u, func() error {
		target, err := filepath.EvalSymlinks(path)
		if err != nil {
			return rpcerr.FromOS(err)
		}
		fi, err := os.Stat(target)
		if err != nil {
			return rpcerr.FromOS(err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory: %w", path, errdefs.ErrInvalidArgument)
		}
		names := s.db.Names()
		// Entries are reported under the path as asked (through the
		// symlink, if it was one), read from where it really points.
		var walk func(shown, dir string, level int) error
		walk = func(shown, dir string, level int) error {
			des, err := os.ReadDir(dir)
			if err != nil {
				if level == 1 {
					return rpcerr.FromOS(err)
				}
				return nil // a subdirectory we may not read: skip, as ls -R does
			}
			for _, de := range des {
				fi, err := de.Info()
				if err != nil {
					continue // removed meanwhile
				}
				p := filepath.Join(shown, de.Name())
				entries = append(entries, entryFromInfo(p, fi, names))
				if de.IsDir() && level < depth {
					if err := walk(p, filepath.Join(dir, de.Name()), level+1); err != nil {
						return err
					}
				}
			}
			return nil
		}
		return walk(path, target, 1)
	})
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", path, err)
	}
	return connect.NewResponse(&pb.ListDirResponse{Entries: entries}), nil
}

func (s *Service) Remove(ctx context.Context, req *connect.Request[pb.RemoveRequest]) (*connect.Response[pb.RemoveResponse], error) {
	u, path, err := s.resolve(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if req.Msg.GetPath() == "" || path == "/" {
		return nil, fmt.Errorf("refusing to remove %q: %w", path, errdefs.ErrInvalidArgument)
	}
	// Like envd (os.RemoveAll), removing what is already gone succeeds.
	err = identity.AsUser(u, func() error { return rpcerr.FromOS(os.RemoveAll(path)) })
	if err != nil {
		return nil, fmt.Errorf("remove %s: %w", path, err)
	}
	return connect.NewResponse(&pb.RemoveResponse{}), nil
}
