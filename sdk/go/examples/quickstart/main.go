// Command quickstart creates a sandbox, streams a command's output,
// writes and reads a file, and kills the sandbox. Configure it like any
// E2B SDK:
//
//	E2B_API_KEY=... E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3001 \
//	  go run ./examples/quickstart -template base
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
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *template); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, template string) error {
	client, err := sandbox.NewClient(sandbox.Config{})
	if err != nil {
		return err
	}
	start := time.Now()
	sbx, err := client.Create(ctx, sandbox.CreateOptions{Template: template, Metadata: map[string]string{"example": "quickstart"}})
	if err != nil {
		return err
	}
	defer func() {
		if err := sbx.Kill(context.WithoutCancel(ctx)); err != nil {
			log.Print(err)
		}
	}()
	fmt.Printf("sandbox %s (%s) created in %v\n", sbx.ID, sbx.Runtime, time.Since(start).Round(time.Millisecond))

	_, err = sbx.Commands.Run(ctx, `for i in 1 2 3; do echo "line $i"; sleep 0.5; done; uname -a >&2`, &sandbox.RunOptions{
		OnStdout: func(s string) { fmt.Print("stdout: ", s) },
		OnStderr: func(s string) { fmt.Print("stderr: ", s) },
	})
	if err != nil {
		return err
	}
	if _, err := sbx.Files.Write(ctx, "/tmp/greeting.txt", []byte("hello from Go\n"), nil); err != nil {
		return err
	}
	res, err := sbx.Commands.Run(ctx, "cat /tmp/greeting.txt; ls -l /tmp", nil)
	if err != nil {
		return err
	}
	fmt.Print(res.Stdout)
	entries, err := sbx.Files.List(ctx, "/tmp", 1, nil)
	if err != nil {
		return err
	}
	for _, e := range entries {
		fmt.Printf("%s %s %d\n", e.Type, e.Path, e.Size)
	}
	return nil
}
