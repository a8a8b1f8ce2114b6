package main

import (
	"bytes"
	"strings"
	"testing"
)

// Before quietConsole the console gets every line, after it warnings and
// errors only; the sandbox's log gets every line throughout.
func TestQuietConsole(t *testing.T) {
	var console, ring bytes.Buffer
	log, quietConsole := newLog(&console, &ring)
	log.Info("booting")
	quietConsole()
	log.Info("re-initialised")
	log.Warn("refused")
	for _, c := range []struct {
		name string
		got  string
		want []string
		not  []string
	}{
		{"console", console.String(), []string{"booting", "refused"}, []string{"re-initialised"}},
		{"sandbox log", ring.String(), []string{"booting", "re-initialised", "refused"}, nil},
	} {
		for _, w := range c.want {
			if !strings.Contains(c.got, w) {
				t.Errorf("%s lacks %q:\n%s", c.name, w, c.got)
			}
		}
		for _, w := range c.not {
			if strings.Contains(c.got, w) {
				t.Errorf("%s has %q:\n%s", c.name, w, c.got)
			}
		}
	}
}
