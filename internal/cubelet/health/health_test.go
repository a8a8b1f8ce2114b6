package health

import (
	"errors"
	"testing"
)

func TestWindow(t *testing.T) {
	tr := New(3)
	bad := errors.New("runc list: exit status 1")
	round := func(err error) Condition {
		t.Helper()
		cs := tr.Observe(map[string]error{"runtime/runc": err, "store": nil})
		if len(cs) != 2 || cs[0].Type != "runtime/runc" || cs[1].Type != "store" || !cs[1].OK {
			t.Fatalf("conditions %+v", cs)
		}
		return cs[0]
	}
	// One flap: still OK, reported as flapping (the node is busy).
	if c := round(bad); !c.OK || !c.Flapping || c.Failures != 1 {
		t.Fatalf("one failure: %+v, want OK and flapping", c)
	}
	if c := round(nil); !c.OK || c.Flapping || c.Failures != 0 {
		t.Fatalf("after a pass: %+v, want OK", c)
	}
	// Failures that do not follow each other never fail the condition.
	for i := range 10 {
		err := bad
		if i%2 == 1 {
			err = nil
		}
		if c := round(err); !c.OK {
			t.Fatalf("alternating round %d: %+v", i, c)
		}
	}
	round(nil)
	// N failed probes in a row: failing, with the last message.
	for i := 1; i <= 3; i++ {
		c := round(bad)
		if want := i < 3; c.OK != want || c.Failures != i {
			t.Fatalf("failure %d: %+v, want OK=%v", i, c, want)
		}
		if i == 3 && (c.Flapping || c.Message != bad.Error()) {
			t.Fatalf("failing condition %+v", c)
		}
	}
	ok, flapping := Summary(tr.Last())
	if ok || len(flapping) != 0 {
		t.Fatalf("summary ok=%v flapping=%v, want failing and none flapping", ok, flapping)
	}
	// One pass clears it.
	if c := round(nil); !c.OK || c.Failures != 0 {
		t.Fatalf("after recovery: %+v", c)
	}
	if ok, _ := Summary(tr.Last()); !ok {
		t.Fatal("summary not ok after recovery")
	}
}

func TestForgetsAbsentConditions(t *testing.T) {
	tr := New(2)
	tr.Observe(map[string]error{"network-agent": errors.New("down")})
	tr.Observe(map[string]error{})
	if c := tr.Observe(map[string]error{"network-agent": errors.New("down")}); !c[0].OK {
		t.Fatalf("a run broken by the condition's absence still counted: %+v", c)
	}
}
