package ocispec

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/runtime"
)

var update = flag.Bool("update", false, "rewrite testdata golden files")

func TestForGolden(t *testing.T) {
	// The golden files pin the amd64 seccomp profile on every builder.
	defer func(a string) { hostArch = a }(hostArch)
	hostArch = "amd64"
	cases := map[string]runtime.Spec{
		"full": {
			ID:         "sb-1",
			BundleDir:  "/run/cube/sb-1",
			RootFS:     "/var/lib/cube/sb-1/rootfs",
			Args:       []string{"/usr/local/bin/cube-agent", "--addr", ":49983"},
			Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
			Cwd:        "/home/user",
			Hostname:   "sandbox",
			Limits:     runtime.Limits{MilliCPU: 1500, MemoryMiB: 512, Pids: 256},
			CgroupPath: "/cube/sb-1",
			NetNSPath:  "/var/run/netns/slot-7",
			Mounts: []runtime.Mount{
				{Source: "/srv/data", Destination: "/data", ReadOnly: true},
				{Source: "/srv/work", Destination: "/work"},
			},
			Labels: map[string]string{"cube.sandbox": "sb-1", "cube.template": "base"},
		},
		"minimal": {
			ID:     "sb-2",
			RootFS: "/var/lib/cube/sb-2/rootfs",
			Args:   []string{"/bin/sleep", "1000000"},
		},
	}
	for name, in := range cases {
		t.Run(name, func(t *testing.T) {
			sp, err := For(in)
			if err != nil {
				t.Fatal(err)
			}
			got, err := json.MarshalIndent(sp, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, '\n')
			golden := filepath.Join("testdata", "spec-"+name+".json")
			if *update {
				if err := os.WriteFile(golden, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run with -update to create)", err)
			}
			if string(got) != string(want) {
				t.Errorf("For(%s) differs from %s (run with -update if intended):\n%s", name, golden, got)
			}
		})
	}
}

func TestForRejectsInvalid(t *testing.T) {
	ok := runtime.Spec{ID: "x", RootFS: "/r", Args: []string{"/bin/true"}}
	for name, mut := range map[string]func(*runtime.Spec){
		"no id":           func(s *runtime.Spec) { s.ID = "" },
		"no args":         func(s *runtime.Spec) { s.Args = nil },
		"relative rootfs": func(s *runtime.Spec) { s.RootFS = "rootfs" },
		"relative cgroup": func(s *runtime.Spec) { s.CgroupPath = "cube/x" },
		"relative mount":  func(s *runtime.Spec) { s.Mounts = []runtime.Mount{{Source: "a", Destination: "/a"}} },
	} {
		s := ok
		mut(&s)
		if _, err := For(s); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: err = %v, want ErrInvalidArgument", name, err)
		}
	}
}

// TestForAgentGOMAXPROCS checks the agent's GOMAXPROCS: set, and listed
// for the agent to unset, when the template names none; a template's own
// left alone and not unset (its processes are meant to inherit it).
func TestForAgentGOMAXPROCS(t *testing.T) {
	for _, tc := range []struct {
		env  []string
		want []string
	}{
		{nil, []string{"GOMAXPROCS=" + agentproto.AgentGOMAXPROCS, agentproto.AgentOnlyEnv + "=GOMAXPROCS"}},
		{[]string{"GOMAXPROCS=4"}, []string{"GOMAXPROCS=4"}},
	} {
		sp, err := For(runtime.Spec{ID: "sb", RootFS: "/r", Args: []string{"/a"}, Env: tc.env})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(sp.Process.Env, tc.want) {
			t.Errorf("template env %q: process env %q, want %q", tc.env, sp.Process.Env, tc.want)
		}
	}
}
