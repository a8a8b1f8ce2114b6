package agent

import "testing"

// TestDefaultWorkdir: the template's working directory is the agent's
// default until /init names another; without one, the user's home ("").
func TestDefaultWorkdir(t *testing.T) {
	if got := New(Config{DefaultWorkdir: "/srv/site"}).state.Workdir(); got != "/srv/site" {
		t.Fatalf("default workdir %q, want /srv/site", got)
	}
	if got := New(Config{}).state.Workdir(); got != "" {
		t.Fatalf("control: without a template workdir the default is %q, want the home (\"\")", got)
	}
}
