package agent

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ResolvConfPath is the sandbox's resolver configuration.
const ResolvConfPath = "/etc/resolv.conf"

// WriteResolvConf makes path name nameserver as the sandbox's only
// resolver (network-agent's DNS forwarder, the same address in every
// sandbox, so a snapshot or a clone keeps a correct file). Base images
// often ship an empty file or a symlink into /run (systemd-resolved):
// either is replaced by a regular file, written to a temporary file and
// renamed over path so that no process reads half a file. Where path is a
// mount point (rename gives EBUSY) it is rewritten in place.
func WriteResolvConf(path, nameserver string) error {
	a, err := netip.ParseAddr(nameserver)
	if err != nil {
		return fmt.Errorf("resolv.conf: nameserver %q: %w", nameserver, err)
	}
	body := []byte("# Written by cube-agent: the node's DNS forwarder for this sandbox.\n" +
		"nameserver " + a.String() + "\n")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("resolv.conf: %w", err)
	}
	tmp := filepath.Join(filepath.Dir(path), ".resolv.conf.cube")
	if err := os.WriteFile(tmp, body, 0o644); err != nil {
		return fmt.Errorf("resolv.conf: %w", err)
	}
	err = os.Rename(tmp, path)
	if errors.Is(err, unix.EBUSY) {
		_ = os.Remove(tmp)
		err = os.WriteFile(path, body, 0o644)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("resolv.conf: %w", err)
	}
	return nil
}
