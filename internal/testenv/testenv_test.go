package testenv_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/testenv"
)

// TestMissing runs a test that lacks a prerequisite twice in a child
// process: skipped without CI, failed with CI=true.
func TestMissing(t *testing.T) {
	if os.Getenv("TESTENV_CHILD") == "1" {
		testenv.RequireBinary(t, "cube-no-such-binary", "nothing")
		t.Fatal("RequireBinary returned for a missing binary")
	}
	for _, c := range []struct {
		ci, want string
		fails    bool
	}{
		{ci: "", want: "--- SKIP: TestMissing", fails: false},
		{ci: "true", want: "prerequisite missing under CI=true", fails: true},
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestMissing$", "-test.v")
		cmd.Env = append(os.Environ(), "TESTENV_CHILD=1", "CI="+c.ci)
		out, err := cmd.CombinedOutput()
		if (err != nil) != c.fails || !strings.Contains(string(out), c.want) {
			t.Errorf("CI=%q: err %v, output:\n%s\nwant %q and failure=%v", c.ci, err, out, c.want, c.fails)
		}
	}
}

func TestRequireBinaryFound(t *testing.T) {
	if p := testenv.RequireBinary(t, "sh", "dash"); !strings.HasSuffix(p, "/sh") {
		t.Fatalf("RequireBinary(sh) = %q", p)
	}
}
