package config

import (
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestSnapshotConfigValidation(t *testing.T) {
	for _, bad := range []string{
		"[storage.disk_pool]\nsize = -1\n",
		"[[storage.host_mount_allow]]\nprefix = \"relative\"\n",
		"[[storage.host_mount_allow]]\nprefix = \"/\"\n",
		"[snapshots]\nmax_per_node = -1\n",
		"[snapshots]\nclone_parallelism = 0\n",
	} {
		if _, err := Parse([]byte(bad)); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%q: want InvalidArgument, got %v", bad, err)
		}
	}
	c, err := Parse([]byte("[[storage.host_mount_allow]]\nprefix = \"/srv/a\"\nread_only = true\n[[storage.host_mount_allow]]\nprefix = \"/srv/b\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if r := c.Storage.HostMountAllow; len(r) != 2 || !r[0].ReadOnly || r[1].Prefix != "/srv/b" {
		t.Fatalf("host_mount_allow: %+v", r)
	}
	if c.Storage.DiskPool.Size != 16 || c.Snapshots.CloneParallelism != 8 {
		t.Fatalf("defaults: %+v %+v", c.Storage.DiskPool, c.Snapshots)
	}
}

// TestDataListenerNeedsTLS: api.data's only guard is the caller's
// certificate, so without [tls] it is refused, even on loopback; the
// control, the same address with [tls], is accepted.
func TestDataListenerNeedsTLS(t *testing.T) {
	if _, err := Parse([]byte("[api]\ndata = \"127.0.0.1:9997\"\n")); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("api.data without [tls]: %v, want InvalidArgument", err)
	}
	c, err := Parse([]byte("[api]\ndata = \"127.0.0.1:9997\"\n[tls]\ncert = \"/c\"\nkey = \"/k\"\nca = \"/ca\"\n"))
	if err != nil || c.API.Data != "127.0.0.1:9997" {
		t.Fatalf("api.data with [tls]: %v %+v", err, c.API)
	}
}

// TestSentryOverhead: [gvisor] sentry_overhead_mib defaults to 160 MiB,
// 0 reaches the driver as "none" (its own 0 means its default), and a
// negative value is refused.
func TestSentryOverhead(t *testing.T) {
	c, err := Parse(nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Gvisor.SentryOverheadMiB != 160 || c.Gvisor.SentryOverhead() != 160<<20 {
		t.Fatalf("default: %d MiB, driver %d", c.Gvisor.SentryOverheadMiB, c.Gvisor.SentryOverhead())
	}
	c, err = Parse([]byte("[gvisor]\nsentry_overhead_mib = 0\n"))
	if err != nil || c.Gvisor.SentryOverhead() != -1 {
		t.Fatalf("0: %v, driver %d, want -1 (none)", err, c.Gvisor.SentryOverhead())
	}
	if _, err := Parse([]byte("[gvisor]\nsentry_overhead_mib = -1\n")); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("-1: %v, want InvalidArgument", err)
	}
}
