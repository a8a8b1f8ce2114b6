package e2bapi_test

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"testing"

	toml "github.com/pelletier/go-toml/v2"

	"github.com/cubesandbox/cube/internal/agent"
)

// TestEnvdVersionMeetsSDKGates: the envd version the agent reports (and
// the API passes on) is at least every gate of the SDKs' bundles
// (testdata/envd-gates.txt), so no feature the SDK enables is one the
// agent lacks, and the master's fallback for rows without a recorded
// version is that same version. The control row is a gate above it,
// which the comparison must report unmet.
func TestEnvdVersionMeetsSDKGates(t *testing.T) {
	have := semver(t, agent.EnvdVersion)
	f, err := os.Open("testdata/envd-gates.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fs := strings.SplitN(line, " ", 3)
		if len(fs) != 3 {
			t.Fatalf("bad line %q", line)
		}
		n++
		if !atLeast(have, semver(t, fs[1])) {
			t.Errorf("%s gates %q on envd %s; the agent reports %s", fs[0], fs[2], fs[1], agent.EnvdVersion)
		}
	}
	if n < 10 {
		t.Fatalf("only %d gates: the list is cut", n)
	}
	if atLeast(have, [3]int{have[0], have[1], have[2] + 1}) {
		t.Fatal("control: a gate above the agent's version passed")
	}
	var def struct {
		Sandbox struct {
			EnvdVersion string `toml:"envd_version"`
		} `toml:"sandbox"`
	}
	b, err := os.ReadFile("../default.toml")
	if err != nil {
		t.Fatal(err)
	}
	if err := toml.Unmarshal(b, &def); err != nil {
		t.Fatal(err)
	}
	if def.Sandbox.EnvdVersion != agent.EnvdVersion {
		t.Errorf("master's sandbox.envd_version default %q, the agent reports %q", def.Sandbox.EnvdVersion, agent.EnvdVersion)
	}
}

func semver(t *testing.T, s string) [3]int {
	t.Helper()
	var v [3]int
	parts := strings.Split(s, ".")
	if len(parts) != 3 {
		t.Fatalf("version %q", s)
	}
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil {
			t.Fatalf("version %q: %v", s, err)
		}
		v[i] = n
	}
	return v
}

func atLeast(have, want [3]int) bool {
	for i := range have {
		if have[i] != want[i] {
			return have[i] > want[i]
		}
	}
	return true
}
