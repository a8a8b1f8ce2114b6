package masterlink

import (
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet/config"
)

func TestAdvertiseData(t *testing.T) {
	for _, c := range []struct {
		name, bound, advertiseData, advertise, tcp, want string
	}{
		{"no listener", "", "", "", "", ""},
		{"a bound address", "10.0.0.5:9997", "", "", "127.0.0.1:9999", "10.0.0.5:9997"},
		{"set", "0.0.0.0:9997", "node-1.example:443", "", "", "node-1.example:443"},
		{"all interfaces: advertise's host", "[::]:9997", "", "node-1.example:9999", "0.0.0.0:9999", "node-1.example:9997"},
		{"all interfaces: api.tcp's host", "0.0.0.0:9997", "", "", "10.0.0.5:9999", "10.0.0.5:9997"},
		{"all interfaces, nothing better", "0.0.0.0:9997", "", "", "0.0.0.0:9999", "0.0.0.0:9997"},
	} {
		cfg := &config.Config{}
		cfg.Master.AdvertiseData, cfg.Master.Advertise, cfg.API.TCP = c.advertiseData, c.advertise, c.tcp
		if got := AdvertiseData(cfg, c.bound); got != c.want {
			t.Errorf("%s: %q, want %q", c.name, got, c.want)
		}
	}
}
