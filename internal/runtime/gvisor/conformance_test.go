package gvisor

import (
	"testing"

	"github.com/cubesandbox/cube/internal/runtime"
	"github.com/cubesandbox/cube/internal/runtime/runtimetest"
)

func TestConformance(t *testing.T) {
	requireRunsc(t)
	var parent string
	runtimetest.Run(t,
		func(t *testing.T) runtime.Driver {
			parent = cgroupParent(t)
			return newTestDriver(t)
		},
		func(t *testing.T, id string) runtime.Spec {
			return shellSpec(t, parent, id, "exec sleep 1000000")
		},
	)
}
