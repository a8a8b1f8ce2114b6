package cubelet

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cubesandbox/cube/internal/cubelet/actions"
	"github.com/cubesandbox/cube/internal/storage"
)

// startStorage runs after reconcile: it settles the snapshots and the
// verbs a crash interrupted, then starts the disk pool, adopting the ready
// disks of known templates.
func (s *Service) startStorage(ctx context.Context) error {
	s.reconcileSnapshots(ctx)
	tmpls, err := s.store.ListTemplates()
	if err != nil {
		return err
	}
	srcs := make([]storage.DiskSource, 0, len(tmpls))
	for _, t := range tmpls {
		srcs = append(srcs, actions.DiskSource(t))
	}
	pc := s.cfg.Storage.DiskPool
	dp := storage.NewDiskPool(s.node.Pool, storage.DiskPoolConfig{
		Size: pc.Size, RefillPerSecond: pc.RefillPerSecond, Log: s.log,
	})
	adopted, removed, err := dp.Start(srcs)
	if err != nil {
		s.log.Warn("disk pool: could not remove some stale ready disks", "err", err)
	}
	s.log.Info("disk pool started", "templates", len(srcs), "size", pc.Size, "adopted", adopted, "removed", removed)
	s.node.Disks = dp
	s.metrics.MustRegister(&storageCollector{s: s})
	return nil
}

// stopStorage drains the disk pool (Close).
func (s *Service) stopStorage() {
	if s.node.Disks == nil {
		return
	}
	if err := s.node.Disks.Close(); err != nil {
		s.log.Warn("disk pool close", "err", err)
	}
}

// drainTemplateDisks removes a deleted template's ready disks.
func (s *Service) drainTemplateDisks(templateID string) {
	if s.node.Disks == nil {
		return
	}
	if err := s.node.Disks.Drain(templateID); err != nil {
		s.log.Warn("disk pool drain", "template_id", templateID, "err", err)
	}
}

// storageCollector exports the disk pool's hit and miss counters and the
// number of snapshots at scrape time.
type storageCollector struct{ s *Service }

var _ prometheus.Collector = (*storageCollector)(nil)

var (
	poolHitsDesc = prometheus.NewDesc("cubelet_disk_pool_hits_total",
		"Creates that got a ready disk from the pool.", []string{"template"}, nil)
	poolMissesDesc = prometheus.NewDesc("cubelet_disk_pool_misses_total",
		"Creates that found the pool empty and cloned inline.", []string{"template"}, nil)
	poolReadyDesc = prometheus.NewDesc("cubelet_disk_pool_ready",
		"Ready disks in the pool now.", []string{"template"}, nil)
	snapshotsDesc = prometheus.NewDesc("cubelet_snapshots",
		"Snapshots on this node.", nil, nil)
)

func (c *storageCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- poolHitsDesc
	ch <- poolMissesDesc
	ch <- poolReadyDesc
	ch <- snapshotsDesc
}

func (c *storageCollector) Collect(ch chan<- prometheus.Metric) {
	if dp := c.s.node.Disks; dp != nil {
		for _, st := range dp.Stats() {
			ch <- prometheus.MustNewConstMetric(poolHitsDesc, prometheus.CounterValue, float64(st.Hits), st.TemplateID)
			ch <- prometheus.MustNewConstMetric(poolMissesDesc, prometheus.CounterValue, float64(st.Misses), st.TemplateID)
			ch <- prometheus.MustNewConstMetric(poolReadyDesc, prometheus.GaugeValue, float64(st.Ready), st.TemplateID)
		}
	}
	if snaps, err := c.s.store.ListSnapshots(); err == nil {
		ch <- prometheus.MustNewConstMetric(snapshotsDesc, prometheus.GaugeValue, float64(len(snaps)))
	}
}
