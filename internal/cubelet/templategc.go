package cubelet

import (
	"context"
	"slices"
	"time"
)

// templateGC removes templates that no sandbox and no snapshot has used
// for gc.templates_unused_after. "Unused since" is kept in memory only, so
// it costs nothing on the create path; after a restart the clock starts
// again, which only ever delays a removal.
func (s *Service) templateGC(ctx context.Context) {
	after := s.cfg.GC.TemplatesUnusedAfter.Duration
	if after <= 0 {
		return
	}
	tmpls, err := s.store.ListTemplates()
	if err != nil {
		return
	}
	used := map[string]bool{}
	recs, _ := s.List(ctx, ListFilter{})
	for _, r := range recs {
		used[r.TemplateID] = true
	}
	if snaps, err := s.store.ListSnapshots(); err == nil {
		for _, sn := range snaps {
			used[sn.TemplateID] = true
		}
	}
	now := time.Now()
	s.tmplMu.Lock()
	if s.unusedSince == nil {
		s.unusedSince = map[string]time.Time{}
	}
	var expired []string
	for _, t := range tmpls {
		if used[t.ID] || s.importing[t.ID] || slices.Contains(s.cfg.GC.KeepTemplates, t.ID) {
			delete(s.unusedSince, t.ID)
			continue
		}
		since, ok := s.unusedSince[t.ID]
		if !ok {
			// A template imported long ago but never used counts from its
			// import, not from the first GC pass that saw it.
			since = t.CreatedAt
			if since.IsZero() || since.After(now) {
				since = now
			}
			s.unusedSince[t.ID] = since
		}
		if now.Sub(since) >= after {
			expired = append(expired, t.ID)
		}
	}
	s.tmplMu.Unlock()
	for _, id := range expired {
		// DeleteTemplate re-checks under its lock that nothing uses it: a
		// create that raced this pass wins and the template stays.
		if err := s.DeleteTemplate(ctx, id); err != nil {
			s.log.Debug("template GC skipped", "template_id", id, "err", err)
			continue
		}
		s.tmplMu.Lock()
		delete(s.unusedSince, id)
		s.tmplMu.Unlock()
		s.log.Info("template GC removed an unused template", "template_id", id, "unused_for", after)
	}
}
