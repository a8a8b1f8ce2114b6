package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/cubesandbox/cube/sdk/go/sandbox"
)

// Create a sandbox from the environment's configuration (E2B_API_KEY,
// E2B_API_URL or E2B_DOMAIN), run a command and kill the sandbox.
func Example() {
	ctx := context.Background()
	client, err := sandbox.NewClient(sandbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	sbx, err := client.Create(ctx, sandbox.CreateOptions{Template: "base", Timeout: 5 * time.Minute})
	if err != nil {
		log.Fatal(err)
	}
	defer sbx.Kill(ctx) //nolint:errcheck // the sandbox dies at its timeout anyway

	res, err := sbx.Commands.Run(ctx, "echo hello from $(hostname)", nil)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print(res.Stdout)
}

// Stream a command's output as it comes and tell a failed command from a
// failed call.
func ExampleCommands_Run() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	sbx, err := client.Create(ctx, sandbox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sbx.Kill(ctx) //nolint:errcheck // the sandbox dies at its timeout anyway

	_, err = sbx.Commands.Run(ctx, "for i in 1 2 3; do echo $i; sleep 1; done; exit 2", &sandbox.RunOptions{
		OnStdout: func(s string) { fmt.Print("out: ", s) },
		OnStderr: func(s string) { fmt.Fprint(os.Stderr, "err: ", s) },
		Timeout:  time.Minute,
	})
	var exit *sandbox.CommandExitError
	switch {
	case errors.As(err, &exit):
		fmt.Println("exit code", exit.ExitCode)
	case errors.Is(err, sandbox.ErrTimeout):
		fmt.Println("timed out")
	case err != nil:
		log.Fatal(err)
	}
}

// Start a process in the background, feed its stdin, and wait for it.
func ExampleCommands_Start() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	sbx, err := client.Create(ctx, sandbox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sbx.Kill(ctx) //nolint:errcheck // the sandbox dies at its timeout anyway

	h, err := sbx.Commands.Start(ctx, "wc -l", &sandbox.RunOptions{Stdin: true})
	if err != nil {
		log.Fatal(err)
	}
	_ = h.SendStdin(ctx, []byte("a\nb\n"))
	_ = h.CloseStdin(ctx)
	res, err := h.Wait(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print(res.Stdout)
}

// Run an interactive shell on a terminal.
func ExamplePty_Create() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	sbx, err := client.Create(ctx, sandbox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sbx.Kill(ctx) //nolint:errcheck // the sandbox dies at its timeout anyway

	term, err := sbx.Pty.Create(ctx, sandbox.PtyOptions{Cols: 80, Rows: 24, OnData: func(b []byte) { os.Stdout.Write(b) }})
	if err != nil {
		log.Fatal(err)
	}
	_ = sbx.Pty.SendInput(ctx, term.PID, []byte("ls /\n"))
	_ = sbx.Pty.Resize(ctx, term.PID, 120, 40)
	_ = sbx.Pty.SendInput(ctx, term.PID, []byte("exit\n"))
	_, _ = term.Wait(ctx)
}

// Write, read and watch files.
func ExampleFiles_WatchDir() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	sbx, err := client.Create(ctx, sandbox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sbx.Kill(ctx) //nolint:errcheck // the sandbox dies at its timeout anyway

	w, err := sbx.Files.WatchDir(ctx, "/tmp", func(e sandbox.FilesystemEvent) {
		fmt.Println(e.Type, e.Name)
	}, &sandbox.WatchOptions{Recursive: true})
	if err != nil {
		log.Fatal(err)
	}
	defer w.Stop()
	if _, err := sbx.Files.Write(ctx, "/tmp/hello.txt", []byte("hello"), nil); err != nil {
		log.Fatal(err)
	}
	data, err := sbx.Files.Read(ctx, "/tmp/hello.txt", nil)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(data))
}

// List the sandboxes whose metadata matches, page by page.
func ExampleClient_List() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	pager := client.List(sandbox.ListOptions{
		Metadata: map[string]string{"user": "alice"},
		States:   []sandbox.State{sandbox.StateRunning, sandbox.StatePaused},
	})
	for pager.HasNext() {
		page, err := pager.Next(ctx)
		if err != nil {
			log.Fatal(err)
		}
		for _, s := range page {
			fmt.Println(s.SandboxID, s.State, s.EndAt)
		}
	}
}

// Pause a sandbox and bring it back later by its ID.
func ExampleClient_Connect() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	sbx, err := client.Create(ctx, sandbox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	if err := sbx.Pause(ctx); err != nil {
		log.Fatal(err)
	}
	again, err := client.Connect(ctx, sbx.ID, 10*time.Minute) // resumes it
	if errors.Is(err, sandbox.ErrNotFound) {
		log.Fatal("the sandbox is gone")
	}
	if err != nil {
		log.Fatal(err)
	}
	_ = again.Kill(ctx)
}

// Snapshot a sandbox, start another from the snapshot, and fork it.
func ExampleSandbox_CreateSnapshot() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	sbx, err := client.Create(ctx, sandbox.CreateOptions{})
	if err != nil {
		log.Fatal(err)
	}
	defer sbx.Kill(ctx) //nolint:errcheck // the sandbox dies at its timeout anyway

	snap, err := sbx.CreateSnapshot(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	child, err := client.Create(ctx, sandbox.CreateOptions{Template: snap.SnapshotID})
	if err != nil {
		log.Fatal(err)
	}
	defer child.Kill(ctx) //nolint:errcheck // as above

	forks, err := sbx.Fork(ctx, 2, 5*time.Minute)
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range forks {
		if f.Err != nil {
			log.Print(f.Err)
			continue
		}
		fmt.Println("fork", f.Sandbox.ID)
		_ = f.Sandbox.Kill(ctx)
	}
	_ = client.DeleteSnapshot(ctx, snap.SnapshotID)
}

// Tell the kinds of failure apart with errors.Is.
func ExampleAPIError() {
	ctx := context.Background()
	client, _ := sandbox.NewClient(sandbox.Config{})
	_, err := client.Create(ctx, sandbox.CreateOptions{})
	var api *sandbox.APIError
	switch {
	case errors.Is(err, sandbox.ErrRateLimit) && errors.As(err, &api) && api.RetryAfter > 0:
		fmt.Println("no room now; retry in", api.RetryAfter)
	case errors.Is(err, sandbox.ErrRateLimit):
		fmt.Println("over the team's quota")
	case errors.Is(err, sandbox.ErrAuth):
		fmt.Println("check E2B_API_KEY")
	case err != nil:
		fmt.Println(err)
	}
}
