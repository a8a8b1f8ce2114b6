package cubelet

import (
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/cubelet/config"
)

// TestPoolTarget: a pool holds its configured size, grows with the
// creates of the rate window, never past max, forgets creates older than
// the window, and a template without a size has no pool however busy.
func TestPoolTarget(t *testing.T) {
	cfg := &config.Config{}
	cfg.WarmPool = config.WarmPoolConfig{Size: 0, Templates: map[string]int{"a": 2}, Max: 5,
		RateWindow: config.Duration{Duration: 10 * time.Second}}
	p := newWarmPool(&Service{cfg: cfg})
	now := time.Now()
	creates := func(id string, n int, at time.Time) {
		p.recent[id] = nil
		for range n {
			p.recent[id] = append(p.recent[id], at)
		}
	}
	for _, c := range []struct {
		name  string
		id    string
		n     int
		age   time.Duration
		want  int
		cause string
	}{
		{"idle", "a", 0, 0, 2, "configured size"},
		{"busy", "a", 4, time.Second, 4, "creates in the window"},
		{"busier than max", "a", 50, time.Second, 5, "bounded by max"},
		{"past the window", "a", 50, 11 * time.Second, 2, "old creates forgotten"},
		{"no pool", "b", 50, time.Second, 0, "size 0 stays off"},
	} {
		creates(c.id, c.n, now.Add(-c.age))
		if got := p.target(c.id, now); got != c.want {
			t.Errorf("%s: target %d, want %d (%s)", c.name, got, c.want, c.cause)
		}
	}
}
