// Package identity answers "who is this request acting as" inside a
// sandbox: it looks users and groups up in the sandbox's own /etc/passwd and
// /etc/group (never the host's, never NSS), and runs filesystem work with a
// user's credentials (see AsUser).
//
// The files are re-read on every lookup: they are a few hundred bytes, and
// a user added by a command in the sandbox must be usable at once.
package identity

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// User is one /etc/passwd entry plus its supplementary groups.
type User struct {
	Name   string
	UID    uint32
	GID    uint32
	Groups []uint32 // supplementary groups from /etc/group, without GID
	Home   string
	Shell  string
}

// DB reads users and groups from passwd and group files.
type DB struct {
	Passwd string // /etc/passwd when empty
	Group  string // /etc/group when empty
}

func (db DB) passwdPath() string {
	if db.Passwd == "" {
		return "/etc/passwd"
	}
	return db.Passwd
}

func (db DB) groupPath() string {
	if db.Group == "" {
		return "/etc/group"
	}
	return db.Group
}

// Lookup finds a user by name. An unknown or malformed name is NotFound /
// InvalidArgument; a missing passwd file is NotFound too (a template
// without one has no users to pick).
func (db DB) Lookup(name string) (*User, error) {
	if name == "" || strings.ContainsAny(name, ":\n/") {
		return nil, fmt.Errorf("user name %q: %w", name, errdefs.ErrInvalidArgument)
	}
	var found *User
	err := scan(db.passwdPath(), 7, func(f []string) bool {
		if f[0] != name {
			return true
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			return true
		}
		found = &User{Name: f[0], UID: uint32(uid), GID: uint32(gid), Home: f[5], Shell: f[6]}
		return false
	})
	if err != nil {
		return nil, err
	}
	if found == nil {
		return nil, fmt.Errorf("user %q: %w", name, errdefs.ErrNotFound)
	}
	if found.Home == "" || !filepath.IsAbs(found.Home) {
		found.Home = "/"
	}
	// Supplementary groups: every group listing the user as a member.
	_ = scan(db.groupPath(), 4, func(f []string) bool {
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil || gid == uint64(found.GID) {
			return true
		}
		for _, m := range strings.Split(f[3], ",") {
			if m == name {
				found.Groups = append(found.Groups, uint32(gid))
				break
			}
		}
		return true
	})
	return found, nil
}

// Names maps numeric IDs to user and group names, for listing entries.
type Names struct {
	users  map[uint32]string
	groups map[uint32]string
}

// Names reads both files once. Unreadable files give empty maps: owners are
// then shown numerically, as ls does.
func (db DB) Names() Names {
	n := Names{users: map[uint32]string{}, groups: map[uint32]string{}}
	read := func(path string, fields int, into map[uint32]string) {
		_ = scan(path, fields, func(f []string) bool {
			if id, err := strconv.ParseUint(f[2], 10, 32); err == nil {
				if _, dup := into[uint32(id)]; !dup {
					into[uint32(id)] = f[0]
				}
			}
			return true
		})
	}
	read(db.passwdPath(), 7, n.users)
	read(db.groupPath(), 4, n.groups)
	return n
}

// User returns the name of uid, or the number when it has none.
func (n Names) User(uid uint32) string {
	if s, ok := n.users[uid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// Group returns the name of gid, or the number when it has none.
func (n Names) Group(gid uint32) string {
	if s, ok := n.groups[gid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(gid), 10)
}

// scan calls fn with the colon-separated fields of every line of path
// that has at least n fields, until fn returns false.
func scan(path string, n int, fn func([]string) bool) error {
	data, err := os.ReadFile(path)
	if err != nil {
		if os.IsNotExist(err) {
			return fmt.Errorf("%s: %w", path, errdefs.ErrNotFound)
		}
		return fmt.Errorf("read %s: %w", path, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		f := strings.Split(line, ":")
		if len(f) < n {
			continue
		}
		if !fn(f) {
			return nil
		}
	}
	return sc.Err()
}

type ctxKey struct{}

// WithUser returns ctx carrying u as the acting user.
func WithUser(ctx context.Context, u *User) context.Context {
	return context.WithValue(ctx, ctxKey{}, u)
}

// FromContext returns the acting user, or nil.
func FromContext(ctx context.Context) *User {
	u, _ := ctx.Value(ctxKey{}).(*User)
	return u
}

// Resolve turns a request path into an absolute, clean path the way envd
// does: "" is workdir (the user's home when workdir is empty), "~" and
// "~/x" are in the user's home, and any other relative path is relative to
// the home too. "~other" is InvalidArgument.
func (u *User) Resolve(path, workdir string) (string, error) {
	if path == "" {
		path = workdir
	}
	if strings.HasPrefix(path, "~") {
		if len(path) > 1 && path[1] != '/' {
			return "", fmt.Errorf("path %q: cannot expand another user's home: %w", path, errdefs.ErrInvalidArgument)
		}
		path = filepath.Join(u.Home, path[1:])
	}
	if strings.IndexByte(path, 0) >= 0 {
		return "", fmt.Errorf("path contains NUL: %w", errdefs.ErrInvalidArgument)
	}
	if !filepath.IsAbs(path) {
		path = filepath.Join(u.Home, path)
	}
	return filepath.Clean(path), nil
}
