package tomlconfig_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/tomlconfig"
)

type conf struct {
	Name  string              `toml:"name"`
	Every tomlconfig.Duration `toml:"every"`
}

func (c *conf) Validate() error {
	if c.Name == "" {
		return errors.New("name is required")
	}
	return nil
}

const defaults = "name = \"a\"\nevery = \"2s\"\n"

func TestParse(t *testing.T) {
	c, err := tomlconfig.Parse[conf]([]byte(defaults), []byte(`every = "5m"`))
	if err != nil || c.Name != "a" || c.Every.Minutes() != 5 {
		t.Fatalf("Parse = %+v, %v; want name a, every 5m", c, err)
	}
	if _, err := tomlconfig.Parse[conf]([]byte(defaults), []byte(`nmae = "typo"`)); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("unknown key: %v, want invalid argument", err)
	}
	if _, err := tomlconfig.Parse[conf]([]byte(defaults), []byte(`name = ""`)); err == nil || !strings.Contains(err.Error(), "name is required") {
		t.Fatalf("Validate not called: %v", err)
	}
}

func TestLoad(t *testing.T) {
	c, err := tomlconfig.Load[conf]([]byte(defaults), "")
	if err != nil || c.Every.Seconds() != 2 {
		t.Fatalf("Load(\"\") = %+v, %v; want the defaults", c, err)
	}
	p := filepath.Join(t.TempDir(), "c.toml")
	if err := os.WriteFile(p, []byte(`name = 3`), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := tomlconfig.Load[conf]([]byte(defaults), p); err == nil || !strings.Contains(err.Error(), p) {
		t.Fatalf("a bad file's error must name it: %v", err)
	}
	if _, err := tomlconfig.Load[conf]([]byte(defaults), p+".missing"); err == nil {
		t.Fatal("a missing file must be an error")
	}
}
