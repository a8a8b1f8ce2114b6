package node

import (
	"strings"
	"testing"
)

func TestRuntimeTOML(t *testing.T) {
	toml := RuntimeTOML("gvisor", "/run/a.sock", "")
	for _, want := range []string{`agent_socket = "/run/a.sock"`, "checkpoint = true", "agent_ready_timeout"} {
		if !strings.Contains(toml, want) {
			t.Errorf("gvisor config lacks %q:\n%s", want, toml)
		}
	}
	if toml := RuntimeTOML("vm", "/run/a.sock", "/g"); !strings.Contains(toml, `guest_dir = "/g"`) || !strings.Contains(toml, "enabled = true") {
		t.Errorf("vm config:\n%s", toml)
	}
	if toml := RuntimeTOML("runc", "", ""); toml != "" {
		t.Errorf("runc config: %q", toml)
	}
}
