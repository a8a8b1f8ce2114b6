package master

import (
	"context"
	"errors"
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

// TeamDeleted is what deleting a team removed.
type TeamDeleted struct {
	Keys      []*catalog.APIKey // revoked
	Sandboxes []string          // killed (force)
	Snapshots []string          // deleted (force)
	Volumes   []string          // deleted (force)
}

// DeleteTeam removes a team and revokes its API keys. While the team holds
// sandboxes, snapshots or volumes it is refused (catalog.TeamInUseError,
// FailedPrecondition) unless force: then its keys are revoked first (no
// new create can start with them), its sandboxes killed and its snapshots
// deleted, then its volumes, and the team removed once none is left. by names the caller for
// the audit line. The team "default" holds the keys made without a team
// and cannot be deleted.
func (s *Service) DeleteTeam(ctx context.Context, name string, force bool, by string) (*TeamDeleted, error) {
	if name == catalog.DefaultTeam {
		return nil, fmt.Errorf("team %q: keys created without a team belong to it; it cannot be deleted: %w", name, errdefs.ErrFailedPrecondition)
	}
	if _, err := s.cat.GetTeam(ctx, name); err != nil {
		return nil, err
	}
	out := &TeamDeleted{}
	defer func() {
		s.log.Info("audit", "action", "team delete", "team", name, "by", by, "force", force,
			"revoked_keys", len(out.Keys), "killed_sandboxes", out.Sandboxes, "deleted_snapshots", out.Snapshots)
	}()
	ctx = WithTeam(ctx, name) // lists and lookups see this team's rows only
	for attempt := 0; ; attempt++ {
		keys, err := s.cat.DeleteTeam(ctx, name)
		var inUse *catalog.TeamInUseError
		switch {
		case err == nil:
			s.keys.Forget(keys...)
			out.Keys = append(out.Keys, keys...)
			return out, nil
		case !force || !errors.As(err, &inUse) || attempt == 3:
			return out, err
		}
		if attempt == 0 {
			all, err := s.keys.List(ctx)
			if err != nil {
				return out, err
			}
			for _, k := range all {
				if k.Team != name {
					continue
				}
				if _, err := s.keys.Delete(ctx, k.ID); err != nil && !errdefs.IsNotFound(err) {
					return out, err
				}
				out.Keys = append(out.Keys, k)
			}
		}
		sbs, err := s.ListAll(ctx, catalog.Query{Team: name})
		if err != nil {
			return out, err
		}
		for _, sb := range sbs {
			if err := s.Kill(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
				return out, fmt.Errorf("kill sandbox %s of team %q: %w", sb.ID, name, err)
			}
			s.log.Info("audit", "sandbox_id", sb.ID, "action", "kill (team delete)", "team", name, "by", by)
			out.Sandboxes = append(out.Sandboxes, sb.ID)
		}
		snaps, _, err := s.ListSnapshots(ctx, catalog.SnapshotQuery{Team: name})
		if err != nil {
			return out, err
		}
		for _, sn := range snaps {
			if err := s.DeleteSnapshot(ctx, sn.ID); err != nil && !errdefs.IsNotFound(err) {
				return out, fmt.Errorf("delete snapshot %s of team %q: %w", sn.ID, name, err)
			}
			out.Snapshots = append(out.Snapshots, sn.ID)
		}
		vols, err := s.ListVolumes(ctx)
		if err != nil {
			return out, err
		}
		for _, v := range vols {
			if err := s.DeleteVolume(ctx, v.ID); err != nil && !errdefs.IsNotFound(err) {
				return out, fmt.Errorf("delete volume %s of team %q: %w", v.ID, name, err)
			}
			out.Volumes = append(out.Volumes, v.ID)
		}
	}
}
