package raw

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/cubesandbox/cube/internal/loopdev"
)

// LoopGoneWait is how long a teardown waits for a pool's loop device to
// go: seconds on a quiet machine, and more than 10 s was seen on a 2-core
// machine at load 30, where the last sandbox disks' releases queue.
const LoopGoneWait = time.Minute

// WaitLoopGone waits until no loop device is backed by image. A pool's
// loop device outlives its unmount for a moment when sandbox disks inside
// it were unmounted just before: the kernel releases their loop devices
// asynchronously, and until then the pool is busy, so its teardown could
// only switch its device to autoclear.
func WaitLoopGone(image string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		devs, err := loopdev.FindByBacking(image)
		if err != nil || len(devs) == 0 {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("loop device %s still backed by %s after %s", devs[0].Path, image, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// readPidFile reads a PID written by runc, podman or QEMU.
func readPidFile(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("bad pid file %s: %q", path, b)
	}
	return pid, nil
}

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// Tail is the last 2000 bytes of a log file ("" when it cannot be read),
// for error messages.
func Tail(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	b, _ := io.ReadAll(f)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}
