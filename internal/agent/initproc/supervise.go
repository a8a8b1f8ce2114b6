package initproc

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"os/signal"
	"time"

	"golang.org/x/sys/unix"
)

// forwarded are the signals PID 1 passes on to the sandbox's processes.
// Not SIGUSR2: the runtime sends it to wake a quiesced agent after a
// memory restore (agent/quiesce.go); it is the agent's, not the sandbox's.
var forwarded = []os.Signal{unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGUSR1}

// Config configures Supervise.
type Config struct {
	Reaper *Reaper
	Logger *slog.Logger
	// Grace is how long Supervise waits after forwarding SIGTERM before it
	// SIGKILLs whatever is left. Zero means 10s.
	Grace time.Duration
}

// Supervise runs PID 1 duties until SIGTERM has been handled (forwarded,
// and every child gone) or ctx is done. It never returns because a child
// crashed.
//
// Signals go to every process in the sandbox when we are PID 1 (kill(-1)
// in a PID namespace reaches everything but ourselves). Outside PID 1 (in
// tests, or run by hand) kill(-1) would hit the whole host, so only
// children started through the Reaper are signalled.
func Supervise(ctx context.Context, cfg Config) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	grace := cfg.Grace
	if grace == 0 {
		grace = 10 * time.Second
	}
	r := cfg.Reaper

	sigs := make(chan os.Signal, 32)
	signal.Notify(sigs, append([]os.Signal{unix.SIGCHLD}, forwarded...)...)
	defer signal.Stop(sigs)
	// Children may have exited before Notify was installed.
	r.Reap()

	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case s := <-sigs:
			sig := s.(unix.Signal)
			if sig == unix.SIGCHLD {
				r.Reap()
				continue
			}
			log.Info("forwarding signal", "signal", sig)
			if err := signalAll(r, sig); err != nil {
				log.Warn("forward signal", "signal", sig, "error", err)
			}
			if sig == unix.SIGTERM {
				return drain(ctx, r, log, sigs, grace)
			}
		}
	}
}

// drain reaps until no child is left, escalating to SIGKILL after grace.
func drain(ctx context.Context, r *Reaper, log *slog.Logger, sigs <-chan os.Signal, grace time.Duration) error {
	killAt := time.NewTimer(grace)
	defer killAt.Stop()
	// SIGCHLD is not queued per child, so also poll: a missed wakeup must
	// not stall shutdown.
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if r.Reap() || (os.Getpid() != 1 && r.trackedCount() == 0) {
			log.Info("all children exited")
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-sigs:
		case <-tick.C:
		case <-killAt.C:
			log.Warn("children outlived the grace period; killing", "grace", grace)
			if err := signalAll(r, unix.SIGKILL); err != nil {
				log.Warn("kill children", "error", err)
			}
		}
	}
}

func signalAll(r *Reaper, sig unix.Signal) error {
	if os.Getpid() == 1 {
		if err := unix.Kill(-1, sig); err != nil && !errors.Is(err, unix.ESRCH) {
			return err
		}
		return nil
	}
	return r.signalTracked(sig)
}

func (r *Reaper) trackedCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.waiters)
}
