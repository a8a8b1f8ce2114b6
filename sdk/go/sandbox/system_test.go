package sandbox_test

// The SDK against a running CubeSandbox (or any E2B-compatible service):
// E2B_API_URL and E2B_API_KEY say where (E2B_SANDBOX_URL or E2B_DOMAIN
// how to reach sandboxes), CUBE_E2E_TEMPLATE which template to start
// (default "base"; its /bin/bash may be busybox's ash), and
// CUBE_E2E_QUOTA_KEY, when set, a key of a team whose quota is one
// sandbox. test/e2e/node/system starts `cube up`'s system and sets them
// all:
//
//	go run ./test/e2e/node/system -- bash -c 'cd sdk/go && go test -count=1 ./...'
//
// Without E2B_API_URL the tests skip, and fail under CI=true.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cubesandbox/cube/sdk/go/sandbox"
)

func newClient(t *testing.T) *sandbox.Client {
	t.Helper()
	record(t)
	if os.Getenv("E2B_API_URL") == "" || os.Getenv("E2B_API_KEY") == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("E2B_API_URL and E2B_API_KEY are not set: run through go run ./test/e2e/node/system (CI=true needs the system)")
		}
		t.Skip("E2B_API_URL and E2B_API_KEY are not set: run through go run ./test/e2e/node/system")
	}
	c, err := sandbox.NewClient(sandbox.Config{})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// record appends the test's result to $CUBE_E2E_RESULTS, when set, as
// the other SDK suites do (sdk, version, suite, runtime, case, result;
// tab-separated), for test/e2e/compat's docs/compatibility.md.
func record(t *testing.T) {
	out := os.Getenv("CUBE_E2E_RESULTS")
	if out == "" {
		return
	}
	t.Cleanup(func() {
		result := "pass"
		switch {
		case t.Failed():
			result = "fail"
		case t.Skipped():
			result = "skip"
		}
		runtime := os.Getenv("CUBE_E2E_RUNTIME")
		if runtime == "" {
			runtime = "runc"
		}
		line := strings.Join([]string{"cube Go SDK (sdk/go)", "in-tree", "sdk/go", runtime, t.Name(), result}, "\t") + "\n"
		f, err := os.OpenFile(out, os.O_APPEND|os.O_WRONLY|os.O_CREATE, 0o644)
		if err != nil {
			t.Errorf("recording the result: %v", err)
			return
		}
		defer f.Close()
		if _, err := f.WriteString(line); err != nil {
			t.Errorf("recording the result: %v", err)
		}
	})
}

func template() string {
	if t := os.Getenv("CUBE_E2E_TEMPLATE"); t != "" {
		return t
	}
	return "base"
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// create starts a sandbox that is killed when the test ends.
func create(t *testing.T, c *sandbox.Client, opts sandbox.CreateOptions) *sandbox.Sandbox {
	t.Helper()
	if opts.Template == "" {
		opts.Template = template()
	}
	sbx, err := c.Create(testContext(t), opts)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { kill(t, c, sbx.ID) })
	return sbx
}

func kill(t *testing.T, c *sandbox.Client, id string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.Kill(ctx, id); err != nil && !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("kill %s: %v", id, err)
	}
}

func run(t *testing.T, sbx *sandbox.Sandbox, cmd string) string {
	t.Helper()
	r, err := sbx.Commands.Run(testContext(t), cmd, nil)
	if err != nil {
		t.Fatalf("run %q: %v", cmd, err)
	}
	return r.Stdout
}

// until polls cond every 50 ms for up to 20 s.
func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func TestLifecycle(t *testing.T) {
	c := newClient(t)
	ctx := testContext(t)
	tag := fmt.Sprintf("go-%d", time.Now().UnixNano())
	sbx := create(t, c, sandbox.CreateOptions{
		Metadata: map[string]string{"tag": tag, "role": "life cycle&"},
		Envs:     map[string]string{"GREETING": "hello from envs"},
		Timeout:  2 * time.Minute,
	})
	if sbx.EnvdAccessToken == "" {
		t.Error("the sandbox has no envd access token (not secure)")
	}
	if got := run(t, sbx, `echo "$GREETING"`); got != "hello from envs\n" {
		t.Errorf("envs: stdout %q", got)
	}
	info, err := sbx.GetInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.SandboxID != sbx.ID || info.State != sandbox.StateRunning || info.Metadata["role"] != "life cycle&" {
		t.Errorf("info %+v", info)
	}
	if left := time.Until(info.EndAt); left < 100*time.Second || left > 121*time.Second {
		t.Errorf("endAt is %v away, want about 2m", left)
	}
	if err := sbx.SetTimeout(ctx, 10*time.Minute); err != nil {
		t.Fatal(err)
	}
	if info, err = sbx.GetInfo(ctx); err != nil {
		t.Fatal(err)
	}
	if left := time.Until(info.EndAt); left < 9*time.Minute || left > 10*time.Minute+time.Second {
		t.Errorf("after SetTimeout(10m) endAt is %v away", left)
	}

	// A second sandbox with the same tag: metadata filters and paging.
	other := create(t, c, sandbox.CreateOptions{Metadata: map[string]string{"tag": tag, "role": "other"}})
	all, err := c.List(sandbox.ListOptions{Metadata: map[string]string{"tag": tag}}).All(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ids := infoIDs(all); !slices.Equal(ids, sortedIDs(sbx.ID, other.ID)) {
		t.Errorf("list by tag: %v, want both", ids)
	}
	byRole, err := c.List(sandbox.ListOptions{Metadata: map[string]string{"tag": tag, "role": "life cycle&"}}).All(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ids := infoIDs(byRole); !slices.Equal(ids, []string{sbx.ID}) {
		t.Errorf("list by tag and role (escaped value): %v, want [%s]", ids, sbx.ID)
	}
	pager := c.List(sandbox.ListOptions{Metadata: map[string]string{"tag": tag}, Limit: 1})
	var paged []sandbox.Info
	for pages := 0; pager.HasNext(); pages++ {
		if pages > 3 {
			t.Fatal("paging does not end")
		}
		page, err := pager.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) > 1 {
			t.Errorf("a page of limit 1 has %d", len(page))
		}
		paged = append(paged, page...)
	}
	if ids := infoIDs(paged); !slices.Equal(ids, sortedIDs(sbx.ID, other.ID)) {
		t.Errorf("paged: %v", ids)
	}

	// Pause keeps the disk; Connect resumes.
	run(t, sbx, "echo kept > /tmp/mark")
	if err := sbx.Pause(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sbx.Pause(ctx); !errors.Is(err, sandbox.ErrConflict) {
		t.Errorf("pause of a paused sandbox: %v, want ErrConflict", err)
	}
	paused, err := c.List(sandbox.ListOptions{Metadata: map[string]string{"tag": tag}, States: []sandbox.State{sandbox.StatePaused}}).All(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ids := infoIDs(paused); !slices.Equal(ids, []string{sbx.ID}) {
		t.Errorf("list paused: %v, want [%s]", ids, sbx.ID)
	}
	again, err := c.Connect(ctx, sbx.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if got := run(t, again, "cat /tmp/mark"); got != "kept\n" {
		t.Errorf("after pause and connect: %q", got)
	}
	// Resume by the verb too.
	if err := c.Pause(ctx, sbx.ID); err != nil {
		t.Fatal(err)
	}
	if err := sbx.Resume(ctx, time.Minute); err != nil {
		t.Fatal(err)
	}
	if got := run(t, sbx, "cat /tmp/mark"); got != "kept\n" {
		t.Errorf("after resume: %q", got)
	}

	if ok, err := sbx.IsRunning(ctx); err != nil || !ok {
		t.Errorf("IsRunning of a running sandbox: %v %v", ok, err)
	}
	if err := sbx.Kill(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sbx.GetInfo(ctx); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("info of a killed sandbox: %v, want ErrNotFound", err)
	}
	if err := c.Kill(ctx, sbx.ID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("kill of a killed sandbox: %v, want ErrNotFound", err)
	}
	t.Logf("lifecycle ok: create, info, setTimeout, list (metadata, state, paging), pause, connect, resume, kill")
}

// A sandbox created with AutoPause is paused at its timeout, not killed,
// and Connect brings it back with its files.
func TestAutoPause(t *testing.T) {
	c := newClient(t)
	ctx := testContext(t)
	sbx := create(t, c, sandbox.CreateOptions{AutoPause: true, Timeout: 2 * time.Second})
	run(t, sbx, "echo before > /tmp/auto")
	var state sandbox.State
	for deadline := time.Now().Add(time.Minute); state != sandbox.StatePaused; time.Sleep(200 * time.Millisecond) {
		info, err := sbx.GetInfo(ctx)
		if err != nil {
			t.Fatalf("info while waiting for the auto-pause: %v", err)
		}
		if state = info.State; time.Now().After(deadline) {
			t.Fatalf("not paused a minute after its 2 s timeout: %s", state)
		}
	}
	if _, err := c.Connect(ctx, sbx.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	if got := run(t, sbx, "cat /tmp/auto"); got != "before\n" {
		t.Errorf("after the auto-pause and connect: %q", got)
	}
	t.Logf("auto-pause ok: paused at the timeout, connect resumed it with its files")
}

func infoIDs(in []sandbox.Info) []string {
	ids := make([]string, 0, len(in))
	for _, i := range in {
		ids = append(ids, i.SandboxID)
	}
	slices.Sort(ids)
	return ids
}

func sortedIDs(ids ...string) []string {
	slices.Sort(ids)
	return ids
}

func TestErrors(t *testing.T) {
	c := newClient(t)
	ctx := testContext(t)
	var api *sandbox.APIError

	bad, err := sandbox.NewClient(sandbox.Config{APIKey: "e2b_not-a-key"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = bad.Create(ctx, sandbox.CreateOptions{Template: template()})
	if !errors.Is(err, sandbox.ErrAuth) || !errors.As(err, &api) || api.StatusCode != 401 {
		t.Errorf("create with a wrong key: %v, want ErrAuth (401)", err)
	}
	if _, err := c.GetInfo(ctx, "inoexistent0000000000"); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("info of an unknown sandbox: %v, want ErrNotFound", err)
	}
	_, err = c.Create(ctx, sandbox.CreateOptions{Template: "no-such-template"})
	if !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("create from an unknown template: %v, want ErrNotFound", err)
	}
	if errors.Is(err, sandbox.ErrAuth) || errors.Is(err, sandbox.ErrTimeout) {
		t.Errorf("%v matches more than one kind", err)
	}

	sbx := create(t, c, sandbox.CreateOptions{})
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	start := time.Now()
	_, err = sbx.Commands.Run(short, "sleep 30", nil)
	if !errors.Is(err, sandbox.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a command past its context's deadline: %v, want ErrTimeout", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("the deadline took %v to end the command", d)
	}
	_, err = sbx.Commands.Run(ctx, "sleep 30", &sandbox.RunOptions{Timeout: time.Second})
	if !errors.Is(err, sandbox.ErrTimeout) {
		t.Errorf("a command past its Timeout: %v, want ErrTimeout", err)
	}
	if _, err := sbx.Files.Read(ctx, "/no/such/file", nil); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("read of a missing file: %v, want ErrNotFound", err)
	}
	// The agent refuses a sandbox's calls without its own access token.
	other := create(t, c, sandbox.CreateOptions{})
	forged, err := c.Connect(ctx, other.ID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	forged.EnvdAccessToken = sbx.EnvdAccessToken
	if _, err := forged.Commands.Run(ctx, "true", nil); !errors.Is(err, sandbox.ErrAuth) {
		t.Errorf("a command with another sandbox's token: %v, want ErrAuth", err)
	}
	forged.EnvdAccessToken = other.EnvdAccessToken
	if _, err := forged.Commands.Run(ctx, "true", nil); err != nil {
		t.Errorf("control: the same call with the sandbox's own token: %v", err)
	}

	if key := os.Getenv("CUBE_E2E_QUOTA_KEY"); key != "" {
		q, err := sandbox.NewClient(sandbox.Config{APIKey: key})
		if err != nil {
			t.Fatal(err)
		}
		create(t, q, sandbox.CreateOptions{})
		_, err = q.Create(ctx, sandbox.CreateOptions{Template: template()})
		if !errors.Is(err, sandbox.ErrRateLimit) || !errors.As(err, &api) || api.StatusCode != 429 {
			t.Errorf("a create over the team's quota: %v, want ErrRateLimit (429)", err)
		}
		t.Logf("over quota: %v (retry after %v)", err, api.RetryAfter)
	} else {
		t.Log("CUBE_E2E_QUOTA_KEY is not set: the rate-limit case is not run")
	}
	t.Logf("errors ok: auth, not found, timeout (context and Timeout), missing file, token of another sandbox, rate limit")
}

func TestCommands(t *testing.T) {
	c := newClient(t)
	ctx := testContext(t)
	sbx := create(t, c, sandbox.CreateOptions{})

	// Output streams to the callbacks while the command runs.
	var mu sync.Mutex
	var outChunks, errChunks []string
	firstLine := make(chan struct{})
	var once sync.Once
	h, err := sbx.Commands.Start(ctx, `echo one; echo err >&2; sleep 1; echo two`, &sandbox.RunOptions{
		OnStdout: func(s string) {
			mu.Lock()
			outChunks = append(outChunks, s)
			mu.Unlock()
			once.Do(func() { close(firstLine) })
		},
		OnStderr: func(s string) {
			mu.Lock()
			errChunks = append(errChunks, s)
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if h.PID == 0 {
		t.Error("no PID")
	}
	select {
	case <-firstLine:
	case <-time.After(20 * time.Second):
		t.Fatal("no output streamed")
	}
	select {
	case <-h.Done():
		t.Error("the first line came only after the command ended: output is not streamed")
	default:
	}
	r, err := h.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if r.Stdout != "one\ntwo\n" || r.Stderr != "err\n" || strings.Join(outChunks, "") != r.Stdout || strings.Join(errChunks, "") != r.Stderr {
		t.Errorf("result %+v, chunks %q %q", r, outChunks, errChunks)
	}
	mu.Unlock()

	// A non-zero exit is a *CommandExitError with the result.
	r, err = sbx.Commands.Run(ctx, "echo out; echo bad >&2; exit 3", nil)
	var exit *sandbox.CommandExitError
	if !errors.As(err, &exit) || exit.ExitCode != 3 || exit.Stderr != "bad\n" || r == nil || r.Stdout != "out\n" {
		t.Errorf("exit 3: %v %+v", err, r)
	}

	// Envs, cwd and user.
	r, err = sbx.Commands.Run(ctx, `echo "$A $(pwd) $(id -u)"`, &sandbox.RunOptions{
		Envs: map[string]string{"A": "a b"}, Cwd: "/tmp", User: "root",
	})
	if err != nil || r.Stdout != "a b /tmp 0\n" {
		t.Errorf("envs, cwd, user: %v %+v", err, r)
	}

	// Stdin: a background cat, fed and closed.
	h, err = sbx.Commands.Start(ctx, "cat", &sandbox.RunOptions{Stdin: true, Tag: "cat-stdin"})
	if err != nil {
		t.Fatal(err)
	}
	procs, err := sbx.Commands.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(procs, func(p sandbox.ProcessInfo) bool { return p.PID == h.PID && p.Tag == "cat-stdin" }) {
		t.Errorf("list: %+v lacks pid %d tagged cat-stdin", procs, h.PID)
	}
	if err := h.SendStdin(ctx, []byte("hello ")); err != nil {
		t.Fatal(err)
	}
	if err := sbx.Commands.SendStdin(ctx, h.PID, []byte("stdin\n")); err != nil {
		t.Fatal(err)
	}
	if err := h.CloseStdin(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err := h.Wait(ctx); err != nil || r.Stdout != "hello stdin\n" {
		t.Errorf("stdin: %v %+v", err, r)
	}

	// Disconnect leaves the process running; Connect attaches again.
	h, err = sbx.Commands.Start(ctx, `i=0; while [ $i -lt 100 ]; do echo tick$i; i=$((i+1)); sleep 0.1; done`, &sandbox.RunOptions{Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	until(t, "the first tick", func() bool { return strings.Contains(h.Stdout(), "tick0") })
	h.Disconnect()
	<-h.Done()
	var attached strings.Builder
	var amu sync.Mutex
	h2, err := sbx.Commands.Connect(ctx, h.PID, &sandbox.RunOptions{OnStdout: func(s string) {
		amu.Lock()
		attached.WriteString(s)
		amu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	until(t, "output after Connect", func() bool {
		amu.Lock()
		defer amu.Unlock()
		return strings.Contains(attached.String(), "tick")
	})
	// Kill ends it: Wait reports the signal.
	if err := h2.Kill(ctx); err != nil {
		t.Fatal(err)
	}
	_, err = h2.Wait(ctx)
	if !errors.As(err, &exit) || exit.ExitCode == 0 {
		t.Errorf("wait after kill: %v", err)
	}
	if err := sbx.Commands.Kill(ctx, h.PID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("kill of an ended process: %v, want ErrNotFound", err)
	}
	// Terminate sends SIGTERM.
	h, err = sbx.Commands.Start(ctx, "sleep 60", nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := sbx.Commands.Terminate(ctx, h.PID); err != nil {
		t.Fatal(err)
	}
	if _, err := h.Wait(ctx); !errors.As(err, &exit) || !strings.Contains(exit.Err, "terminated") {
		t.Errorf("wait after terminate: %v", err)
	}
	t.Logf("commands ok: streamed output, exit error, envs/cwd/user, stdin, list, disconnect/connect, kill")
}

func TestPty(t *testing.T) {
	c := newClient(t)
	ctx := testContext(t)
	sbx := create(t, c, sandbox.CreateOptions{})
	var mu sync.Mutex
	var out strings.Builder
	output := func() string {
		mu.Lock()
		defer mu.Unlock()
		return out.String()
	}
	term, err := sbx.Pty.Create(ctx, sandbox.PtyOptions{Cols: 80, Rows: 24, OnData: func(b []byte) {
		mu.Lock()
		out.Write(b)
		mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := sbx.Pty.SendInput(ctx, term.PID, []byte("/bin/busybox stty size; echo pty-$((40+2))\n")); err != nil {
		t.Fatal(err)
	}
	until(t, "pty output", func() bool { return strings.Contains(output(), "pty-42") })
	if !strings.Contains(output(), "24 80") {
		t.Errorf("stty size before resize: %q", output())
	}
	if err := sbx.Pty.Resize(ctx, term.PID, 120, 40); err != nil {
		t.Fatal(err)
	}
	if err := sbx.Pty.SendInput(ctx, term.PID, []byte("/bin/busybox stty size; echo resized-$((1+1))\n")); err != nil {
		t.Fatal(err)
	}
	until(t, "pty output after resize", func() bool { return strings.Contains(output(), "resized-2") })
	if !strings.Contains(output(), "40 120") {
		t.Errorf("stty size after resize: %q", output())
	}
	if err := sbx.Pty.Kill(ctx, term.PID); err != nil {
		t.Fatal(err)
	}
	if _, err := term.Wait(ctx); err == nil {
		t.Error("a killed terminal's Wait: no error")
	}
	// A shell that exits ends its handle cleanly.
	term, err = sbx.Pty.Create(ctx, sandbox.PtyOptions{Cols: 80, Rows: 24})
	if err != nil {
		t.Fatal(err)
	}
	if err := sbx.Pty.SendInput(ctx, term.PID, []byte("exit\n")); err != nil {
		t.Fatal(err)
	}
	if _, err := term.Wait(ctx); err != nil {
		t.Errorf("a terminal whose shell exited: %v", err)
	}
	t.Logf("pty ok: create, input, resize, kill, exit")
}

func TestFiles(t *testing.T) {
	c := newClient(t)
	ctx := testContext(t)
	sbx := create(t, c, sandbox.CreateOptions{})
	f := sbx.Files

	// A watch set up first sees what follows.
	if _, err := f.MakeDir(ctx, "/tmp/w", nil); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var events []sandbox.FilesystemEvent
	w, err := f.WatchDir(ctx, "/tmp/w", func(e sandbox.FilesystemEvent) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	}, &sandbox.WatchOptions{Recursive: true, IncludeEntry: true})
	if err != nil {
		t.Fatal(err)
	}
	seen := func(name string, typ sandbox.EventType) bool {
		mu.Lock()
		defer mu.Unlock()
		return slices.ContainsFunc(events, func(e sandbox.FilesystemEvent) bool { return e.Name == name && e.Type == typ })
	}

	content := []byte("hello\x00world\n")
	wi, err := f.Write(ctx, "/tmp/w/sub/a.txt", content, nil)
	if err != nil {
		t.Fatal(err)
	}
	if wi.Path != "/tmp/w/sub/a.txt" || wi.Type != sandbox.TypeFile {
		t.Errorf("write info %+v", wi)
	}
	got, err := f.Read(ctx, "/tmp/w/sub/a.txt", nil)
	if err != nil || string(got) != string(content) {
		t.Errorf("read back: %q %v", got, err)
	}
	until(t, "the watch's create event for sub/a.txt", func() bool { return seen("sub/a.txt", sandbox.EventCreate) })
	if _, err := f.Write(ctx, "/tmp/w/sub/a.txt", []byte("more"), nil); err != nil {
		t.Fatal(err)
	}
	until(t, "the watch's write event", func() bool { return seen("sub/a.txt", sandbox.EventWrite) })
	w.Stop()
	if err := w.Err(); err != nil {
		t.Errorf("a stopped watch's error: %v", err)
	}

	info, err := f.GetInfo(ctx, "/tmp/w/sub/a.txt", nil)
	if err != nil || info.Size != 4 || info.Name != "a.txt" || info.Type != sandbox.TypeFile {
		t.Errorf("info %+v %v", info, err)
	}
	created, err := f.MakeDir(ctx, "/tmp/w/d1/d2", nil)
	if err != nil || !created {
		t.Errorf("make dir: %v %v", created, err)
	}
	if created, err := f.MakeDir(ctx, "/tmp/w/d1/d2", nil); err != nil || created {
		t.Errorf("make an existing dir: %v %v, want false", created, err)
	}
	entries, err := f.List(ctx, "/tmp/w", 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name+":"+string(e.Type))
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"d1:dir", "sub:dir"}) {
		t.Errorf("list depth 1: %v", names)
	}
	if entries, err = f.List(ctx, "/tmp/w", 3, nil); err != nil || len(entries) != 4 {
		t.Errorf("list depth 3: %d entries, %v", len(entries), err)
	}
	if _, err := f.Rename(ctx, "/tmp/w/sub/a.txt", "/tmp/w/d1/b.txt", nil); err != nil {
		t.Fatal(err)
	}
	if ok, err := f.Exists(ctx, "/tmp/w/sub/a.txt", nil); err != nil || ok {
		t.Errorf("exists after rename: %v %v", ok, err)
	}
	if ok, err := f.Exists(ctx, "/tmp/w/d1/b.txt", nil); err != nil || !ok {
		t.Errorf("exists of the new name: %v %v", ok, err)
	}
	if err := f.Remove(ctx, "/tmp/w/d1", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := f.GetInfo(ctx, "/tmp/w/d1/b.txt", nil); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("stat after remove: %v, want ErrNotFound", err)
	}
	// A file written as root is root's.
	if _, err := f.Write(ctx, "/tmp/rootfile", []byte("x"), &sandbox.FileOptions{User: "root"}); err != nil {
		t.Fatal(err)
	}
	if info, err := f.GetInfo(ctx, "/tmp/rootfile", nil); err != nil || info.Owner != "root" {
		t.Errorf("owner of a file written as root: %+v %v", info, err)
	}
	// A bigger file streams both ways.
	big := []byte(strings.Repeat("0123456789abcdef", 1<<16)) // 1 MiB
	if _, err := f.Write(ctx, "/tmp/big", big, nil); err != nil {
		t.Fatal(err)
	}
	if got, err := f.Read(ctx, "/tmp/big", nil); err != nil || string(got) != string(big) {
		t.Errorf("1 MiB round trip: %d bytes, %v", len(got), err)
	}
	t.Logf("files ok: write, read, info, make dir, list, rename, exists, remove, watch (create, write), user, 1 MiB")
}

func TestSnapshotFork(t *testing.T) {
	c := newClient(t)
	ctx := testContext(t)
	sbx := create(t, c, sandbox.CreateOptions{Metadata: map[string]string{"role": "snapshot-source"}})
	run(t, sbx, "echo snap > /tmp/mark")
	snap, err := sbx.CreateSnapshot(ctx, "")
	if errors.Is(err, sandbox.ErrNotImplemented) {
		t.Skipf("the node cannot snapshot: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.DeleteSnapshot(context.Background(), snap.SnapshotID) })
	snaps, err := c.ListSnapshots(ctx, sbx.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(snaps, func(s sandbox.SnapshotInfo) bool { return s.SnapshotID == snap.SnapshotID }) {
		t.Errorf("list snapshots of %s: %+v lacks %s", sbx.ID, snaps, snap.SnapshotID)
	}
	child := create(t, c, sandbox.CreateOptions{Template: snap.SnapshotID})
	if child.EnvdAccessToken == "" || child.EnvdAccessToken == sbx.EnvdAccessToken {
		t.Error("the sandbox from the snapshot has no token of its own")
	}
	if got := run(t, child, "cat /tmp/mark"); got != "snap\n" {
		t.Errorf("from the snapshot: %q", got)
	}
	if got := run(t, sbx, "cat /tmp/mark"); got != "snap\n" {
		t.Errorf("the source after its snapshot: %q", got)
	}
	forks, err := sbx.Fork(ctx, 2, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if len(forks) != 2 {
		t.Fatalf("fork 2: %d results", len(forks))
	}
	for _, f := range forks {
		if f.Err != nil {
			t.Fatal(f.Err)
		}
		t.Cleanup(func() { kill(t, c, f.Sandbox.ID) })
		if f.Sandbox.ID == sbx.ID || f.Sandbox.EnvdAccessToken == sbx.EnvdAccessToken {
			t.Errorf("fork %s shares the source's identity", f.Sandbox.ID)
		}
		if got := run(t, f.Sandbox, "cat /tmp/mark"); got != "snap\n" {
			t.Errorf("fork %s: %q", f.Sandbox.ID, got)
		}
	}
	if err := c.DeleteSnapshot(ctx, snap.SnapshotID); err != nil {
		t.Fatal(err)
	}
	if err := c.DeleteSnapshot(ctx, snap.SnapshotID); !errors.Is(err, sandbox.ErrNotFound) {
		t.Errorf("delete of a deleted snapshot: %v, want ErrNotFound", err)
	}
	t.Logf("snapshots ok (%s): snapshot, list, create from snapshot, fork x2, delete", sbx.Runtime)
}
