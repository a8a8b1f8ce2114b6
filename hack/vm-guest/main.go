// Command vm-guest builds the VM runtime's guest artifacts (kernel,
// initramfs, guest.json) into a directory cubelet reads through
// [vm] guest_dir. It is idempotent: a second run with the same kernel
// returns at once. See docs/vm-guest.md.
//
//	go run ./hack/vm-guest [--out /var/lib/cube/vm] [--cache /var/cache/cube/vm]
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/cubesandbox/cube/internal/vmguest"
)

func main() {
	out := flag.String("out", vmguest.DefaultOutDir, "directory to write vmlinuz, initrd.img and guest.json to")
	cache := flag.String("cache", vmguest.DefaultCacheDir, "directory that keeps the downloaded kernel package")
	meta := flag.String("metapackage", vmguest.DefaultMetapackage, "Debian metapackage naming the guest kernel")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	a, err := vmguest.Build(ctx, vmguest.BuildConfig{OutDir: *out, CacheDir: *cache, Metapackage: *meta, Log: log})
	if err != nil {
		log.Error("build vm guest", "error", err)
		os.Exit(1)
	}
	fmt.Printf("kernel %s\nvmlinuz %s\ninitrd %s\nmodules %v\n", a.KernelVersion, a.Kernel, a.Initrd, a.Modules)
}
