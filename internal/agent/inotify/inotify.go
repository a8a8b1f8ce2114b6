// Package inotify watches a directory (optionally its whole tree) with the
// kernel's inotify API through x/sys, and reports events in envd's
// vocabulary: create, write, remove, rename, chmod.
//
// Recursion is done here, as inotify has none: every directory under the
// root gets its own watch, and a directory that appears later (created or
// moved in) is walked and watched when its event arrives, before that event
// is passed on; what the walk finds is reported as created, since inotify
// never reports what was made before the watch existed.
package inotify

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Op is what happened to a path.
type Op int

const (
	Create Op = iota + 1
	Write
	Remove
	Rename
	Chmod
)

func (o Op) String() string {
	switch o {
	case Create:
		return "create"
	case Write:
		return "write"
	case Remove:
		return "remove"
	case Rename:
		return "rename"
	case Chmod:
		return "chmod"
	}
	return "unknown"
}

// Event is one change: Path is absolute.
type Event struct {
	Path string
	Op   Op
}

const mask = unix.IN_CREATE | unix.IN_MOVED_TO | unix.IN_MODIFY |
	unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF |
	unix.IN_ONLYDIR | unix.IN_EXCL_UNLINK

// Watcher delivers events on C until Close, or until the watched root
// itself is removed (C is then closed and Err says why).
type Watcher struct {
	C <-chan Event

	c         chan Event
	f         *os.File
	root      string
	recursive bool
	as        func(func() error) error
	closing   chan struct{}
	closeOnce sync.Once

	mu    sync.Mutex
	paths map[int]string // watch descriptor -> directory
	err   error
	done  chan struct{}
}

// New watches dir (and, if recursive, every directory below it). Every
// inotify_add_watch runs inside as (nil: directly), so that the
// credentials of the user who asked decide what may be watched, for the
// directories found later too: pass identity.AsUser bound to that user.
func New(dir string, recursive bool, as func(func() error) error) (*Watcher, error) {
	if as == nil {
		as = func(f func() error) error { return f() }
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	c := make(chan Event, 256)
	w := &Watcher{
		C: c, c: c, f: os.NewFile(uintptr(fd), "inotify"),
		root: filepath.Clean(dir), recursive: recursive, as: as,
		closing: make(chan struct{}),
		paths:   map[int]string{}, done: make(chan struct{}),
	}
	err = as(func() error {
		if err := w.add(w.root); err != nil {
			return err
		}
		if recursive {
			_, err := w.addTree(w.root)
			return err
		}
		return nil
	})
	if err != nil {
		w.f.Close()
		return nil, err
	}
	go w.loop()
	return w, nil
}

// Close stops watching; C is closed soon after.
func (w *Watcher) Close() error {
	var err error
	w.closeOnce.Do(func() {
		close(w.closing)
		err = w.f.Close()
	})
	return err
}

// Err is why C was closed: nil after Close or when the root went away.
func (w *Watcher) Err() error {
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

func (w *Watcher) add(dir string) error {
	sc, err := w.f.SyscallConn()
	if err != nil {
		return err
	}
	var wd int
	var aerr error
	if err := sc.Control(func(fd uintptr) {
		wd, aerr = unix.InotifyAddWatch(int(fd), dir, mask)
	}); err != nil {
		return err
	}
	if aerr != nil {
		return fmt.Errorf("watch %s: %w", dir, aerr)
	}
	w.mu.Lock()
	w.paths[wd] = dir
	w.mu.Unlock()
	return nil
}

// addTree watches every directory below dir and returns every entry it
// saw there. Subdirectories that vanish or cannot be read meanwhile are
// skipped: they are not ours to fail on.
func (w *Watcher) addTree(dir string) ([]string, error) {
	var seen []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return err
			}
			return filepath.SkipDir
		}
		if p == dir {
			return nil
		}
		seen = append(seen, p)
		if !d.IsDir() {
			return nil
		}
		if err := w.add(p); err != nil {
			return filepath.SkipDir
		}
		return nil
	})
	return seen, err
}

func (w *Watcher) loop() {
	defer close(w.done)
	defer close(w.c)
	buf := make([]byte, 64*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				w.setErr(fmt.Errorf("read inotify: %w", err))
			}
			return
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			raw := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := ""
			if raw.Len > 0 {
				b := buf[off+unix.SizeofInotifyEvent : off+unix.SizeofInotifyEvent+int(raw.Len)]
				for i, ch := range b {
					if ch == 0 {
						b = b[:i]
						break
					}
				}
				name = string(b)
			}
			off += unix.SizeofInotifyEvent + int(raw.Len)
			if stop := w.handle(int(raw.Wd), raw.Mask, name); stop {
				w.Close()
				return
			}
		}
	}
}

// handle turns one raw event into ours; it reports whether the root is
// gone and watching must stop.
func (w *Watcher) handle(wd int, m uint32, name string) (stop bool) {
	w.mu.Lock()
	dir, ok := w.paths[wd]
	w.mu.Unlock()
	if m&unix.IN_Q_OVERFLOW != 0 {
		// Events were lost; there is no path to report. Keep watching.
		return false
	}
	if !ok {
		return false
	}
	if m&unix.IN_IGNORED != 0 {
		w.mu.Lock()
		delete(w.paths, wd)
		w.mu.Unlock()
		return dir == w.root
	}
	path := dir
	if name != "" {
		path = filepath.Join(dir, name)
	}
	// Self events of subdirectories are reported by their parent's watch.
	if name == "" && dir != w.root {
		return false
	}
	emit := func(op Op) {
		select {
		case w.c <- Event{Path: path, Op: op}:
		case <-w.closing:
		}
	}
	switch {
	case m&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
		if !w.recursive || m&unix.IN_ISDIR == 0 {
			emit(Create)
			break
		}
		// A new directory: watch it (and what is already in it) before
		// reporting it, so a client that saw the event can rely on the
		// watch; and report what was created in it before the watch
		// existed, which inotify itself never will. An entry created
		// during the walk may be reported twice.
		var found []string
		_ = w.as(func() error {
			if err := w.add(path); err != nil {
				return err
			}
			found, _ = w.addTree(path)
			return nil
		})
		emit(Create)
		for _, p := range found {
			path = p
			emit(Create)
		}
	case m&unix.IN_MODIFY != 0:
		emit(Write)
	case m&(unix.IN_DELETE|unix.IN_DELETE_SELF) != 0:
		emit(Remove)
	case m&(unix.IN_MOVED_FROM|unix.IN_MOVE_SELF) != 0:
		emit(Rename)
	case m&unix.IN_ATTRIB != 0:
		emit(Chmod)
	}
	return false
}

func (w *Watcher) setErr(err error) {
	w.mu.Lock()
	w.err = err
	w.mu.Unlock()
}
