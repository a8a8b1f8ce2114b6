package cubelet

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/cgroups"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// The runtime watch: cubelet learns that a sandbox's process (runc's
// container init, runsc's sandbox process, QEMU) died on its own as it
// happens, through a pidfd on the host PID in the record, which becomes
// readable once the process has exited. A death moves the sandbox to
// Failed with the reason (OOM kill, exit status, signal), releases what
// it holds like a delete would, and wakes the master link so the master
// hears of it at once.
//
// One goroutine waits on an epoll set of every armed pidfd (one-shot: a
// pidfd stays readable after the exit), rather than a goroutine per
// sandbox parked in the netpoller: at 10,000 sandboxes those stacks alone
// were ~80 MiB of cubelet's memory.
//
// Verbs stop or replace the process on purpose (pause to disk, a gVisor
// checkpoint, rollback, restore): the watch takes the sandbox's lock
// before it acts, so it never acts during a verb, and afterwards acts only
// when the record still names the dead PID in a state that needs a
// process and the runtime does not show a replacement.
type deathWatch struct {
	mu    sync.Mutex
	armed map[string]*watched // by sandbox ID
	byKey map[int32]string    // epoll key -> sandbox ID
	key   int32               // the last key handed out
	ep    int                 // the epoll set; 0 until the first arm
	wake  int                 // an eventfd in ep that stops the waiter
	done  chan struct{}       // closed when the waiter has returned
	// closed: stopWatch ran; nothing is armed again (a death handler
	// still running must not start a new waiter).
	closed bool
}

type watched struct {
	id         string
	pid        int
	key        int32
	fd         int    // the pidfd, in the epoll set
	start      uint64 // the process's start time (/proc/<pid>/stat), to tell a reused PID
	oomKills   int64  // the cgroup's OOM kills when armed
	cgroupPath string
}

// wakeKey is the epoll key of the stop eventfd; pidfds get keys from 1.
const wakeKey = 0

// death is what the watch saw at the moment of a death.
type death struct {
	pid    int
	reason string
	at     time.Time
}

// needsProcess reports whether a record in this state has a live runtime
// process that the watch follows.
func needsProcess(r *sandbox.Record) bool {
	if r.Container == nil || r.Container.PID <= 0 {
		return false
	}
	return r.State == lifecycle.Running || r.State == lifecycle.Paused && r.PauseMode != sandbox.PauseDisk
}

// watchRecord arms, re-arms or disarms the watch for a record just
// published. States in between (creating, snapshotting) leave the watch
// as it is.
func (s *Service) watchRecord(r *sandbox.Record) {
	switch {
	case needsProcess(r):
		s.arm(r.ID, r.Container.PID, r.Container.CgroupPath)
	case r.State == lifecycle.Running, r.State == lifecycle.Paused,
		r.State == lifecycle.Destroying, r.State == lifecycle.Destroyed, r.State == lifecycle.Failed:
		s.disarm(r.ID)
	}
}

func (s *Service) disarm(id string) {
	s.watch.mu.Lock()
	defer s.watch.mu.Unlock()
	s.dropLocked(id)
}

// dropLocked forgets id's watch and closes its pidfd (which takes it out
// of the epoll set). Called with watch.mu held.
func (s *Service) dropLocked(id string) {
	w := s.watch.armed[id]
	if w == nil {
		return
	}
	delete(s.watch.armed, id)
	delete(s.watch.byKey, w.key)
	unix.Close(w.fd)
}

// arm follows pid for sandbox id; a no-op when it already does.
func (s *Service) arm(id string, pid int, cgroupPath string) {
	s.watch.mu.Lock()
	defer s.watch.mu.Unlock()
	if s.watch.closed {
		return
	}
	if s.watch.armed == nil {
		s.watch.armed, s.watch.byKey = map[string]*watched{}, map[int32]string{}
	}
	if w := s.watch.armed[id]; w != nil {
		if w.pid == pid {
			return
		}
		s.dropLocked(id)
	}
	if err := s.startWaiterLocked(); err != nil {
		s.log.Warn("runtime watch: cannot wait for deaths", "err", err)
		return
	}
	fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK)
	if err != nil {
		// ESRCH: gone before it could be watched (reaped already).
		reason := "its process is gone"
		if !errors.Is(err, unix.ESRCH) {
			s.log.Warn("runtime watch: cannot watch the sandbox's process", "sandbox_id", id, "pid", pid, "err", err)
			return
		}
		go s.onDeath(id, death{pid: pid, reason: reason, at: time.Now().UTC()})
		return
	}
	unix.CloseOnExec(fd)
	s.watch.key++
	if s.watch.key <= wakeKey {
		s.watch.key = wakeKey + 1
	}
	w := &watched{id: id, pid: pid, key: s.watch.key, fd: fd, cgroupPath: cgroupPath}
	w.start, _ = procStart(pid)
	w.oomKills, _ = cgroups.OOMKills(cgroupPath)
	// One-shot: an exited process's pidfd stays readable; once reported
	// it must not be reported again.
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLONESHOT, Fd: w.key}
	if err := unix.EpollCtl(s.watch.ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(fd)
		s.log.Warn("runtime watch: pidfd", "sandbox_id", id, "err", err)
		return
	}
	s.watch.armed[id] = w
	s.watch.byKey[w.key] = id
}

// startWaiterLocked makes the epoll set and starts its waiter on first
// use. Called with watch.mu held.
func (s *Service) startWaiterLocked() error {
	if s.watch.ep > 0 {
		return nil
	}
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return fmt.Errorf("epoll_create1: %w", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(ep)
		return fmt.Errorf("eventfd: %w", err)
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, wake, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: wakeKey}); err != nil {
		unix.Close(ep)
		unix.Close(wake)
		return fmt.Errorf("epoll_ctl: %w", err)
	}
	s.watch.ep, s.watch.wake, s.watch.done = ep, wake, make(chan struct{})
	go s.waitDeaths(ep, s.watch.done)
	return nil
}

// waitDeaths reports every armed process that exits until stopWatch
// wakes it.
func (s *Service) waitDeaths(ep int, done chan struct{}) {
	defer close(done)
	evs := make([]unix.EpollEvent, 64)
	for {
		n, err := unix.EpollWait(ep, evs, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			s.log.Error("runtime watch: epoll_wait; deaths are no longer seen", "err", err)
			return
		}
		for _, ev := range evs[:n] {
			if ev.Fd == wakeKey {
				return
			}
			s.watch.mu.Lock()
			w := s.watch.armed[s.watch.byKey[ev.Fd]]
			s.watch.mu.Unlock()
			// A watch dropped (or replaced) after epoll_wait returned
			// is not this event's: its key is no longer in byKey.
			if w == nil || w.key != ev.Fd {
				continue
			}
			d := death{pid: w.pid, at: time.Now().UTC()}
			d.reason = s.deathReason(w, w.cgroupPath)
			go s.onDeath(w.id, d)
		}
	}
}

// deathReason says why the process died, read at once: the exit status
// while the process is still a zombie (best effort: its parent may reap
// it first), and the cgroup's OOM kill count, which the killer bumps.
func (s *Service) deathReason(w *watched, cgroupPath string) string {
	status, haveStatus := zombieStatus(w.pid, w.start)
	oom, _ := cgroups.OOMKills(cgroupPath)
	killed := haveStatus && status.Signaled() && status.Signal() == syscall.SIGKILL
	switch {
	case oom > w.oomKills && (!haveStatus || killed):
		return "OOM killed (the sandbox's memory limit)"
	case haveStatus && status.Signaled():
		return fmt.Sprintf("killed by signal %d (%s)", status.Signal(), unix.SignalName(status.Signal()))
	case haveStatus:
		return fmt.Sprintf("exited with status %d", status.ExitStatus())
	}
	return "its process exited (status not seen)"
}

// procStart is field 22 of /proc/<pid>/stat: the start time that tells a
// process from a later one with the same PID.
func procStart(pid int) (uint64, error) {
	f, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// procStat returns /proc/<pid>/stat's fields after the command name
// (fields[0] is field 3, the state).
func procStat(pid int) ([]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 50 {
		return nil, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	return f, nil
}

// zombieStatus is the wait status of pid while it is a zombie and the
// same process that was armed (field 52, exit_code).
func zombieStatus(pid int, start uint64) (syscall.WaitStatus, bool) {
	f, err := procStat(pid)
	if err != nil || f[0] != "Z" {
		return 0, false
	}
	if st, err := strconv.ParseUint(f[19], 10, 64); err != nil || start == 0 || st != start {
		return 0, false
	}
	code, err := strconv.Atoi(f[49])
	if err != nil {
		return 0, false
	}
	return syscall.WaitStatus(code), true
}

// onDeath acts on a death once no verb holds the sandbox.
func (s *Service) onDeath(id string, d death) {
	ctx := s.life
	e, err := s.find(id) // a warm pool's entry too
	if err != nil {
		return
	}
	if err := e.acquire(ctx); err != nil {
		return
	}
	defer e.release()
	cur := e.rec.Load()
	if !needsProcess(cur) || cur.Container.PID != d.pid {
		// A verb stopped or replaced the process on purpose; the record
		// it published re-armed or disarmed the watch.
		s.watchRecord(cur)
		return
	}
	log := s.log.With("sandbox_id", id, "pid", d.pid)
	if drv, err := s.node.Driver(cur.Runtime); err == nil {
		if st, err := drv.State(ctx, cur.Container.ID); err == nil && st.PID > 0 && st.PID != d.pid &&
			(st.Status == runtime.StatusRunning || st.Status == runtime.StatusPaused) {
			// Replaced by the runtime without the record following: follow
			// the new process.
			log.Info("runtime watch: the sandbox runs under a new PID", "new_pid", st.PID)
			s.arm(id, st.PID, cur.Container.CgroupPath)
			return
		}
	}
	s.disarm(id)
	why := "sandbox died: " + d.reason
	log.Warn("runtime watch: sandbox died; marked failed and released", "reason", d.reason)
	t := newTask(s.store, e, cur, nil)
	if err := t.Update(func(r *sandbox.Record) { r.State, r.PrevState, r.Error = lifecycle.Failed, "", why }); err != nil {
		log.Error("record death", "err", err)
		return
	}
	if _, err := s.engine.Run(context.WithoutCancel(ctx), FlowCleanup, t); err != nil {
		log.Error("release dead sandbox; delete it to retry", "err", err)
	}
	s.hb.Kick()
}

// armAll arms the watch for every adopted sandbox (after reconcile).
func (s *Service) armAll() {
	s.mu.Lock()
	recs := make([]*sandbox.Record, 0, len(s.boxes))
	for _, e := range s.boxes {
		recs = append(recs, e.rec.Load())
	}
	s.mu.Unlock()
	for _, r := range recs {
		s.watchRecord(r)
	}
}

// stopWatch disarms everything and stops the waiter (Close).
func (s *Service) stopWatch() {
	s.watch.mu.Lock()
	for id := range s.watch.armed {
		s.dropLocked(id)
	}
	ep, wake, done := s.watch.ep, s.watch.wake, s.watch.done
	s.watch.ep, s.watch.wake, s.watch.done, s.watch.closed = 0, 0, nil, true
	s.watch.mu.Unlock()
	if ep <= 0 {
		return
	}
	var one [8]byte
	one[0] = 1 // eventfd counters are host-endian; any non-zero wakes
	_, _ = unix.Write(wake, one[:])
	<-done
	unix.Close(ep)
	unix.Close(wake)
}
