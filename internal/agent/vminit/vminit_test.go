package vminit

import (
	"bytes"
	"errors"
	"testing"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestParseCmdline(t *testing.T) {
	c, err := ParseCmdline("console=ttyS0 quiet cube.hostname=sb-1.local cube.ip=169.254.0.21/30 cube.gw=169.254.0.22 cube.resolver=169.254.0.22\n")
	if err != nil {
		t.Fatal(err)
	}
	if c.Hostname != "sb-1.local" || c.Addr.String() != "169.254.0.21/30" || c.Gateway.String() != "169.254.0.22" || c.Resolver.String() != "169.254.0.22" {
		t.Fatalf("%+v", c)
	}
	if c, err := ParseCmdline("root=/dev/vda"); err != nil || c.Addr.IsValid() || c.Hostname != "" {
		t.Fatalf("no cube params: %+v %v", c, err)
	}
	for _, bad := range []string{"cube.hostname=-x", "cube.hostname=a_b", "cube.ip=10.0.0.1", "cube.ip=fd00::1/64",
		"cube.gw=nope cube.ip=10.0.0.1/24", "cube.gw=10.0.0.1", "cube.resolver=dns"} {
		if _, err := ParseCmdline(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

// The egress CA crosses the kernel command line intact.
func TestParseCmdlineEgressCA(t *testing.T) {
	der := []byte{0x30, 0x82, 0x01, 0xff, 0x00, 0x10, 0xfe}
	c, err := ParseCmdline("quiet " + agentproto.EgressCAParam + "=" + agentproto.EncodeCA(der))
	if err != nil || !bytes.Equal(c.EgressCA, der) {
		t.Fatalf("%+v %v", c, err)
	}
	if _, err := ParseCmdline(agentproto.EgressCAParam + "=!!"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad base64: %v", err)
	}
}

func TestSetupNeedsPID1(t *testing.T) {
	if _, err := Setup(nil); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("got %v", err)
	}
}
