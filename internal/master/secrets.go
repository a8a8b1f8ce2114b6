package master

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/secretbox"
)

// A team's secrets are values its credential rules name instead of
// holding them ({"host", "header", "secretName"}): the catalog keeps them
// sealed (secretbox, under the master key), the API lists their names
// only, and the master opens one only to put it into the policy it sends
// to the sandbox's node, which keeps it in memory (docs/network.md,
// "Secrets").

// SecretMeta is what the API says about a secret: never its value.
type SecretMeta struct {
	Name      string
	CreatedAt time.Time
	UpdatedAt time.Time
}

var secretNameRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_.-]{0,63}$`)

// maxSecretValue is the node's bound on a credential value.
const maxSecretValue = 8 << 10

// openSecretBox loads the master key: [secrets] key_file, or with SQLite
// secrets.key beside the catalog file (made at first start). With MySQL
// and no key_file there is none: replicas must share one key, which only
// the operator can arrange, so the secrets API says so instead of each
// replica making its own. reason says why there is none.
func openSecretBox(cfg *Config) (box *secretbox.Box, reason string, err error) {
	path := cfg.Secrets.KeyFile
	if path == "" {
		dsn, _, _ := strings.Cut(strings.TrimPrefix(cfg.Catalog.DSN, "file:"), "?")
		switch {
		case cfg.Catalog.Driver != catalog.SQLite:
			return nil, "secrets need [secrets] key_file with a MySQL catalog (the same key file on every replica)", nil
		case dsn == ":memory:":
			return nil, "secrets need [secrets] key_file with an in-memory catalog", nil
		}
		path = filepath.Join(filepath.Dir(dsn), "secrets.key")
	}
	box, err = secretbox.Load(path)
	if err != nil {
		return nil, "", err
	}
	return box, "", nil
}

// secretAAD binds a sealed value to its team and name: a row copied to
// another team or name does not open.
func secretAAD(team, name string) []byte { return []byte("cube secret\x00" + team + "\x00" + name) }

func (s *Service) secretsBox() (*secretbox.Box, error) {
	if s.box == nil {
		return nil, fmt.Errorf("%s: %w", s.noBox, errdefs.ErrFailedPrecondition)
	}
	return s.box, nil
}

// secretTeam is the team whose secrets ctx may use and change.
func secretTeam(ctx context.Context) string {
	if t := TeamOf(ctx); t != "" {
		return t
	}
	return catalog.DefaultTeam
}

func validateSecret(name, value string) error {
	if !secretNameRE.MatchString(name) {
		return errdefs.FieldErrorf("name", "%q: want a letter or _, then letters, digits, _ . or -, at most 64", name)
	}
	switch {
	case value == "":
		return errdefs.FieldErrorf("value", "empty")
	case len(value) > maxSecretValue:
		return errdefs.FieldErrorf("value", "longer than %d bytes", maxSecretValue)
	case strings.ContainsAny(value, "\r\n\x00"):
		return errdefs.FieldErrorf("value", "holds a line break or NUL (it is sent as an HTTP header value)")
	}
	return nil
}

// PutSecret stores a secret of the caller's team, sealed: a new one, or
// with replace an existing one's new value. Sandboxes already running
// keep the value they were given until their policy is sent again
// (a network update, a resume or a clone).
func (s *Service) PutSecret(ctx context.Context, name, value string, replace bool) (*SecretMeta, error) {
	team := secretTeam(ctx)
	if replace && secretNameRE.MatchString(name) {
		// An unknown name is 404 whatever the body holds.
		if _, err := s.cat.GetSecret(ctx, team, name); err != nil {
			return nil, err
		}
	}
	if err := validateSecret(name, value); err != nil {
		return nil, err
	}
	box, err := s.secretsBox()
	if err != nil {
		return nil, err
	}
	now := time.Now().UTC()
	row := &catalog.Secret{Team: team, Name: name, KeyID: box.KeyID(), Sealed: box.Seal(secretAAD(team, name), []byte(value)),
		CreatedAt: now, UpdatedAt: now}
	if replace {
		err = s.cat.ReplaceSecret(ctx, row)
	} else {
		err = s.cat.CreateSecret(ctx, row)
	}
	if err != nil {
		return nil, err
	}
	s.log.Info("secret stored", "team", team, "name", name, "replace", replace)
	return &SecretMeta{Name: name, CreatedAt: row.CreatedAt, UpdatedAt: row.UpdatedAt}, nil
}

// ListSecrets returns the caller's team's secrets, names only.
func (s *Service) ListSecrets(ctx context.Context) ([]SecretMeta, error) {
	rows, err := s.cat.ListSecrets(ctx, secretTeam(ctx))
	if err != nil {
		return nil, err
	}
	out := make([]SecretMeta, 0, len(rows))
	for _, r := range rows {
		out = append(out, SecretMeta{Name: r.Name, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt})
	}
	return out, nil
}

// DeleteSecret removes a secret of the caller's team. Running sandboxes
// keep the value they were given; a later send of a policy naming it
// (update, resume, clone) fails until the rule is changed.
func (s *Service) DeleteSecret(ctx context.Context, name string) error {
	team := secretTeam(ctx)
	if err := s.cat.DeleteSecret(ctx, team, name); err != nil {
		return err
	}
	s.log.Info("secret deleted", "team", team, "name", name)
	return nil
}

// secretValue opens one secret of team for credential rule i.
func (s *Service) secretValue(ctx context.Context, team string, i int, name string) (string, error) {
	field := fmt.Sprintf("network.credentials[%d].secretName", i)
	row, err := s.cat.GetSecret(ctx, team, name)
	if errors.Is(err, errdefs.ErrNotFound) {
		return "", errdefs.FieldErrorf(field, "no secret named %q in team %q (create it with POST /secrets)", name, team)
	}
	if err != nil {
		return "", err
	}
	box, err := s.secretsBox()
	if err != nil {
		return "", err
	}
	if row.KeyID != box.KeyID() {
		return "", fmt.Errorf("%s: secret %q was sealed under master key %s, this master has %s (is [secrets] key_file the same on every replica?): %w",
			field, name, row.KeyID, box.KeyID(), errdefs.ErrFailedPrecondition)
	}
	v, err := box.Open(secretAAD(team, name), row.Sealed)
	if err != nil {
		// Not the node's fault: no retry elsewhere helps.
		return "", fmt.Errorf("%s: secret %q: %v: %w", field, name, err, errdefs.ErrFailedPrecondition)
	}
	return string(v), nil
}

// checkSecrets fails as a bad request when a credential rule of n names a
// secret team does not have, before anything is placed.
func (s *Service) checkSecrets(ctx context.Context, team string, n catalog.Network) error {
	_, err := s.nodeNetwork(ctx, team, n)
	return err
}

// nodeNetwork is the node's form of the egress rules, with the values of
// the secrets the credential rules name (team's); nil when the sandbox
// keeps the node default (nodes refuse policies they cannot apply, e.g.
// without a network-agent, so none is sent unless asked for).
func (s *Service) nodeNetwork(ctx context.Context, team string, n catalog.Network) (*cubeletpb.NetworkPolicy, error) {
	if n.AllowInternet == nil && len(n.AllowOut) == 0 && len(n.DenyOut) == 0 && len(n.Credentials) == 0 && len(n.Requests) == 0 {
		return nil, nil
	}
	if team == "" {
		team = catalog.DefaultTeam
	}
	p := &cubeletpb.NetworkPolicy{AllowInternetAccess: n.AllowInternet, AllowOut: n.AllowOut, DenyOut: n.DenyOut}
	for i, c := range n.Credentials {
		v := c.Value
		if c.SecretName != "" {
			var err error
			if v, err = s.secretValue(ctx, team, i, c.SecretName); err != nil {
				return nil, err
			}
		}
		p.Credentials = append(p.Credentials, &cubeletpb.Credential{Host: c.Host, Header: c.Header, Value: v})
	}
	for _, r := range n.Requests {
		p.Requests = append(p.Requests, &cubeletpb.RequestRule{Host: r.Host, Methods: r.Methods, Paths: r.Paths})
	}
	return p, nil
}
