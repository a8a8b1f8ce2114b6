package lifecycle

import (
	"errors"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestTransitions(t *testing.T) {
	legal := []struct{ from, to State }{
		{Creating, Running}, {Running, Paused}, {Paused, Running},
		{Running, Snapshotting}, {Snapshotting, Running}, {Paused, Destroying},
		{Destroying, Destroyed}, {Failed, Destroying}, {Unknown, Running},
	}
	for _, c := range legal {
		if err := Check("sb", c.from, c.to, ""); err != nil {
			t.Errorf("%s -> %s: %v", c.from, c.to, err)
		}
	}
	illegal := []struct{ from, to State }{
		{Paused, Paused}, {Running, Running}, {Destroyed, Running},
		{Creating, Paused}, {Failed, Running}, {Destroying, Running},
	}
	for _, c := range illegal {
		err := Check("sb", c.from, c.to, "frob")
		if !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("%s -> %s: want FailedPrecondition, got %v", c.from, c.to, err)
			continue
		}
		var te *TransitionError
		if !errors.As(err, &te) || te.From != c.from {
			t.Errorf("%s -> %s: no TransitionError with current state: %v", c.from, c.to, err)
		}
		if !strings.Contains(err.Error(), string(c.from)) {
			t.Errorf("message %q lacks the current state", err)
		}
	}
}

func TestEveryStateKnown(t *testing.T) {
	for _, s := range All {
		if !s.Valid() {
			t.Errorf("%s not in the transition table", s)
		}
	}
	if State("bogus").Valid() {
		t.Error("bogus state is valid")
	}
}
