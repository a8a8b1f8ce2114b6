// Package sandboxid holds the rules for the IDs of sandboxes, templates and
// snapshots: how they are made and what a valid one looks like. It is a leaf
// so that every package that names a sandbox (records, network slots, the
// route, the catalog) agrees on one rule without importing each other.
package sandboxid

import (
	"crypto/rand"
	"fmt"
	"regexp"

	"github.com/cubesandbox/cube/internal/errdefs"
)

var idRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// Validate checks a sandbox, template or snapshot ID: a DNS label
// (lowercase letters, digits, '-', 1-63 chars), because IDs end up in host
// names (<port>-<id>.<domain>), cgroup paths and file names. kind names
// the ID in the error.
func Validate(kind, id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("%s id %q: must be 1-63 lowercase letters, digits or '-', not starting or ending with '-': %w", kind, id, errdefs.ErrInvalidArgument)
	}
	return nil
}

const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"

// New returns a random 20-character ID like E2B's.
func New() string {
	b := make([]byte, 20)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	// IDs start with a letter so they never look like a number.
	b[0] = alphabet[int(b[0])%26]
	return string(b)
}
