package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/slotstore"
)

// The pool keeps Pool.Size container slots and Pool.VMSize VM slots ready,
// so that Ensure only assigns one (a record write and one nftables
// transaction) instead of building one. Ready slots hold the deny-all
// policy. One background loop refills it, never faster than
// Pool.RefillPerSecond and with at most fillWorkers at once, and backs
// off while creation fails (the CIDR is full, the kernel refuses). Released slots are not reused: they are torn
// down and the pool makes fresh ones, so nothing of one sandbox (conntrack
// entries, neighbour caches, a process still in its namespace) can ever
// reach the next.

func (a *Agent) targets() map[network.Kind]int {
	return map[network.Kind]int{network.Container: a.cfg.Pool.Size, network.VM: a.cfg.Pool.VMSize}
}

// kickFill wakes the filler after the pool shrank.
func (a *Agent) kickFill() {
	select {
	case a.kick <- struct{}{}:
	default:
	}
}

func (a *Agent) fillLoop() {
	defer close(a.fillDone)
	interval := time.Duration(float64(time.Second) / a.cfg.Pool.RefillPerSecond)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	// Building a slot mostly waits on the kernel (RCU grace periods for
	// links, mounts and rules), so a few are built at once; the rate limit
	// still spaces their starts.
	sem := make(chan struct{}, fillWorkers)
	var wg sync.WaitGroup
	defer wg.Wait()
	var last time.Time
	var failures atomic.Int32
	for {
		kind, ok := a.claimFill()
		if !ok {
			select {
			case <-a.stop:
				return
			case <-a.kick:
			case <-tick.C:
			}
			continue
		}
		backoff := time.Duration(0)
		if n := failures.Load(); n > 0 {
			backoff = min(100*time.Millisecond<<min(n, 9), 30*time.Second)
		}
		wait := time.Until(last.Add(interval)) + backoff
		select {
		case <-a.stop:
			a.unclaimFill(kind)
			return
		case <-time.After(max(wait, 0)):
		}
		select {
		case <-a.stop:
			a.unclaimFill(kind)
			return
		case sem <- struct{}{}:
		}
		last = time.Now()
		wg.Go(func() {
			defer func() { <-sem }()
			if err := a.fillOne(kind); err != nil {
				n := failures.Add(1)
				a.log.Warn("pool refill failed", "kind", kind, "err", err, "failures", n)
			} else {
				failures.Store(0)
			}
		})
	}
}

// fillWorkers is how many pooled slots are built at once.
const fillWorkers = 4

// claimFill picks a kind whose pool is below target and counts the slot
// about to be made, so the pool never overshoots.
func (a *Agent) claimFill() (network.Kind, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, k := range []network.Kind{network.Container, network.VM} {
		if len(a.pool[k])+a.filling[k] < a.targets()[k] {
			a.filling[k]++
			return k, true
		}
	}
	return "", false
}

func (a *Agent) unclaimFill(k network.Kind) {
	a.mu.Lock()
	a.filling[k]--
	a.mu.Unlock()
}

func (a *Agent) fillOne(kind network.Kind) error {
	defer a.unclaimFill(kind)
	a.opMu.RLock()
	defer a.opMu.RUnlock()
	start := time.Now()
	r, err := a.newSlot(context.Background(), kind, "", poolPolicy)
	if err == nil {
		r.State = slotstore.Ready
		if err = a.put(r); err != nil {
			err = errorsJoin(err, a.releaseSlot(context.Background(), r.Index))
		}
	}
	a.metrics.observe("pool_create", start, err)
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.pool[kind] = append(a.pool[kind], r.Index)
	a.mu.Unlock()
	return nil
}

// PoolReady returns the number of ready slots of kind.
func (a *Agent) PoolReady(kind network.Kind) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.pool[kind])
}

// WaitPool blocks until the pool of kind holds n ready slots or ctx ends.
func (a *Agent) WaitPool(ctx context.Context, kind network.Kind, n int) error {
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for a.PoolReady(kind) < n {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}
