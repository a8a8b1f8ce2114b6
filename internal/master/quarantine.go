package master

import (
	"context"
	"log/slog"

	"github.com/cubesandbox/cube/internal/master/catalog"
)

// quarantine moves the catalog rows that no longer decode out of service
// (catalog.Quarantine), logging each at error level with its key, so one
// damaged row costs that sandbox, not every list and deadline scan. A
// failure to move them is logged and the master starts anyway: the rest
// of the catalog still serves.
func quarantine(ctx context.Context, cat *catalog.Catalog, log *slog.Logger) {
	qs, err := cat.Quarantine(ctx)
	for _, q := range qs {
		log.Error("catalog: undecodable row quarantined", "table", q.Table, "key", q.Key, "reason", q.Reason)
	}
	if err != nil {
		log.Error("catalog: quarantine of undecodable rows failed", "err", err)
	}
}
