package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// ownSystem is a whole system a scenario family builds for itself through
// a test harness (a cluster, a single-node E2B system): built once per run
// on first use, by calling the harness through a benchTB, and torn down
// (its cleanups run, a leak they find reported) when the run ends.
type ownSystem struct {
	once  sync.Once
	err   error
	tb    *benchTB
	logf  *os.File
	built time.Duration
}

// build runs start once, in scratch directory name, with the daemons'
// output in <name>.log there (to watch while the run lasts); later calls
// return the error that stopped the first, if any.
func (s *ownSystem) build(ctx context.Context, e *Env, name, what string, start func(tb *benchTB)) error {
	s.once.Do(func() {
		dir, err := e.scratch(name)
		if err != nil {
			s.err = err
			return
		}
		if s.logf, err = os.Create(filepath.Join(dir, name+".log")); err != nil {
			s.err = err
			return
		}
		s.tb = newBenchTB(context.WithoutCancel(ctx), name, dir, s.logf)
		e.Progress.Note("%s: building it (%s; log %s)", name, what, s.logf.Name())
		began := time.Now()
		s.err = s.tb.do(func() { start(s.tb) })
		s.built = time.Since(began)
		if s.err != nil {
			s.err = errors.Join(fmt.Errorf("build the %s: %w", name, s.err), s.close(name))
		}
	})
	return s.err
}

// close tears the system down; a leak its checks found is an error.
func (s *ownSystem) close(name string) error {
	if s.tb == nil {
		return nil
	}
	err := s.tb.cleanup()
	s.tb = nil
	if s.logf != nil {
		_ = s.logf.Close()
	}
	if err != nil {
		return fmt.Errorf("%s teardown: %w", name, err)
	}
	return nil
}
