package chart

import (
	"encoding/base64"
	"os"
	"os/exec"
)

func execGo(args ...string) (string, error) {
	out, err := exec.Command("go", args...).CombinedOutput()
	return string(out), err
}

// execGoRun runs a command of the main module from its root.
func execGoRun(dir string, pkg string, args ...string) (string, error) {
	cmd := exec.Command("go", append([]string{"run", pkg}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func base64Decode(s string) ([]byte, error) { return base64.StdEncoding.DecodeString(s) }
