package runtimetest

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

// fakeDriver knows no sandbox; each verb returns what its field says.
type fakeDriver struct {
	name                               string
	caps                               runtime.Capabilities
	pause, resume, checkpoint, restore error
}

func (f *fakeDriver) Name() string                       { return f.name }
func (f *fakeDriver) Capabilities() runtime.Capabilities { return f.caps }
func (f *fakeDriver) Start(context.Context, runtime.Spec) (runtime.State, error) {
	return runtime.State{}, fmt.Errorf("fake: %w", errdefs.ErrNotImplemented)
}
func (f *fakeDriver) Restore(context.Context, runtime.Spec, string) (runtime.State, error) {
	return runtime.State{}, f.restore
}
func (f *fakeDriver) Pause(context.Context, string) error  { return f.pause }
func (f *fakeDriver) Resume(context.Context, string) error { return f.resume }
func (f *fakeDriver) Checkpoint(context.Context, string, string, bool) error {
	return f.checkpoint
}
func (f *fakeDriver) Stop(context.Context, string) error { return nil }
func (f *fakeDriver) State(context.Context, string) (runtime.State, error) {
	return runtime.State{}, errdefs.ErrNotFound
}
func (f *fakeDriver) List(context.Context) ([]runtime.State, error) { return nil, nil }

// inPlace adds runtime.InPlaceRestorer to a fakeDriver.
type inPlace struct {
	*fakeDriver
	err error
}

func (d inPlace) RestoreInPlace(context.Context, string, string) (runtime.State, error) {
	return runtime.State{}, d.err
}

var (
	errNotFound = fmt.Errorf("fake: %w", errdefs.ErrNotFound)
	errNotImpl  = fmt.Errorf("fake: %w", errdefs.ErrNotImplemented)
)

// pauseOnly is a consistent driver that can pause and nothing more.
func pauseOnly() *fakeDriver {
	return &fakeDriver{name: "fake", caps: runtime.Capabilities{Pause: true},
		pause: errNotFound, resume: errNotFound, checkpoint: errNotImpl, restore: errNotImpl}
}

// allVerbs is a consistent driver that can do every verb.
func allVerbs() *fakeDriver {
	return &fakeDriver{name: "fake", caps: runtime.Capabilities{Pause: true, Checkpoint: true, Restore: true},
		pause: errNotFound, resume: errNotFound, checkpoint: errNotFound, restore: errNotFound}
}

func TestCapabilityProblems(t *testing.T) {
	for name, tc := range map[string]struct {
		d    runtime.Driver
		want string // "" = no problem; else a substring of the only problem
	}{
		"pause only":                     {d: pauseOnly()},
		"all verbs":                      {d: allVerbs()},
		"all verbs, in place":            {d: inPlace{allVerbs(), errNotFound}},
		"no memory verbs, in place":      {d: inPlace{pauseOnly(), errNotImpl}},
		"no name":                        {d: func() runtime.Driver { d := pauseOnly(); d.name = ""; return d }(), want: "Name is empty"},
		"checkpoint false but works":     {d: func() runtime.Driver { d := pauseOnly(); d.checkpoint = nil; return d }(), want: "Checkpoint: Capabilities says unsupported"},
		"restore false but tries":        {d: func() runtime.Driver { d := pauseOnly(); d.restore = errNotFound; return d }(), want: "Restore: Capabilities says unsupported"},
		"pause true but not implemented": {d: func() runtime.Driver { d := pauseOnly(); d.pause = errNotImpl; return d }(), want: "Pause(absent)"},
		"resume not implemented":         {d: func() runtime.Driver { d := pauseOnly(); d.resume = errNotImpl; return d }(), want: "Resume(absent)"},
		"pause false, resume works": {d: func() runtime.Driver {
			d := pauseOnly()
			d.caps.Pause, d.pause = false, errNotImpl
			return d
		}(), want: "Resume: Capabilities says unsupported"},
		"restore without checkpoint": {d: func() runtime.Driver {
			d := allVerbs()
			d.caps.Checkpoint, d.checkpoint = false, errNotImpl
			return d
		}(), want: "Restore without Checkpoint"},
		"in place without restore": {d: inPlace{pauseOnly(), errNotFound}, want: "RestoreInPlace: Capabilities says unsupported"},
		"in place not implemented": {d: inPlace{allVerbs(), errNotImpl}, want: "RestoreInPlace(absent)"},
	} {
		t.Run(name, func(t *testing.T) {
			got := capabilityProblems(t.Context(), tc.d, t.TempDir)
			switch {
			case tc.want == "" && len(got) != 0:
				t.Errorf("problems %q, want none", got)
			case tc.want != "" && (len(got) != 1 || !strings.Contains(got[0], tc.want)):
				t.Errorf("problems %q, want one containing %q", got, tc.want)
			}
		})
	}
}
