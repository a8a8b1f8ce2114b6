package procs

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// openPTY allocates a pseudo-terminal pair with x/sys alone (no cgo, no
// extra module). The master is non-blocking, so the Go poller serves its
// reads and Close or a deadline interrupts them; the slave is what the
// child gets as its controlling terminal.
func openPTY(cols, rows uint16) (master, slave *os.File, err error) {
	mfd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("open /dev/ptmx: %w", err)
	}
	master = os.NewFile(uintptr(mfd), "/dev/ptmx")
	defer func() {
		if err != nil {
			master.Close()
		}
	}()
	if err := unix.IoctlSetPointerInt(mfd, unix.TIOCSPTLCK, 0); err != nil {
		return nil, nil, fmt.Errorf("unlockpt: %w", err)
	}
	// TIOCGPTPEER opens the slave through the master, immune to /dev/pts
	// being a different devpts instance than the one ptmx came from.
	sfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(mfd), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		n, err := unix.IoctlGetUint32(mfd, unix.TIOCGPTN)
		if err != nil {
			return nil, nil, fmt.Errorf("ptsname: %w", err)
		}
		s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
		if err != nil {
			return nil, nil, fmt.Errorf("open pty slave: %w", err)
		}
		slave = s
	} else {
		slave = os.NewFile(sfd, "/dev/pts/peer")
	}
	if err := setSize(master, cols, rows); err != nil {
		slave.Close()
		return nil, nil, err
	}
	return master, slave, nil
}

// setSize sets the terminal's window size; the kernel sends SIGWINCH to
// its foreground process group.
func setSize(f *os.File, cols, rows uint16) error {
	if cols == 0 || rows == 0 {
		cols, rows = 80, 24
	}
	sc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	if err := sc.Control(func(fd uintptr) {
		ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Col: cols, Row: rows})
	}); err != nil {
		return err
	}
	if ierr != nil {
		return fmt.Errorf("set pty size: %w", ierr)
	}
	return nil
}
