// Package testenv handles a test whose prerequisite (root, a binary, a
// kernel feature, a device) is missing. Outside CI the test is skipped
// with the reason, so a developer's machine without runsc still runs the
// rest. Under CI=true it fails instead: CI installs everything the suite
// needs (hack/deps.sh), so a missing prerequisite there is a broken
// machine or a regression, and a silent skip would hide it.
//
// Skips that are not about prerequisites (a long form behind an env var,
// a capability the driver under test does not claim) stay plain t.Skip.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// InCI reports whether the suite runs in CI (CI=true, as .ci/run and most
// CI systems set it).
func InCI() bool { return os.Getenv("CI") == "true" }

// Missing skips t, or fails it under CI, saying what is missing.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if InCI() {
		t.Fatalf("prerequisite missing under CI=true (hack/deps.sh installs what the suite needs): %s", msg)
	}
	t.Skip(msg)
}

// RequireRoot calls Missing unless the test runs as root; why says what
// needs it.
func RequireRoot(t testing.TB, why string) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "needs root: %s", why)
	}
}

// RequireBinary returns the path of the named program, or calls Missing
// (pkg names the Debian package that has it).
func RequireBinary(t testing.TB, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		Missing(t, "needs %s (Debian package %s)", name, pkg)
	}
	return p
}
