package agent

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/agent/rpcerr"
	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// maxEntropy bounds the entropy one reinit feeds (the pool is 256 bytes).
const maxEntropy = 512

func (a *Server) handleReinit(w http.ResponseWriter, r *http.Request) {
	var req agentproto.ReinitRequest
	if err := decodeOptional(r, &req); err != nil {
		rpcerr.WriteHTTP(w, err)
		return
	}
	seed, err := base64.StdEncoding.DecodeString(req.Entropy)
	if err != nil || len(seed) > maxEntropy {
		rpcerr.WriteHTTP(w, fmt.Errorf("reinit: entropy must be base64 of at most %d bytes: %w", maxEntropy, errdefs.ErrInvalidArgument))
		return
	}
	if req.AccessToken != nil && strings.ContainsAny(*req.AccessToken, "\r\n") {
		rpcerr.WriteHTTP(w, fmt.Errorf("reinit: access token must be one line: %w", errdefs.ErrInvalidArgument))
		return
	}
	var mac net.HardwareAddr
	if req.MAC != "" {
		if mac, err = net.ParseMAC(req.MAC); err != nil || len(mac) != 6 {
			rpcerr.WriteHTTP(w, fmt.Errorf("reinit: mac %q: want a 6-byte Ethernet address: %w", req.MAC, errdefs.ErrInvalidArgument))
			return
		}
	}
	res := agentproto.ReinitResponse{Applied: []string{}, Skipped: map[string]string{}}
	// took is logged: under TCG every step is guest CPU on a claim's path.
	took := make([]any, 0, 16)
	last := time.Now()
	step := func(name string, err error) {
		now := time.Now()
		took = append(took, name, now.Sub(last))
		last = now
		if err != nil {
			res.Skipped[name] = err.Error()
			return
		}
		res.Applied = append(res.Applied, name)
	}
	if req.Hostname != "" {
		step("hostname", unix.Sethostname([]byte(req.Hostname)))
	}
	if len(req.Env) > 0 {
		a.state.mu.Lock()
		if a.state.env == nil {
			a.state.env = map[string]string{}
		}
		for k, v := range req.Env {
			a.state.env[k] = v
			_ = os.Setenv(k, v)
		}
		a.state.mu.Unlock()
		step("env", nil)
	}
	if req.TimeUnixNs != 0 {
		c, err := a.syncClock(time.Unix(0, req.TimeUnixNs))
		if err == nil && !c.Adjusted {
			err = fmt.Errorf("in sync (off by %.1f ms)", c.OffsetMs)
		}
		step("clock", err)
	}
	if len(seed) > 0 {
		credited, err := addEntropy(seed)
		if err == nil && !credited {
			step("entropy", nil)
			res.Skipped["entropy_credit"] = "mixed in, not credited (RNDADDENTROPY not permitted)"
		} else {
			step("entropy", err)
		}
	}
	if mac != nil {
		step("mac", setMAC("eth0", mac))
	}
	if req.AccessToken != nil {
		// Last: the answer to this request is the last thing the old
		// token (the snapshot's) gets from this agent.
		a.state.mu.Lock()
		a.state.setToken(*req.AccessToken)
		a.state.mu.Unlock()
		step("access_token", nil)
	}
	a.log.Info("re-initialised after restore", "applied", res.Applied, "skipped", res.Skipped, slog.Group("took", took...))
	writeJSON(w, http.StatusOK, res)
	// A re-initialised sandbox (claimed from a warm pool, restored from a
	// snapshot) is one a user is about to call: its envd handlers are
	// built now, while its create finishes, not on the first call.
	go a.prebuild()
}

// addEntropy credits seed to the kernel pool with RNDADDENTROPY, or, where
// that is not permitted (no CAP_SYS_ADMIN, gVisor), mixes it in by writing
// /dev/urandom, which changes the pool's state but not its estimate.
func addEntropy(seed []byte) (credited bool, err error) {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return false, err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(seed)+3)
	*(*int32)(unsafe.Pointer(&info[0])) = int32(len(seed) * 8)
	*(*int32)(unsafe.Pointer(&info[4])) = int32(len(seed))
	copy(info[8:], seed)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0]))); e == 0 {
		return true, nil
	}
	if _, err := f.Write(seed); err != nil {
		return false, err
	}
	return false, nil
}

// setMAC sets ifname's hardware address, taking the link down and up
// again when the driver refuses a live change. An address the link has
// already is left alone: a warm-pool entry got its own at its restore,
// and its claim asks for the same one; a change costs a virtio-net
// control command and the stack's address-change notifiers (~1-3 ms of
// a TCG guest's vCPU on the claim's path).
func setMAC(ifname string, mac net.HardwareAddr) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(ifname)
	if err != nil {
		return err
	}
	// struct ifreq { char name[16]; union { struct sockaddr hwaddr; ... } }:
	// all of it the kernel copies in and, for a get, out.
	var raw [unsafe.Sizeof(unix.Ifreq{})]byte
	const hw = unix.IFNAMSIZ + 2 // sa_data
	if len(mac) > len(raw)-hw {
		return fmt.Errorf("mac of %d bytes: %w", len(mac), errdefs.ErrInvalidArgument)
	}
	copy(raw[:], ifname)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCGIFHWADDR, uintptr(unsafe.Pointer(&raw[0]))); e == 0 &&
		bytes.Equal(raw[hw:hw+len(mac)], mac) {
		return nil
	}
	binary.NativeEndian.PutUint16(raw[unix.IFNAMSIZ:], unix.ARPHRD_ETHER)
	copy(raw[hw:], mac)
	set := func() error {
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCSIFHWADDR, uintptr(unsafe.Pointer(&raw[0]))); e != 0 {
			return e
		}
		return nil
	}
	err = set()
	if !errors.Is(err, unix.EBUSY) {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	flags := ifr.Uint16()
	ifr.SetUint16(flags &^ unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return err
	}
	err = set()
	ifr.SetUint16(flags)
	return errors.Join(err, unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr))
}

// DropSysAdminBound removes CAP_SYS_ADMIN from the bounding set of every
// thread of the agent, keeping it in the agent's own effective set: the
// gVisor runtime grants it to PID 1 so that reinit can set a clone's
// hostname, and no process the agent starts may inherit it (a root child's
// permitted set comes from the bounding set at exec). A no-op without it.
func DropSysAdminBound() error {
	if r, _ := unix.PrctlRetInt(unix.PR_CAPBSET_READ, unix.CAP_SYS_ADMIN, 0, 0, 0); r != 1 {
		return nil
	}
	if _, _, e := syscall.AllThreadsSyscall(unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, unix.CAP_SYS_ADMIN, 0); e != 0 {
		return fmt.Errorf("drop CAP_SYS_ADMIN from the bounding set: %w", e)
	}
	return nil
}
