package cubeletapi

import (
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/lifecycle"
	"github.com/cubesandbox/cube/internal/sandbox"
)

// TestStateNames: the client names API states without the lifecycle
// package; its names must be the lifecycle's.
func TestStateNames(t *testing.T) {
	for _, s := range lifecycle.All {
		p := stateToPB(s)
		if name := cubeletclient.StateName(p); name != string(s) {
			t.Errorf("%s: client names it %q", s, name)
		}
		if got, ok := cubeletclient.ParseState(string(s)); !ok || got != p {
			t.Errorf("%s: client parses it as %s %v", s, got, ok)
		}
		if back := StateFromPB(p); back != s {
			t.Errorf("%s: back as %q", s, back)
		}
	}
}

// TestTokenNeverReturned: the access token a sandbox (and a snapshot of
// it) holds stays in cubelet; the API's records never carry it. The
// control is the same record's environment, which the API does return,
// so the check reads the fields the conversion fills.
func TestTokenNeverReturned(t *testing.T) {
	const tok, env = "secret-token-0123456789", "env-value-0123456789"
	rec := &sandbox.Record{ID: "tok", State: lifecycle.Running, AccessToken: tok, Env: map[string]string{"E": env}}
	sn := &sandbox.Snapshot{ID: "snap", SandboxID: "tok", AccessToken: tok, Env: map[string]string{"E": env}}
	for name, m := range map[string]proto.Message{"sandbox": sandboxToPB(rec), "snapshot": snapshotToPB(sn)} {
		b, err := protojson.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), tok) {
			t.Errorf("%s record returned by the API carries the token: %s", name, b)
		}
		if name == "sandbox" && !strings.Contains(string(b), env) {
			t.Errorf("control: the sandbox's env is not in %s", b)
		}
	}
}
