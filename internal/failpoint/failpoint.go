// Package failpoint injects faults at named points so tests can drive every
// error and rollback path, in-process or in a separate daemon process.
//
// Code under test marks a point with Eval:
//
//	if err := failpoint.Eval(ctx, "create/disk.clone"); err != nil {
//		return err
//	}
//
// and a test (or the CUBE_FAILPOINTS environment variable of a daemon, read
// by LoadEnv in binaries built with the failpoints tag) decides what
// happens there:
//
//	failpoint.Enable("create/disk.clone", "error(disk full)")
//	CUBE_FAILPOINTS='create/disk.clone=2*error;create/agent.wait/after=kill'
//
// Spec grammar: [COUNT*]KIND[(ARG)]
//
//	error, error(msg)  Eval returns an error wrapping ErrInjected.
//	panic, panic(msg)  Eval panics.
//	sleep(250ms)       Eval sleeps; returns ctx.Err() if ctx ends first, else nil.
//	hang               Eval blocks until ctx is done and returns ctx.Err().
//	kill               the process SIGKILLs itself: a crash at exactly this point.
//	off                enabled but never fires (arms name tracking, see Names).
//
// In-process tests may also run their own code at a point with EnableFunc:
// a test that must change the world at exactly one instant (swap a path
// for a symlink between two system calls) does it there, without timing.
//
// A COUNT prefix ("2*error") fires on the first COUNT evaluations only; after
// that the point behaves as if disabled.
//
// Cost: while nothing is enabled and tracking is off, Eval is a single atomic
// load. Names (the points evaluated so far) are recorded only while the
// package is armed, that is while some point is enabled or after Track; tests
// that iterate over every point call Track, run the code once, and read Names.
//
// Where they work: Enable and friends in any process that calls them (the
// tests' own processes; no daemon code calls them). CUBE_FAILPOINTS only in
// daemon binaries built with `-tags failpoints`, as the test harnesses
// build them (cubelettest.Binaries, nettest.Binary); a release binary
// logs that it ignores the variable and carries on (EnvHonoured).
//
// Points a package wants tests to enumerate are declared with Register at
// package level (var fpX = failpoint.Register("pkg/verb/step")) and
// evaluated with their Eval method; Registered lists them, so a test that
// must cover every point of a package fails when one is added without a
// case.
//
// All functions are safe for concurrent use.
package failpoint

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// EnvVar is the environment variable read by LoadEnv:
// "name1=spec;name2=spec".
const EnvVar = "CUBE_FAILPOINTS"

// ErrInjected is wrapped by every error a failpoint injects.
var ErrInjected = errors.New("failpoint: injected error")

type kind int

const (
	kindOff kind = iota
	kindError
	kindPanic
	kindSleep
	kindHang
	kindKill
	kindFunc
)

type point struct {
	kind    kind
	arg     string        // error/panic message
	dur     time.Duration // sleep
	fn      func(context.Context) error
	counted bool
	left    atomic.Int64 // evaluations left to fire when counted
}

var (
	// armed is non-zero while some point is enabled or tracking is on. It is
	// the only thing Eval reads on the fast path.
	armed atomic.Int32

	mu       sync.RWMutex
	points   = map[string]*point{}
	tracking bool
	seen     = map[string]struct{}{}
)

// Point is a registered failpoint name (see Register).
type Point string

var (
	regMu    sync.Mutex
	registry = map[string]struct{}{}
)

// Register records name as a point of the calling package and returns it.
// Call it from package-level var declarations: a name registered twice is
// a programming error and panics (two points sharing a name could not be
// told apart by a test).
func Register(name string) Point {
	if name == "" {
		panic("failpoint: Register with an empty name")
	}
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := registry[name]; dup {
		panic(fmt.Sprintf("failpoint: %q registered twice", name))
	}
	registry[name] = struct{}{}
	return Point(name)
}

// Registered returns, sorted, the registered names that start with prefix.
func Registered(prefix string) []string {
	regMu.Lock()
	defer regMu.Unlock()
	var out []string
	for n := range registry {
		if strings.HasPrefix(n, prefix) {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out
}

// Eval is Eval(ctx, string(p)).
func (p Point) Eval(ctx context.Context) error { return Eval(ctx, string(p)) }

// rearm recomputes armed; mu must be held for writing.
func rearm() {
	if len(points) > 0 || tracking {
		armed.Store(1)
	} else {
		armed.Store(0)
	}
}

// Enable arms the point name with spec (see the package doc), replacing any
// previous spec for that name. A malformed spec is an error and changes
// nothing.
func Enable(name, spec string) error {
	if name == "" {
		return errors.New("failpoint: empty name")
	}
	p, err := parse(spec)
	if err != nil {
		return fmt.Errorf("failpoint %q: %w", name, err)
	}
	mu.Lock()
	defer mu.Unlock()
	points[name] = p
	rearm()
	return nil
}

// EnableFunc arms the point name to call fn, whose result Eval returns,
// replacing any previous spec for that name. Unlike Enable it is for
// in-process tests only: a function cannot travel in $CUBE_FAILPOINTS.
func EnableFunc(name string, fn func(context.Context) error) error {
	if name == "" || fn == nil {
		return errors.New("failpoint: empty name or nil func")
	}
	mu.Lock()
	defer mu.Unlock()
	points[name] = &point{kind: kindFunc, fn: fn}
	rearm()
	return nil
}

// Disable disarms the point name. Disabling a point that is not enabled is a
// no-op.
func Disable(name string) {
	mu.Lock()
	defer mu.Unlock()
	delete(points, name)
	rearm()
}

// Reset disables every point, stops tracking and forgets the names seen.
func Reset() {
	mu.Lock()
	defer mu.Unlock()
	points = map[string]*point{}
	seen = map[string]struct{}{}
	tracking = false
	rearm()
}

// Track turns on recording of evaluated names (see Names) until Reset, even
// when no point is enabled.
func Track() {
	mu.Lock()
	defer mu.Unlock()
	tracking = true
	rearm()
}

// Names returns, sorted, the names evaluated while the package was armed
// since the last Reset.
func Names() []string {
	mu.RLock()
	defer mu.RUnlock()
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// LoadEnv enables the points listed in $CUBE_FAILPOINTS
// ("name1=spec;name2=spec"; empty entries are ignored). The daemon calls it
// at start. On a malformed entry it returns an error and enables nothing.
// In a binary built without the failpoints tag it enables nothing and
// logs (slog's default logger) that the variable is ignored.
func LoadEnv() error {
	v := os.Getenv(EnvVar)
	if !EnvHonoured {
		if v != "" {
			slog.Warn(EnvVar+" ignored: this binary was built without the failpoints tag (test builds only)", "value", v)
		}
		return nil
	}
	return load(v)
}

func load(s string) error {
	type entry struct {
		name string
		p    *point
	}
	var entries []entry
	for item := range strings.SplitSeq(s, ";") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, spec, ok := strings.Cut(item, "=")
		name = strings.TrimSpace(name)
		if !ok || name == "" {
			return fmt.Errorf("failpoint: %s: entry %q is not name=spec", EnvVar, item)
		}
		p, err := parse(strings.TrimSpace(spec))
		if err != nil {
			return fmt.Errorf("failpoint: %s: %q: %w", EnvVar, name, err)
		}
		entries = append(entries, entry{name, p})
	}
	mu.Lock()
	defer mu.Unlock()
	for _, e := range entries {
		points[e.name] = e.p
	}
	rearm()
	return nil
}

// Eval evaluates the point name: nil unless it is enabled and fires, in
// which case it does what its spec says (see the package doc). ctx bounds
// sleep and hang.
func Eval(ctx context.Context, name string) error {
	if armed.Load() == 0 {
		return nil
	}
	return eval(ctx, name)
}

func eval(ctx context.Context, name string) error {
	mu.RLock()
	p := points[name]
	_, known := seen[name]
	mu.RUnlock()
	if !known {
		mu.Lock()
		if armed.Load() != 0 {
			seen[name] = struct{}{}
		}
		mu.Unlock()
	}
	if p == nil || p.kind == kindOff {
		return nil
	}
	if p.counted && p.left.Add(-1) < 0 {
		return nil
	}
	switch p.kind {
	case kindError:
		msg := p.arg
		if msg == "" {
			msg = "injected"
		}
		return fmt.Errorf("failpoint %q: %s: %w", name, msg, ErrInjected)
	case kindPanic:
		msg := p.arg
		if msg == "" {
			msg = "injected panic"
		}
		panic(fmt.Sprintf("failpoint %q: %s", name, msg))
	case kindSleep:
		t := time.NewTimer(p.dur)
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	case kindHang:
		<-ctx.Done()
		return ctx.Err()
	case kindFunc:
		return p.fn(ctx)
	case kindKill:
		if err := syscall.Kill(os.Getpid(), syscall.SIGKILL); err != nil {
			return fmt.Errorf("failpoint %q: kill: %w", name, err)
		}
		select {} // the signal is on its way; never return into the caller
	}
	return nil
}

// parse reads "[COUNT*]KIND[(ARG)]".
func parse(spec string) (*point, error) {
	spec = strings.TrimSpace(spec)
	p := &point{}
	if n, rest, ok := strings.Cut(spec, "*"); ok && !strings.Contains(n, "(") {
		c, err := strconv.ParseInt(strings.TrimSpace(n), 10, 64)
		if err != nil || c <= 0 {
			return nil, fmt.Errorf("bad count %q in spec %q", n, spec)
		}
		p.counted = true
		p.left.Store(c)
		spec = strings.TrimSpace(rest)
	}
	word, arg, hasArg := spec, "", false
	if i := strings.IndexByte(spec, '('); i >= 0 {
		if !strings.HasSuffix(spec, ")") {
			return nil, fmt.Errorf("spec %q: missing ')'", spec)
		}
		word, arg, hasArg = spec[:i], spec[i+1:len(spec)-1], true
	}
	switch word {
	case "off":
		p.kind = kindOff
	case "error":
		p.kind, p.arg = kindError, arg
	case "panic":
		p.kind, p.arg = kindPanic, arg
	case "sleep":
		d, err := time.ParseDuration(arg)
		if !hasArg || err != nil || d < 0 {
			return nil, fmt.Errorf("spec %q: sleep needs a duration, e.g. sleep(250ms)", spec)
		}
		p.kind, p.dur = kindSleep, d
	case "hang":
		p.kind = kindHang
	case "kill":
		p.kind = kindKill
	default:
		return nil, fmt.Errorf("unknown spec %q (want error, error(msg), panic, sleep(d), hang, kill or off, optionally N*)", spec)
	}
	if hasArg && (p.kind == kindOff || p.kind == kindHang || p.kind == kindKill) {
		return nil, fmt.Errorf("spec %q takes no argument", spec)
	}
	return p, nil
}
