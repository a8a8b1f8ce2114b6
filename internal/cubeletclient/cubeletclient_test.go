package cubeletclient_test

import (
	"testing"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubeletclient"
)

func TestStateNames(t *testing.T) {
	for v := range pb.SandboxState_name {
		s := pb.SandboxState(v)
		name := cubeletclient.StateName(s)
		got, ok := cubeletclient.ParseState(name)
		if s == pb.SandboxState_SANDBOX_STATE_UNSPECIFIED {
			if name != "unspecified" || ok {
				t.Fatalf("unspecified: %q %v", name, ok)
			}
			continue
		}
		if !ok || got != s {
			t.Fatalf("%s: name %q parses as %s %v", s, name, got, ok)
		}
	}
	if got, ok := cubeletclient.ParseState("RUNNING"); !ok || got != pb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("RUNNING: %s %v", got, ok)
	}
	if _, ok := cubeletclient.ParseState("sleeping"); ok {
		t.Fatal("sleeping parsed")
	}
	if n := cubeletclient.StateName(pb.SandboxState(999)); n != "unspecified" {
		t.Fatalf("999: %q", n)
	}
}
