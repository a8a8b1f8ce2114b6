package netagent

import (
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet/config"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/runtime"
)

func TestSlotKind(t *testing.T) {
	if k := SlotKind(runtime.Capabilities{SlotTAP: true}); k != network.VM {
		t.Errorf("SlotTAP: %v", k)
	}
	if k := SlotKind(runtime.Capabilities{NeedsSlot: true}); k != network.Container {
		t.Errorf("NeedsSlot: %v", k)
	}
}

func TestWithoutAgent(t *testing.T) {
	a := New(config.NetworkConfig{})
	if c, err := a.Client(); c != nil || err != nil {
		t.Fatalf("client without a socket: %v %v", c, err)
	}
	if on, err := a.Health(t.Context()); on || err != nil {
		t.Fatalf("health without a socket: %v %v", err, on)
	}
	if err := a.CheckPolicy(nil); err != nil {
		t.Fatal(err)
	}
	if err := a.CheckPolicy(&policy.Policy{}); err != nil {
		t.Fatal(err)
	}
}

func TestCheckPolicyRefusesWithoutAgent(t *testing.T) {
	a := New(config.NetworkConfig{})
	no := false
	p := &policy.Policy{AllowInternet: &no}
	if err := a.CheckPolicy(p); !errdefs.IsFailedPrecondition(err) {
		t.Fatalf("want FailedPrecondition, got %v", err)
	}
}
