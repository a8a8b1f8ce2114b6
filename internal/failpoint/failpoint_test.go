package failpoint

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestDisabledIsNil(t *testing.T) {
	t.Cleanup(Reset)
	Reset()
	if err := Eval(context.Background(), "nothing"); err != nil {
		t.Fatalf("Eval with nothing enabled = %v", err)
	}
	if n := Names(); len(n) != 0 {
		t.Fatalf("Names() without arming = %v, want none", n)
	}
}

func TestSpecs(t *testing.T) {
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	tests := []struct {
		spec    string
		ctx     context.Context
		wantErr error  // errors.Is target; nil = no error
		wantMsg string // substring of the error
		minDur  time.Duration
	}{
		{spec: "error", ctx: context.Background(), wantErr: ErrInjected, wantMsg: `failpoint "p": injected`},
		{spec: "error(disk full)", ctx: context.Background(), wantErr: ErrInjected, wantMsg: "disk full"},
		{spec: "off", ctx: context.Background()},
		{spec: "sleep(30ms)", ctx: context.Background(), minDur: 30 * time.Millisecond},
		{spec: "sleep(1h)", ctx: cancelled, wantErr: context.Canceled},
		{spec: "hang", ctx: cancelled, wantErr: context.Canceled},
	}
	for _, tt := range tests {
		t.Run(tt.spec, func(t *testing.T) {
			t.Cleanup(Reset)
			if err := Enable("p", tt.spec); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			err := Eval(tt.ctx, "p")
			if tt.wantErr == nil && err != nil || tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("Eval = %v, want %v", err, tt.wantErr)
			}
			if tt.wantMsg != "" && !strings.Contains(err.Error(), tt.wantMsg) {
				t.Fatalf("Eval = %q, want it to contain %q", err, tt.wantMsg)
			}
			if d := time.Since(start); d < tt.minDur {
				t.Fatalf("Eval took %v, want >= %v", d, tt.minDur)
			}
			if err := Eval(tt.ctx, "other"); err != nil {
				t.Fatalf("another point fired: %v", err)
			}
		})
	}
}

func TestHangUntilDeadline(t *testing.T) {
	t.Cleanup(Reset)
	if err := Enable("p", "hang"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := Eval(ctx, "p"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Eval = %v, want DeadlineExceeded", err)
	}
}

func TestPanic(t *testing.T) {
	t.Cleanup(Reset)
	if err := Enable("p", "panic(boom)"); err != nil {
		t.Fatal(err)
	}
	defer func() {
		r := recover()
		if r == nil || !strings.Contains(r.(string), "boom") {
			t.Fatalf("recover() = %v, want a panic mentioning boom", r)
		}
	}()
	_ = Eval(context.Background(), "p")
	t.Fatal("Eval did not panic")
}

func TestCount(t *testing.T) {
	t.Cleanup(Reset)
	if err := Enable("p", "2*error"); err != nil {
		t.Fatal(err)
	}
	var fired int
	for range 5 {
		if Eval(context.Background(), "p") != nil {
			fired++
		}
	}
	if fired != 2 {
		t.Fatalf("2*error fired %d times, want 2", fired)
	}
}

func TestCountConcurrent(t *testing.T) {
	t.Cleanup(Reset)
	if err := Enable("p", "10*error"); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	fired := 0
	for range 100 {
		wg.Go(func() {
			if Eval(context.Background(), "p") != nil {
				mu.Lock()
				fired++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if fired != 10 {
		t.Fatalf("10*error fired %d times, want 10", fired)
	}
}

func TestDisableAndReset(t *testing.T) {
	t.Cleanup(Reset)
	_ = Enable("a", "error")
	_ = Enable("b", "error")
	Disable("a")
	if err := Eval(context.Background(), "a"); err != nil {
		t.Fatalf("disabled point fired: %v", err)
	}
	if err := Eval(context.Background(), "b"); err == nil {
		t.Fatal("enabled point did not fire")
	}
	Reset()
	if err := Eval(context.Background(), "b"); err != nil {
		t.Fatalf("point fired after Reset: %v", err)
	}
	if armed.Load() != 0 {
		t.Fatal("still armed after Reset")
	}
}

func TestBadSpecs(t *testing.T) {
	t.Cleanup(Reset)
	for _, spec := range []string{"", "boom", "sleep", "sleep(x)", "0*error", "x*error", "error(", "hang(1s)", "kill(9)"} {
		if err := Enable("p", spec); err == nil {
			t.Errorf("Enable(%q) succeeded, want error", spec)
		}
	}
	if err := Enable("", "error"); err == nil {
		t.Error("Enable with empty name succeeded")
	}
	if armed.Load() != 0 {
		t.Fatal("a bad spec armed the package")
	}
}

func TestNamesTrack(t *testing.T) {
	t.Cleanup(Reset)
	Track()
	for _, n := range []string{"z", "a", "m", "a"} {
		if err := Eval(context.Background(), n); err != nil {
			t.Fatal(err)
		}
	}
	if got := strings.Join(Names(), ","); got != "a,m,z" {
		t.Fatalf("Names() = %s, want a,m,z", got)
	}
	Reset()
	_ = Eval(context.Background(), "q")
	if n := Names(); len(n) != 0 {
		t.Fatalf("Names() after Reset = %v", n)
	}
}

func TestLoad(t *testing.T) {
	t.Cleanup(Reset)
	// load is what LoadEnv applies to $CUBE_FAILPOINTS in a build with
	// the failpoints tag (TestLoadEnvFollowsBuildTag covers the tag).
	if err := load(" create/disk.clone=error(full) ; ;create/net.slot/after=1*error"); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := Eval(ctx, "create/disk.clone"); !errors.Is(err, ErrInjected) || !strings.Contains(err.Error(), "full") {
		t.Fatalf("disk.clone = %v", err)
	}
	if err := Eval(ctx, "create/net.slot/after"); !errors.Is(err, ErrInjected) {
		t.Fatalf("net.slot/after = %v", err)
	}
	if err := Eval(ctx, "create/net.slot/after"); err != nil {
		t.Fatalf("1*error fired twice: %v", err)
	}

	Reset()
	if err := load("a=error;b=nonsense"); err == nil {
		t.Fatal("LoadEnv accepted a bad spec")
	}
	if err := Eval(ctx, "a"); err != nil {
		t.Fatalf("a bad env enabled a point: %v", err)
	}
	if err := load("noequals"); err == nil {
		t.Fatal("LoadEnv accepted an entry without =")
	}
}

// TestKill runs this test binary as a child with CUBE_FAILPOINTS set, the way
// restart tests drive a daemon, and checks the child died of SIGKILL at the
// point when built with the failpoints tag, and ran past it (exit 4)
// without.
func TestKill(t *testing.T) {
	if os.Getenv("FAILPOINT_KILL_CHILD") == "1" {
		if err := LoadEnv(); err != nil {
			os.Exit(3)
		}
		_ = Eval(context.Background(), "crash/here")
		os.Exit(4) // not reached
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestKill$")
	cmd.Env = append(os.Environ(), "FAILPOINT_KILL_CHILD=1", EnvVar+"=crash/here=kill")
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("child: %v, want it killed", err)
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	if !EnvHonoured {
		if !ok || ws.Signaled() || ws.ExitStatus() != 4 {
			t.Fatalf("child exit = %v, want 4: a build without the failpoints tag ignores %s", ee, EnvVar)
		}
		t.Logf("without the failpoints tag the child ran past the kill point: %v", ee)
		return
	}
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child exit = %v, want SIGKILL", ee)
	}
}

func BenchmarkEvalDisabled(b *testing.B) {
	Reset()
	ctx := context.Background()
	for b.Loop() {
		_ = Eval(ctx, "create/disk.clone")
	}
}

func TestEnableFunc(t *testing.T) {
	t.Cleanup(Reset)
	calls := 0
	boom := errors.New("boom")
	if err := EnableFunc("fn", func(context.Context) error { calls++; return boom }); err != nil {
		t.Fatal(err)
	}
	if err := Eval(context.Background(), "fn"); !errors.Is(err, boom) || calls != 1 {
		t.Fatalf("Eval = %v after %d calls; want the func's error after 1", err, calls)
	}
	if err := EnableFunc("fn", nil); err == nil {
		t.Fatal("nil func accepted")
	}
	Disable("fn")
	if err := Eval(context.Background(), "fn"); err != nil || calls != 1 {
		t.Fatalf("disabled point ran the func: %v, %d calls", err, calls)
	}
}

// TestLoadEnvFollowsBuildTag: $CUBE_FAILPOINTS arms a point only in a
// build with the failpoints tag (go test -tags failpoints); otherwise
// LoadEnv enables nothing and returns no error. Enable works in both.
func TestLoadEnvFollowsBuildTag(t *testing.T) {
	defer Reset()
	t.Setenv(EnvVar, "tag/probe=error")
	if err := LoadEnv(); err != nil {
		t.Fatal(err)
	}
	err := Eval(context.Background(), "tag/probe")
	if EnvHonoured != errors.Is(err, ErrInjected) {
		t.Fatalf("built with the failpoints tag: %v; Eval after LoadEnv: %v", EnvHonoured, err)
	}
	t.Logf("built with the failpoints tag: %v; Eval after LoadEnv: %v", EnvHonoured, err)
	Reset()
	if err := Enable("tag/probe", "error"); err != nil {
		t.Fatal(err)
	}
	if err := Eval(context.Background(), "tag/probe"); !errors.Is(err, ErrInjected) {
		t.Fatalf("Enable in-process: %v", err)
	}
}

func TestRegister(t *testing.T) {
	t.Cleanup(Reset)
	a := Register("test-register/b")
	Register("test-register/a")
	Register("other/x")
	if got := Registered("test-register/"); !slices.Equal(got, []string{"test-register/a", "test-register/b"}) {
		t.Fatalf("Registered = %v", got)
	}
	if err := Enable(string(a), "error"); err != nil {
		t.Fatal(err)
	}
	if err := a.Eval(context.Background()); !errors.Is(err, ErrInjected) {
		t.Fatalf("Point.Eval = %v", err)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("registering a name twice did not panic")
		}
	}()
	Register("test-register/a")
}
