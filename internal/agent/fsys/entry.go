package fsys

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	pb "github.com/cubesandbox/cube/api/envd/filesystem"
	"github.com/cubesandbox/cube/internal/agent/identity"
	"github.com/cubesandbox/cube/internal/agent/rpcerr"
)

// xattrPrefix namespaces the user metadata envd keeps on files: the
// X-Metadata-<key> upload headers become user.e2b.<key>.
const xattrPrefix = "user.e2b."

// entryInfo describes path without following a final symlink.
func entryInfo(path string, names identity.Names) (*pb.EntryInfo, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, rpcerr.FromOS(err)
	}
	return entryFromInfo(path, fi, names), nil
}

func entryFromInfo(path string, fi os.FileInfo, names identity.Names) *pb.EntryInfo {
	e := &pb.EntryInfo{
		Name:         filepath.Base(path),
		Path:         path,
		Size:         fi.Size(),
		Mode:         uint32(fi.Mode().Perm()),
		Permissions:  fi.Mode().String(),
		ModifiedTime: timestamppb.New(fi.ModTime()),
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		e.Owner, e.Group = names.User(st.Uid), names.Group(st.Gid)
	}
	switch m := fi.Mode(); {
	case m.IsRegular():
		e.Type = pb.FileType_FILE_TYPE_FILE
	case m.IsDir():
		e.Type = pb.FileType_FILE_TYPE_DIRECTORY
	case m&os.ModeSymlink != 0:
		e.Type = pb.FileType_FILE_TYPE_SYMLINK
		target, err := filepath.EvalSymlinks(path)
		if err != nil {
			// Dangling or unreadable: report the link text itself.
			target, _ = os.Readlink(path)
		}
		e.SymlinkTarget = &target
	default:
		// Devices, FIFOs, sockets: envd reports them untyped and the SDKs
		// leave them out of listings.
		e.Type = pb.FileType_FILE_TYPE_UNSPECIFIED
	}
	if e.Type == pb.FileType_FILE_TYPE_FILE || e.Type == pb.FileType_FILE_TYPE_DIRECTORY {
		e.Metadata = readMetadata(path)
	}
	return e
}

// readMetadata returns the user.e2b.* attributes of path, or nil. Errors
// (no xattr support, no permission) mean "no metadata".
func readMetadata(path string) map[string]string {
	sz, err := unix.Llistxattr(path, nil)
	if err != nil || sz == 0 {
		return nil
	}
	buf := make([]byte, sz)
	sz, err = unix.Llistxattr(path, buf)
	if err != nil {
		return nil
	}
	var out map[string]string
	for _, name := range strings.Split(string(buf[:sz]), "\x00") {
		key, ok := strings.CutPrefix(name, xattrPrefix)
		if !ok || key == "" {
			continue
		}
		val := make([]byte, 4096)
		n, err := unix.Lgetxattr(path, name, val)
		if err != nil {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[key] = string(val[:n])
	}
	return out
}

// writeMetadata makes path's user.e2b.* attributes exactly meta: keys not
// in meta are removed (an upload replaces the metadata as a whole).
func writeMetadata(path string, meta map[string]string) error {
	for key := range readMetadata(path) {
		if _, keep := meta[key]; !keep {
			if err := unix.Lremovexattr(path, xattrPrefix+key); err != nil {
				return fmt.Errorf("remove metadata %q: %w", key, err)
			}
		}
	}
	for k, v := range meta {
		if err := unix.Lsetxattr(path, xattrPrefix+k, []byte(v), 0); err != nil {
			return fmt.Errorf("set metadata %q on %s: %w", k, path, err)
		}
	}
	return nil
}
