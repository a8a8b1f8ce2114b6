package runc

import (
	"context"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/runtime"
)

var _ runtime.HostnameSetter = (*Driver)(nil)

// SetHostname sets the hostname of the UTS namespace of the container's
// init, pid (a warm pool entry taking the ID of the sandbox that claims
// it), from a thread that joins the namespace and then ends
// (onThrowawayThread), so no thread goes back to the scheduler in another
// namespace. The caller, root in the initial user namespace, may; the
// container's own root may not (CAP_SYS_ADMIN is outside its set).
func (d *Driver) SetHostname(_ context.Context, id string, pid int, name string) error {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/ns/uts")
	if err != nil {
		return fmt.Errorf("runc set hostname of %s: %w", id, err)
	}
	defer f.Close()
	return onThrowawayThread(func() error {
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWUTS); err != nil {
			return fmt.Errorf("runc set hostname of %s: join UTS namespace of %d: %w", id, pid, err)
		}
		if err := unix.Sethostname([]byte(name)); err != nil {
			return fmt.Errorf("runc set hostname of %s: %w", id, err)
		}
		return nil
	})
}
