package agent

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/nft"
	"github.com/cubesandbox/cube/internal/network/slotstore"
)

// Condition is one health check.
type Condition struct {
	Type    string
	OK      bool
	Message string
}

// Health is the agent's state for /readyz, the Health RPC and cubelet.
type Health struct {
	OK                    bool
	Conditions            []Condition
	InUse, Free           int
	PoolReady, PoolTarget int
}

// Health checks the store, the host table (without it sandboxes could
// reach the host) and the namespace directory.
func (a *Agent) Health(context.Context) Health {
	var h Health
	add := func(typ string, err error) {
		c := Condition{Type: typ, OK: err == nil}
		if err != nil {
			c.Message = err.Error()
		}
		h.Conditions = append(h.Conditions, c)
	}
	if !a.ready.Load() {
		add("started", fmt.Errorf("starting or stopping: %w", errdefs.ErrUnavailable))
	} else {
		add("started", nil)
	}
	_, err := a.store.Meta("prefix")
	add("store", err)
	ok, err := nft.HasTable(-1, a.cfg.Prefix)
	if err == nil && !ok {
		err = fmt.Errorf("host table %q is missing", a.cfg.Prefix)
	}
	if err == nil {
		if ok, err = nft.HasTable6(-1, a.cfg.Prefix); err == nil && !ok {
			err = fmt.Errorf("host IPv6 table %q is missing", a.cfg.Prefix)
		}
	}
	add("host-rules", err)
	_, err = os.Stat(a.cfg.NetnsDir())
	add("netns-dir", err)
	if a.egress != nil {
		add("egress", a.EgressHealth())
	}
	h.OK = true
	for _, c := range h.Conditions {
		h.OK = h.OK && c.OK
	}
	a.mu.Lock()
	h.InUse = len(a.bySandbox)
	h.PoolReady = len(a.pool[network.Container]) + len(a.pool[network.VM])
	space := a.space
	a.mu.Unlock()
	h.Free = space.Size() - space.InUse()
	h.PoolTarget = a.cfg.Pool.Size + a.cfg.Pool.VMSize
	return h
}

// EgressHealth reports whether the egress proxy serves every sandbox
// assigned more than a few seconds ago (one being assigned right now may
// not be attached yet); nil when the proxy is off.
func (a *Agent) EgressHealth() error {
	if a.egress == nil {
		return nil
	}
	settled := time.Now().Add(-5 * time.Second)
	a.mu.Lock()
	ids := make([]string, 0, len(a.bySandbox))
	for id, i := range a.bySandbox {
		if r := a.slots[i]; r != nil && r.State == slotstore.Assigned && r.AssignedAt.Before(settled) {
			ids = append(ids, id)
		}
	}
	a.mu.Unlock()
	return a.egress.Health(ids)
}
