// Command fork prepares a sandbox once, snapshots it, and starts several
// copies of it: from the snapshot and by forking the running sandbox.
//
//	E2B_API_KEY=... E2B_API_URL=... E2B_SANDBOX_URL=... go run ./examples/fork -n 3
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"time"

	"github.com/cubesandbox/cube/sdk/go/sandbox"
)

func main() {
	template := flag.String("template", "base", "template to start")
	n := flag.Int("n", 2, "forks to make")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *template, *n); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, template string, n int) error {
	client, err := sandbox.NewClient(sandbox.Config{})
	if err != nil {
		return err
	}
	cleanup := context.WithoutCancel(ctx)
	src, err := client.Create(ctx, sandbox.CreateOptions{Template: template})
	if err != nil {
		return err
	}
	defer src.Kill(cleanup) //nolint:errcheck // best effort; the sandbox dies at its timeout anyway
	if _, err := src.Commands.Run(ctx, "echo prepared at $(date) > /tmp/state", nil); err != nil {
		return err
	}

	snap, err := src.CreateSnapshot(ctx, "")
	if err != nil {
		return err
	}
	defer client.DeleteSnapshot(cleanup, snap.SnapshotID) //nolint:errcheck // best effort
	start := time.Now()
	child, err := client.Create(ctx, sandbox.CreateOptions{Template: snap.SnapshotID})
	if err != nil {
		return err
	}
	defer child.Kill(cleanup) //nolint:errcheck // as above
	fmt.Printf("from snapshot %s: %s in %v\n", snap.SnapshotID, child.ID, time.Since(start).Round(time.Millisecond))

	start = time.Now()
	forks, err := src.Fork(ctx, n, 5*time.Minute)
	if err != nil {
		return err
	}
	fmt.Printf("%d forks in %v\n", len(forks), time.Since(start).Round(time.Millisecond))
	for _, f := range forks {
		if f.Err != nil {
			fmt.Println("fork failed:", f.Err)
			continue
		}
		res, err := f.Sandbox.Commands.Run(ctx, "cat /tmp/state", nil)
		if err != nil {
			return err
		}
		fmt.Printf("%s: %s", f.Sandbox.ID, res.Stdout)
		_ = f.Sandbox.Kill(cleanup)
	}
	return nil
}
