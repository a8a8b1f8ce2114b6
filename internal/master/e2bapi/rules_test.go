package e2bapi

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// TestCredentialsFromRules: E2B's network.rules become credential rules
// (the SDK's body, as Sandbox.create and updateNetwork send it).
func TestCredentialsFromRules(t *testing.T) {
	raw := json.RawMessage(`{"*.example.com":[{"transform":{"headers":{"X-Key":"k"}}}],
		"api.openai.com":[{},{"transform":{"headers":{"Authorization":"Bearer sk","OpenAI-Org":"o"}}}]}`)
	got, err := credentialsFromRules("network.rules", raw)
	if err != nil {
		t.Fatal(err)
	}
	want := []catalog.Credential{{Host: "*.example.com", Header: "X-Key", Value: "k"},
		{Host: "api.openai.com", Header: "Authorization", Value: "Bearer sk"},
		{Host: "api.openai.com", Header: "OpenAI-Org", Value: "o"}}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v, want %+v", got, want)
	}
	for _, absent := range []string{"", "null"} {
		if got, err := credentialsFromRules("rules", json.RawMessage(absent)); got != nil || err != nil {
			t.Errorf("%q: %v %v (absent keeps the rules)", absent, got, err)
		}
	}
	if got, err := credentialsFromRules("rules", json.RawMessage(`{}`)); got == nil || len(got) != 0 || err != nil {
		t.Errorf("{}: %v %v (present and empty removes them)", got, err)
	}
	if _, err := credentialsFromRules("rules", json.RawMessage(`["a.com"]`)); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a list: %v", err)
	}
}
