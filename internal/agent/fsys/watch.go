package fsys

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	pb "github.com/cubesandbox/cube/api/envd/filesystem"
	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/inotify"
	"github.com/cubesandbox/cube/internal/agent/keepalive"
	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/errdefs"
)

const (
	// maxWatchers caps polling watchers: each holds an inotify instance
	// and a goroutine until removed or expired.
	maxWatchers = 128
	// maxQueued caps the events a polling watcher keeps between polls;
	// beyond it the oldest are dropped.
	maxQueued = 4096
	// watcherIdle removes a polling watcher nobody polled for this long:
	// clients that vanish must not leak watches.
	watcherIdle = 10 * time.Minute
)

var opTypes = map[inotify.Op]pb.EventType{
	inotify.Create: pb.EventType_EVENT_TYPE_CREATE,
	inotify.Write:  pb.EventType_EVENT_TYPE_WRITE,
	inotify.Remove: pb.EventType_EVENT_TYPE_REMOVE,
	inotify.Rename: pb.EventType_EVENT_TYPE_RENAME,
	inotify.Chmod:  pb.EventType_EVENT_TYPE_CHMOD,
}

// Filesystem magic numbers (linux/magic.h) of network and FUSE mounts,
// which envd refuses to watch unless asked: inotify misses remote changes.
var networkFS = map[int64]bool{0x6969: true, 0xFF534D42: true, 0x517B: true, 0xFE534D42: true, 0x65735546: true}

// startWatch validates a watch request and starts the inotify watcher.
func (s *Service) startWatch(ctx context.Context, path string, recursive, allowNetwork bool) (*identity.User, string, *inotify.Watcher, error) {
	u, dir, err := s.resolve(ctx, path)
	if err != nil {
		return nil, "", nil, err
	}
	as := func(f func() error) error { return identity.AsUser(u, f) }
	err = as(func() error {
		fi, err := os.Stat(dir)
		if err != nil {
			return rpcerr.FromOS(err)
		}
		if !fi.IsDir() {
			return fmt.Errorf("%s is not a directory: %w", dir, errdefs.ErrInvalidArgument)
		}
		var sfs unix.Statfs_t
		if err := unix.Statfs(dir, &sfs); err == nil && networkFS[int64(sfs.Type)] && !allowNetwork { //nolint:unconvert // Statfs_t.Type is not int64 on every GOARCH (386, arm, s390x)
			return fmt.Errorf("%s is on a network filesystem; set allow_network_mounts to watch it anyway: %w", dir, errdefs.ErrInvalidArgument)
		}
		return nil
	})
	if err != nil {
		return nil, "", nil, fmt.Errorf("watch %s: %w", dir, err)
	}
	w, err := inotify.New(dir, recursive, as)
	if err != nil {
		return nil, "", nil, fmt.Errorf("watch %s: %w", dir, rpcerr.FromOS(err))
	}
	return u, dir, w, nil
}

// event converts an inotify event, with the entry when asked for (absent
// when the path is already gone again).
func (s *Service) event(u *identity.User, root string, ev inotify.Event, withEntry bool) *pb.FilesystemEvent {
	name, err := filepath.Rel(root, ev.Path)
	if err != nil {
		name = ev.Path
	}
	fe := &pb.FilesystemEvent{Name: name, Type: opTypes[ev.Op]}
	if withEntry {
		_ = identity.AsUser(u, func() error {
			e, err := entryInfo(ev.Path, s.db.Names())
			if err == nil {
				fe.Entry = e
			}
			return nil
		})
	}
	return fe
}

func (s *Service) WatchDir(ctx context.Context, req *connect.Request[pb.WatchDirRequest], stream *connect.ServerStream[pb.WatchDirResponse]) error {
	m := req.Msg
	u, dir, w, err := s.startWatch(ctx, m.GetPath(), m.GetRecursive(), m.GetAllowNetworkMounts())
	if err != nil {
		return err
	}
	defer w.Close()
	if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Start{Start: &pb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	every := keepalive.Interval(req.Header())
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
			if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Keepalive{Keepalive: &pb.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		case ev, ok := <-w.C:
			if !ok {
				// The watched directory itself is gone (its remove event
				// was sent), or inotify failed.
				return w.Err()
			}
			fe := s.event(u, dir, ev, m.GetIncludeEntry())
			if err := stream.Send(&pb.WatchDirResponse{Event: &pb.WatchDirResponse_Filesystem{Filesystem: fe}}); err != nil {
				return err
			}
			tick.Reset(every)
		}
	}
}

// pollWatcher queues a watcher's events until GetWatcherEvents.
type pollWatcher struct {
	w *inotify.Watcher

	mu       sync.Mutex
	events   []*pb.FilesystemEvent
	dropped  int
	lastPoll time.Time
}

type watchers struct {
	mu sync.Mutex
	m  map[string]*pollWatcher
}

func newWatchers() *watchers { return &watchers{m: map[string]*pollWatcher{}} }

// expire removes watchers nobody polled for watcherIdle. Called on every
// watcher RPC, so an idle agent holds no timer.
func (ws *watchers) expire(now time.Time) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	for id, pw := range ws.m {
		pw.mu.Lock()
		idle := now.Sub(pw.lastPoll) > watcherIdle
		pw.mu.Unlock()
		if idle {
			pw.w.Close()
			delete(ws.m, id)
		}
	}
}

func (ws *watchers) closeAll() {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	for id, pw := range ws.m {
		pw.w.Close()
		delete(ws.m, id)
	}
}

func (s *Service) CreateWatcher(ctx context.Context, req *connect.Request[pb.CreateWatcherRequest]) (*connect.Response[pb.CreateWatcherResponse], error) {
	s.watchers.expire(time.Now())
	s.watchers.mu.Lock()
	full := len(s.watchers.m) >= maxWatchers
	s.watchers.mu.Unlock()
	if full {
		return nil, fmt.Errorf("%d watchers exist; remove some first: %w", maxWatchers, errdefs.ErrResourceExhausted)
	}
	m := req.Msg
	u, dir, w, err := s.startWatch(ctx, m.GetPath(), m.GetRecursive(), m.GetAllowNetworkMounts())
	if err != nil {
		return nil, err
	}
	id := newID()
	pw := &pollWatcher{w: w, lastPoll: time.Now()}
	go func() {
		for ev := range w.C {
			fe := s.event(u, dir, ev, m.GetIncludeEntry())
			pw.mu.Lock()
			if len(pw.events) >= maxQueued {
				pw.events = pw.events[1:]
				pw.dropped++
			}
			pw.events = append(pw.events, fe)
			pw.mu.Unlock()
		}
	}()
	s.watchers.mu.Lock()
	s.watchers.m[id] = pw
	s.watchers.mu.Unlock()
	return connect.NewResponse(&pb.CreateWatcherResponse{WatcherId: id}), nil
}

func (s *Service) getWatcher(id string) (*pollWatcher, error) {
	s.watchers.mu.Lock()
	defer s.watchers.mu.Unlock()
	pw := s.watchers.m[id]
	if pw == nil {
		return nil, fmt.Errorf("watcher %q: %w", id, errdefs.ErrNotFound)
	}
	return pw, nil
}

func (s *Service) GetWatcherEvents(_ context.Context, req *connect.Request[pb.GetWatcherEventsRequest]) (*connect.Response[pb.GetWatcherEventsResponse], error) {
	s.watchers.expire(time.Now())
	pw, err := s.getWatcher(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	pw.mu.Lock()
	events, dropped := pw.events, pw.dropped
	pw.events, pw.dropped, pw.lastPoll = nil, 0, time.Now()
	pw.mu.Unlock()
	if dropped > 0 {
		s.log.Warn("watcher dropped events between polls", "watcher", req.Msg.GetWatcherId(), "dropped", dropped)
	}
	return connect.NewResponse(&pb.GetWatcherEventsResponse{Events: events}), nil
}

func (s *Service) RemoveWatcher(_ context.Context, req *connect.Request[pb.RemoveWatcherRequest]) (*connect.Response[pb.RemoveWatcherResponse], error) {
	id := req.Msg.GetWatcherId()
	s.watchers.mu.Lock()
	pw := s.watchers.m[id]
	delete(s.watchers.m, id)
	s.watchers.mu.Unlock()
	if pw == nil {
		return nil, fmt.Errorf("watcher %q: %w", id, errdefs.ErrNotFound)
	}
	pw.w.Close()
	return connect.NewResponse(&pb.RemoveWatcherResponse{}), nil
}

func newID() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
