package main

import (
	"net/http"
	"testing"
)

// TestDecide: only an authenticated token of the node pods' service
// account, bound to a pod on the node asked for, gets a join token; each
// refusal differs from the accepted control in one thing only.
func TestDecide(t *testing.T) {
	const user = "system:serviceaccount:cube-system:cube-node"
	ok := reviewed{Authenticated: true, User: user, Extra: map[string][]string{nodeNameExtra: {"n1"}}}
	if code, why := decide(ok, user, "cube-join", "n1"); code != http.StatusOK {
		t.Fatalf("control: the node pod's own token for its node refused: %d %s", code, why)
	}
	for _, c := range []struct {
		name string
		rv   reviewed
		node string
		want int
	}{
		{"not authenticated (another audience, expired)", reviewed{User: user, Extra: ok.Extra}, "n1", http.StatusUnauthorized},
		{"another service account", reviewed{Authenticated: true, User: "system:serviceaccount:cube-system:default", Extra: ok.Extra}, "n1", http.StatusForbidden},
		{"a token bound to no pod", reviewed{Authenticated: true, User: user}, "n1", http.StatusForbidden},
		{"another node's name", ok, "n2", http.StatusForbidden},
	} {
		code, why := decide(c.rv, user, "cube-join", c.node)
		t.Logf("%s: %d (%s)", c.name, code, why)
		if code != c.want {
			t.Errorf("%s: %d, want %d", c.name, code, c.want)
		}
	}
}
