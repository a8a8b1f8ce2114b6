package master

import (
	"context"
	"fmt"
	"regexp"
	"time"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master/catalog"
)

// Tenancy: the E2B API scopes every call to the team of its API key
// (WithTeam). A scoped call sees only the team's sandboxes and snapshots;
// another team's is NotFound, exactly like one that does not exist, so a
// key learns nothing about other teams' IDs or snapshot names. Calls
// without a scope (the admin API, the route, the master's own loops) see
// everything. Templates imported on nodes are shared by every team, as
// E2B's public templates are; deleting one needs an admin key.

type teamKey struct{}

// WithTeam scopes the Service calls made with ctx to one team.
func WithTeam(ctx context.Context, team string) context.Context {
	if team == "" {
		team = catalog.DefaultTeam
	}
	return context.WithValue(ctx, teamKey{}, team)
}

// TeamOf is the team ctx is scoped to; "" when it is not scoped.
func TeamOf(ctx context.Context) string {
	t, _ := ctx.Value(teamKey{}).(string)
	return t
}

// inScope reports whether an object of team may be seen with ctx.
func inScope(ctx context.Context, team string) bool {
	t := TeamOf(ctx)
	return t == "" || t == team
}

var teamNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

// CreateTeam adds a team with a quota (zero fields: no limit).
func (s *Service) CreateTeam(ctx context.Context, name string, q catalog.Quota) (*catalog.Team, error) {
	if !teamNameRE.MatchString(name) {
		return nil, errdefs.FieldErrorf("name", "%q: 1-63 lower-case letters, digits, '.', '_' or '-'", name)
	}
	if err := validQuota(q); err != nil {
		return nil, err
	}
	t := &catalog.Team{Name: name, CreatedAt: time.Now().UTC(), Quota: q}
	if err := s.cat.CreateTeam(ctx, t); err != nil {
		return nil, err
	}
	s.log.Info("team created", "team", name, "max_sandboxes", q.MaxSandboxes, "max_milli_cpu", q.MaxMilliCPU, "max_memory_mib", q.MaxMemoryMiB)
	return t, nil
}

// SetTeamQuota replaces a team's quota.
func (s *Service) SetTeamQuota(ctx context.Context, name string, q catalog.Quota) error {
	if err := validQuota(q); err != nil {
		return err
	}
	if err := s.cat.SetTeamQuota(ctx, name, q); err != nil {
		return err
	}
	s.log.Info("team quota set", "team", name, "max_sandboxes", q.MaxSandboxes, "max_milli_cpu", q.MaxMilliCPU, "max_memory_mib", q.MaxMemoryMiB)
	return nil
}

// ListTeams returns every team and what its sandboxes hold now.
func (s *Service) ListTeams(ctx context.Context) ([]*catalog.Team, map[string]catalog.TeamUsage, error) {
	return s.cat.ListTeams(ctx)
}

func validQuota(q catalog.Quota) error {
	for field, v := range map[string]int64{"max_sandboxes": q.MaxSandboxes, "max_milli_cpu": q.MaxMilliCPU, "max_memory_mib": q.MaxMemoryMiB} {
		if v < 0 {
			return errdefs.FieldErrorf(field, "%d: must not be negative (0 is no limit)", v)
		}
	}
	return nil
}

// notFound is the answer for an object out of the caller's scope: the
// same as for one that does not exist.
func notFound(kind, id string) error { return fmt.Errorf("%s %q: %w", kind, id, errdefs.ErrNotFound) }
