package templatebuild

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/master/tmplstore"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// Backend is what a build needs of cubemaster.
type Backend interface {
	Create(ctx context.Context, req master.CreateRequest) (*catalog.Sandbox, error)
	Kill(ctx context.Context, id string) error
	AgentHTTP(ctx context.Context, id string) (hc *http.Client, base, token string, done func(), err error)
	GetTemplate(ctx context.Context, name string) (master.Template, error)
	ImportTemplate(ctx context.Context, req master.TemplateImport) (master.Template, error)
	DeleteTemplate(ctx context.Context, name string) ([]string, error)
	TemplateStore() *tmplstore.Store
}

var _ Backend = (*master.Service)(nil)

// Labels the template import reads as the template's service.
const (
	LabelStartCmd = "dev.cube.start-cmd"
	LabelReadyCmd = "dev.cube.ready-cmd"
	LabelWorkdir  = "dev.cube.workdir"
)

// Options configure the engine.
type Options struct {
	// Dir holds the layer cache, uploaded files and template owners.
	Dir string
	// Images are the base images a build may name in fromImage (image
	// reference -> OCI layout or image archive on the master): builds
	// pull nothing from a registry.
	Images map[string]string
	// AllowOut is the build sandbox's egress allow list (domains or
	// addresses; everything else is denied): the package mirrors.
	AllowOut []string
	// StepEnv is added to every step's environment (not to the
	// template): proxy settings the host uses to reach the mirrors.
	StepEnv map[string]string
	// CABundle is a CA bundle on the master given to every step (at
	// ScratchDir/ca.crt, named by SSL_CERT_FILE, PIP_CERT,
	// REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, NODE_EXTRA_CA_CERTS): the trust
	// the host uses for its mirrors. Not part of the template.
	CABundle string
	// StepTimeout bounds one step; ReadyTimeout the start command's
	// ready check.
	StepTimeout, ReadyTimeout time.Duration
	// DiskMiB is the build sandbox's disk (the base grown to it): room
	// for what the steps install. 0: 2048.
	DiskMiB int64
	// MaxUpload bounds one uploaded COPY archive.
	MaxUpload int64
	Log       *slog.Logger
}

// Engine runs template builds.
type Engine struct {
	b    Backend
	o    Options
	log  *slog.Logger
	mu   sync.Mutex
	bids map[string]*Build
	// uploads are the upload tokens handed out, each for one upload of
	// one files hash within uploadTTL.
	uploads map[string]upload
	// building holds the template IDs with a build running.
	building map[string]string
}

// New returns an engine.
func New(b Backend, o Options) (*Engine, error) {
	if o.Dir == "" {
		return nil, fmt.Errorf("template builds: no directory: %w", errdefs.ErrInvalidArgument)
	}
	for _, d := range []string{"layers", "files", "owners"} {
		if err := os.MkdirAll(filepath.Join(o.Dir, d), 0o700); err != nil {
			return nil, fmt.Errorf("template builds: %w", err)
		}
	}
	// Temp files a master that died mid-write left.
	for _, d := range []string{"layers", "files"} {
		left, _ := filepath.Glob(filepath.Join(o.Dir, d, ".tmp-*"))
		for _, p := range left {
			_ = os.Remove(p)
		}
	}
	if o.StepTimeout == 0 {
		o.StepTimeout = 30 * time.Minute
	}
	if o.ReadyTimeout == 0 {
		o.ReadyTimeout = 2 * time.Minute
	}
	if o.DiskMiB == 0 {
		o.DiskMiB = 2048
	}
	if o.MaxUpload == 0 {
		o.MaxUpload = 1 << 30
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	return &Engine{b: b, o: o, log: o.Log, bids: map[string]*Build{}, uploads: map[string]upload{}, building: map[string]string{}}, nil
}

// Statuses, as E2B's TemplateBuildStatus.
const (
	StatusWaiting  = "waiting"
	StatusBuilding = "building"
	StatusReady    = "ready"
	StatusError    = "error"
)

// LogEntry is one line of a build's log.
type LogEntry struct {
	Time    time.Time
	Level   string
	Message string
	Step    string
}

// Reason is why a build failed.
type Reason struct {
	Message string
	Step    string
	Log     []LogEntry
}

// Build is one build of a template.
type Build struct {
	ID, TemplateID, Team string
	Admin                bool
	Created              time.Time
	mu                   sync.Mutex
	status               string
	logs                 []LogEntry
	reason               *Reason
}

// Info is a build's state: its status, the log from an offset, and why
// it failed.
func (b *Build) Info(offset int) (status string, logs []LogEntry, reason *Reason) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if offset < 0 {
		offset = 0
	}
	if offset < len(b.logs) {
		logs = append(logs, b.logs[offset:]...)
	}
	return b.status, logs, b.reason
}

func (b *Build) logf(level, step, format string, a ...any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.logs = append(b.logs, LogEntry{Time: time.Now().UTC(), Level: level, Message: fmt.Sprintf(format, a...), Step: step})
}

func (b *Build) set(status string, reason *Reason) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.status, b.reason = status, reason
}

func randomHex(n int) string {
	p := make([]byte, n)
	_, _ = rand.Read(p)
	return hex.EncodeToString(p)
}

// ParseName splits E2B's "name[:tag]" and checks the name as a template
// ID (the template's ID is its name).
func ParseName(name string) (id, tag string, err error) {
	id, tag, _ = strings.Cut(name, ":")
	if err := sandboxid.Validate("template", id); err != nil {
		return "", "", err
	}
	return id, tag, nil
}

type owner struct {
	Team string `json:"team"`
}

func (e *Engine) ownerPath(id string) string { return filepath.Join(e.o.Dir, "owners", id+".json") }

// Request starts a build of template id for a team: a template of that
// name that exists must be one this team built through the API (an
// admin key may replace any).
func (e *Engine) Request(ctx context.Context, id, team string, admin bool) (*Build, error) {
	if err := sandboxid.Validate("template", id); err != nil {
		return nil, err
	}
	if strings.HasPrefix(id, basePrefix) {
		// Build sandboxes boot from these: no build may make one.
		return nil, errdefs.FieldErrorf("name", "%q: names starting with %q are the build bases'", id, basePrefix)
	}
	if _, err := e.b.GetTemplate(ctx, id); err == nil && !admin {
		var o owner
		data, rerr := os.ReadFile(e.ownerPath(id))
		if rerr == nil {
			_ = json.Unmarshal(data, &o)
		}
		if o.Team != team {
			return nil, fmt.Errorf("template %q exists and was not built through the API by this team: %w", id, errdefs.ErrAlreadyExists)
		}
	}
	b := &Build{ID: newUUID(), TemplateID: id, Team: team, Admin: admin, Created: time.Now(), status: StatusWaiting}
	e.mu.Lock()
	e.prune(time.Now())
	e.bids[b.ID] = b
	e.mu.Unlock()
	return b, nil
}

// Builds are kept in memory for their status: a finished one for a day,
// one never started for an hour (the SDK starts it right after).
const (
	keepFinished = 24 * time.Hour
	keepWaiting  = time.Hour
)

// prune drops old builds; e.mu is held.
func (e *Engine) prune(now time.Time) {
	for id, b := range e.bids {
		b.mu.Lock()
		status := b.status
		b.mu.Unlock()
		age := now.Sub(b.Created)
		if (status == StatusWaiting && age > keepWaiting) || ((status == StatusReady || status == StatusError) && age > keepFinished) {
			delete(e.bids, id)
		}
	}
}

func newUUID() string {
	p := make([]byte, 16)
	_, _ = rand.Read(p)
	p[6] = p[6]&0x0f | 0x40
	p[8] = p[8]&0x3f | 0x80
	h := hex.EncodeToString(p)
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:]
}

// Get returns a build of template id visible to team.
func (e *Engine) Get(id, buildID, team string) (*Build, error) {
	e.mu.Lock()
	b := e.bids[buildID]
	e.mu.Unlock()
	if b == nil || b.TemplateID != id || b.Team != team {
		return nil, fmt.Errorf("build %q of template %q: %w", buildID, id, errdefs.ErrNotFound)
	}
	return b, nil
}

// filePath is where a team's upload of a files hash is kept: uploads are
// per team (the hash is the SDK's, unchecked).
func (e *Engine) filePath(team, hash string) string {
	return filepath.Join(e.o.Dir, "files", hex.EncodeToString([]byte(team))+"-"+hash)
}

// FileUpload answers E2B's upload-link request: present when the files
// are cached, else a token to PUT them with.
func (e *Engine) FileUpload(team, hash string) (present bool, token string, err error) {
	if !ValidFilesHash(hash) {
		return false, "", fmt.Errorf("files hash %q is not a hex SHA-256: %w", hash, errdefs.ErrInvalidArgument)
	}
	if _, err := os.Stat(e.filePath(team, hash)); err == nil {
		return true, "", nil
	}
	token = randomHex(16)
	now := time.Now()
	e.mu.Lock()
	for t, u := range e.uploads {
		if now.After(u.expires) {
			delete(e.uploads, t)
		}
	}
	e.uploads[token] = upload{team: team, hash: hash, expires: now.Add(uploadTTL)}
	e.mu.Unlock()
	return false, token, nil
}

type upload struct {
	team    string
	hash    string
	expires time.Time
}

// uploadTTL bounds how long an upload URL is good for.
const uploadTTL = time.Hour

// PutFile stores an upload (the SDK's tar, gzipped or not) for a token.
func (e *Engine) PutFile(hash, token string, r io.Reader) error {
	e.mu.Lock()
	u, ok := e.uploads[token]
	ok = ok && u.hash == hash && time.Now().Before(u.expires)
	if ok {
		delete(e.uploads, token)
	}
	e.mu.Unlock()
	if !ok {
		return fmt.Errorf("upload of %s: unknown or used token: %w", hash, errdefs.ErrPermissionDenied)
	}
	f, err := os.CreateTemp(filepath.Join(e.o.Dir, "files"), ".tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	n, err := io.Copy(f, io.LimitReader(r, e.o.MaxUpload+1))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("upload of %s: %w", hash, err)
	}
	if n > e.o.MaxUpload {
		return fmt.Errorf("upload of %s: over %d bytes: %w", hash, e.o.MaxUpload, errdefs.ErrInvalidArgument)
	}
	return os.Rename(f.Name(), e.filePath(u.team, hash))
}

// Start validates the definition and runs the build in the background.
func (e *Engine) Start(ctx context.Context, b *Build, spec Spec) error {
	if err := spec.Validate(); err != nil {
		return err
	}
	for i, st := range spec.Steps {
		if st.Type == "COPY" {
			if _, err := os.Stat(e.filePath(b.Team, st.FilesHash)); err != nil {
				return fmt.Errorf("step %d (%s): its files (%s) were not uploaded: %w", i+1, st.Describe(), st.FilesHash, errdefs.ErrInvalidArgument)
			}
		}
	}
	if spec.FromImage != "" {
		if _, ok := e.o.Images[spec.FromImage]; !ok {
			return fmt.Errorf("fromImage %q: builds here pull no registry image; images available: %s (or fromTemplate with a template in the master's store): %w",
				spec.FromImage, strings.Join(e.imageNames(), ", "), errdefs.ErrInvalidArgument)
		}
	}
	e.mu.Lock()
	if other, busy := e.building[b.TemplateID]; busy {
		e.mu.Unlock()
		return fmt.Errorf("template %q: build %s is running: %w", b.TemplateID, other, errdefs.ErrAlreadyExists)
	}
	b.mu.Lock()
	if b.status != StatusWaiting {
		b.mu.Unlock()
		e.mu.Unlock()
		return fmt.Errorf("build %s was started already: %w", b.ID, errdefs.ErrAlreadyExists)
	}
	b.status = StatusBuilding
	b.mu.Unlock()
	e.building[b.TemplateID] = b.ID
	e.mu.Unlock()
	bctx := master.WithTeam(context.WithoutCancel(ctx), b.Team)
	go func() {
		defer func() {
			e.mu.Lock()
			delete(e.building, b.TemplateID)
			e.mu.Unlock()
		}()
		start := time.Now()
		err := e.run(bctx, b, spec)
		if err == nil {
			b.logf("info", "finalize", "Template %s built in %s", b.TemplateID, time.Since(start).Round(time.Millisecond))
			b.set(StatusReady, nil)
			e.log.Info("template build", "template_id", b.TemplateID, "build_id", b.ID, "took", time.Since(start))
			return
		}
		step := "finalize"
		var se *StepError
		if errors.As(err, &se) {
			step = se.StepName()
		}
		b.logf("error", step, "Build failed: %v", err)
		_, logs, _ := b.Info(0)
		if len(logs) > 50 {
			logs = logs[len(logs)-50:]
		}
		b.set(StatusError, &Reason{Message: err.Error(), Step: step, Log: logs})
		e.log.Warn("template build failed", "template_id", b.TemplateID, "build_id", b.ID, "step", step, "err", err)
	}()
	return nil
}

func (e *Engine) imageNames() []string {
	var out []string
	for k := range e.o.Images {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// basePrefix names the templates build sandboxes boot from (a fromImage
// base imported as a template).
const basePrefix = "build-base-"

// base is where a build starts: its image and the template a build
// sandbox boots from.
type base struct {
	img      v1.Image
	digest   string
	template string
}

func (e *Engine) resolveBase(ctx context.Context, b *Build, spec Spec, scratch string) (base, error) {
	if spec.FromTemplate != "" {
		dir := filepath.Join(scratch, "base")
		if err := e.b.TemplateStore().Layout(spec.FromTemplate, dir); err != nil {
			return base{}, fmt.Errorf("fromTemplate %q: builds start from templates in the master's store (cubecli template import --all-nodes): %w", spec.FromTemplate, err)
		}
		img, err := openLayout(dir)
		if err != nil {
			return base{}, err
		}
		d, _ := img.Digest()
		return base{img: img, digest: d.String(), template: spec.FromTemplate}, nil
	}
	src := e.o.Images[spec.FromImage]
	img, err := openLayout(src)
	if err != nil {
		return base{}, fmt.Errorf("fromImage %q (%s): %w", spec.FromImage, src, err)
	}
	d, err := img.Digest()
	if err != nil {
		return base{}, err
	}
	// The build sandbox boots from the base as a template of its own,
	// imported once per image.
	tid := basePrefix + d.Hex[:12]
	if _, err := e.b.GetTemplate(ctx, tid); err != nil {
		b.logf("info", "base", "Importing base image %s (%s) as template %s", spec.FromImage, d, tid)
		if _, err := e.b.ImportTemplate(ctx, master.TemplateImport{ID: tid, Source: src}); err != nil {
			return base{}, fmt.Errorf("import the base image %s: %w", spec.FromImage, err)
		}
	}
	return base{img: img, digest: d.String(), template: tid}, nil
}

func openLayout(dir string) (v1.Image, error) {
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %v: %w", dir, err, errdefs.ErrFailedPrecondition)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, err
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(m.Manifests) == 0 {
		return nil, fmt.Errorf("OCI layout %s: no image: %w", dir, errdefs.ErrFailedPrecondition)
	}
	return idx.Image(m.Manifests[0].Digest)
}

// run is one build: the cached prefix of the steps reused, the rest run in
// a build sandbox, the image composed and imported.
func (e *Engine) run(ctx context.Context, b *Build, spec Spec) (err error) {
	scratch, err := os.MkdirTemp(e.o.Dir, ".build-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(scratch)
	bs, err := e.resolveBase(ctx, b, spec, scratch)
	if err != nil {
		return &StepError{Step: 0, Err: err}
	}
	b.logf("info", "base", "Base %s", bs.digest)
	keys := make([]string, len(spec.Steps))
	prev := BaseKey(b.Team, bs.digest)
	first := len(spec.Steps) // the first step that must run
	for i, st := range spec.Steps {
		keys[i] = NextKey(prev, st)
		prev = keys[i]
		if first == len(spec.Steps) && st.Layered() && (spec.Force || st.Force || !e.cached(keys[i])) {
			first = i
		}
	}
	for i := 0; i < first; i++ {
		b.logf("info", fmt.Sprint(i+1), "CACHED [%d/%d] %s", i+1, len(spec.Steps), spec.Steps[i].Describe())
	}
	if first < len(spec.Steps) {
		if err := e.runSteps(ctx, b, spec, bs, keys, first); err != nil {
			return err
		}
	} else if spec.StartCmd != "" {
		b.logf("info", "finalize", "Every step cached: the start command was checked by the build that made them")
	}
	return e.compose(ctx, b, spec, bs, keys, scratch)
}

// runSteps runs steps from first on in a build sandbox, replaying the
// cached layers before them, and checks the start command.
func (e *Engine) runSteps(ctx context.Context, b *Build, spec Spec, bs base, keys []string, first int) error {
	req := master.CreateRequest{
		Template: bs.template, Timeout: 2 * time.Hour,
		Metadata: map[string]string{"cube.template-build": b.ID, "cube.template": b.TemplateID},
		DiskMiB:  e.o.DiskMiB,
	}
	if len(e.o.AllowOut) > 0 {
		req.Network = catalog.Network{AllowInternet: boolPtr(false), AllowOut: e.o.AllowOut}
	}
	sb, err := e.b.Create(ctx, req)
	if err != nil && len(e.o.AllowOut) > 0 && errdefs.IsFailedPrecondition(err) && strings.Contains(err.Error(), "network-agent") {
		// A node without a network-agent gives sandboxes an empty
		// network namespace and refuses any policy: the build runs
		// with no network at all (stricter than the allow list).
		b.logf("warn", "base", "The node has no network-agent: the build sandbox has no network (steps that download will fail)")
		req.Network = catalog.Network{}
		sb, err = e.b.Create(ctx, req)
	}
	if err != nil {
		return &StepError{Step: 0, Err: fmt.Errorf("build sandbox: %w", err)}
	}
	b.logf("info", "base", "Build sandbox %s from template %s", sb.ID, bs.template)
	defer func() {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := e.b.Kill(kctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
			e.log.Warn("template build: kill the build sandbox", "sandbox_id", sb.ID, "err", err)
		}
	}()
	hc, baseURL, token, done, err := e.b.AgentHTTP(ctx, sb.ID)
	if err != nil {
		return &StepError{Step: 0, Err: err}
	}
	defer done()
	bx := newBox(sb.ID, hc, baseURL, token)
	if _, err := bx.run(ctx, "mkdir -p "+ScratchDir+" && chmod 0755 "+ScratchDir, "root", nil, "/", nil); err != nil {
		return &StepError{Step: 0, Err: err}
	}
	env := map[string]string{}
	for k, v := range e.o.StepEnv {
		env[k] = v
	}
	if e.o.CABundle != "" {
		f, err := os.Open(e.o.CABundle)
		if err != nil {
			return &StepError{Step: 0, Err: fmt.Errorf("CA bundle for the steps: %w", err)}
		}
		err = bx.upload(ctx, ScratchDir+"/ca.crt", f)
		f.Close()
		if err != nil {
			return &StepError{Step: 0, Err: err}
		}
		for _, k := range []string{"SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"} {
			env[k] = ScratchDir + "/ca.crt"
		}
	}
	st := initState(bs)
	for i, step := range spec.Steps {
		name := fmt.Sprint(i + 1)
		if i < first {
			st.Apply(step)
			if step.Layered() {
				if err := e.replay(ctx, bx, keys[i]); err != nil {
					return &StepError{Step: i + 1, Err: fmt.Errorf("replay the cached layer: %w", err)}
				}
			}
			continue
		}
		b.logf("info", name, "[%d/%d] %s", i+1, len(spec.Steps), step.Describe())
		if !step.Layered() {
			st.Apply(step)
			continue
		}
		start := time.Now()
		if err := e.runStep(ctx, b, bx, &st, step, name, env, keys[i]); err != nil {
			return &StepError{Step: i + 1, Err: err}
		}
		b.logf("info", name, "[%d/%d] done in %s", i+1, len(spec.Steps), time.Since(start).Round(time.Millisecond))
	}
	if spec.StartCmd != "" {
		if err := e.checkStart(ctx, b, bx, &st, spec, env); err != nil {
			return &StepError{Finalize: true, Err: err}
		}
	}
	return nil
}

func boolPtr(v bool) *bool { return &v }

// initState starts from the base image's working directory, as Docker's
// steps do.
func initState(bs base) State {
	var st State
	if cf, err := bs.img.ConfigFile(); err == nil {
		st.Workdir = cf.Config.WorkingDir
	}
	return st
}

func stepEnv(st *State, extra map[string]string) map[string]string {
	env := st.EnvMap()
	for k, v := range extra {
		if _, set := env[k]; !set {
			env[k] = v
		}
	}
	return env
}

// runStep runs one layered step and stores its layer under key.
func (e *Engine) runStep(ctx context.Context, b *Build, bx *box, st *State, step Step, name string, env map[string]string, key string) error {
	sctx, cancel := context.WithTimeout(ctx, e.o.StepTimeout)
	defer cancel()
	before, err := e.listing(sctx, bx)
	if err != nil {
		return err
	}
	user := st.User
	if user == "" {
		user = "root"
	}
	out := func(stderr bool, line string) {
		level := "info"
		if stderr {
			level = "warn"
		}
		b.logf(level, name, "%s", line)
	}
	switch step.Type {
	case "RUN":
		if len(step.Args) > 1 && step.Args[1] != "" {
			user = step.Args[1]
		}
		cwd := st.Workdir
		if cwd == "" {
			cwd = "/"
		}
		if _, err := bx.run(sctx, step.Args[0], user, stepEnv(st, env), cwd, out); err != nil {
			return fmt.Errorf("%s: %w", step.Describe(), err)
		}
	case "WORKDIR":
		st.Apply(step)
		if _, err := bx.run(sctx, "mkdir -p "+shellQuote(st.Workdir), "root", nil, "/", out); err != nil {
			return err
		}
	case "COPY":
		if err := e.copyStep(sctx, bx, b.Team, st, step, out); err != nil {
			return err
		}
	}
	after, err := e.listing(sctx, bx)
	if err != nil {
		return err
	}
	d := Compare(before, after)
	var archive io.Reader
	if len(d.Changed) > 0 {
		list := strings.Join(d.Changed, "\x00") + "\x00"
		if err := bx.upload(sctx, ScratchDir+"/list", strings.NewReader(list)); err != nil {
			return err
		}
		if _, err := bx.run(sctx, TarListCmd(ScratchDir+"/list", ScratchDir+"/layer.tar"), "root", nil, "/", out); err != nil {
			return fmt.Errorf("archive the step's files: %w", err)
		}
		f, err := os.CreateTemp(filepath.Join(e.o.Dir, "layers"), ".tmp-raw-")
		if err != nil {
			return err
		}
		defer os.Remove(f.Name())
		defer f.Close()
		if err := bx.download(sctx, ScratchDir+"/layer.tar", f); err != nil {
			return err
		}
		if _, err := bx.run(sctx, "rm -f "+ScratchDir+"/layer.tar "+ScratchDir+"/list", "root", nil, "/", nil); err != nil {
			return err
		}
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return err
		}
		archive = f
	}
	rec, err := e.storeLayer(key, func(w io.Writer) error { return WriteLayer(w, archive, d.Removed) })
	if err != nil {
		return err
	}
	b.logf("info", name, "Layer: %d paths added or changed, %d removed, %d bytes compressed", len(d.Changed), len(d.Removed), rec.Size)
	return nil
}

func (e *Engine) listing(ctx context.Context, bx *box) (Listing, error) {
	out, err := bx.run(ctx, ListCmd(), "root", nil, "/", nil)
	if err != nil {
		return nil, fmt.Errorf("list the build sandbox's files (needs GNU find): %w", err)
	}
	return ParseListing(out)
}

// copyStep unpacks an uploaded archive in the sandbox and copies its src
// to dest as E2B's COPY does: a directory's contents into dest, a file to
// dest (into it when dest ends with "/" or is a directory).
func (e *Engine) copyStep(ctx context.Context, bx *box, team string, st *State, step Step, out func(bool, string)) error {
	f, err := os.Open(e.filePath(team, step.FilesHash))
	if err != nil {
		return fmt.Errorf("files of %s: %w", step.Describe(), err)
	}
	defer f.Close()
	if err := bx.upload(ctx, ScratchDir+"/copy.tar", f); err != nil {
		return err
	}
	src, dest := step.Args[0], step.Args[1]
	if !path.IsAbs(dest) {
		wd := st.Workdir
		if wd == "" {
			wd = "/"
		}
		dest = path.Join(wd, dest) + map[bool]string{true: "/"}[strings.HasSuffix(dest, "/")]
	}
	user, mode := "", ""
	if len(step.Args) > 2 {
		user = step.Args[2]
	}
	if len(step.Args) > 3 {
		mode = step.Args[3]
	}
	ctxDir := ScratchDir + "/context"
	script := fmt.Sprintf(`set -e
rm -rf %[1]s && mkdir -p %[1]s
tar -xf %[2]s -C %[1]s --no-same-owner
cd %[1]s
dest=%[3]s
n=0
for s in %[4]s; do
  [ -e "$s" ] || [ -L "$s" ] || { echo "COPY: $s is not in the uploaded files" >&2; exit 1; }
  n=$((n+1))
done
for s in %[4]s; do
  if [ -d "$s" ] && [ ! -L "$s" ]; then
    mkdir -p "$dest"; cp -a "$s"/. "$dest"/
    target="$dest"
  else
    case "$dest" in */) mkdir -p "$dest"; target="$dest$(basename "$s")";; *)
      if [ -d "$dest" ]; then target="$dest/$(basename "$s")"; else mkdir -p "$(dirname "$dest")"; target="$dest"; fi;; esac
    cp -a "$s" "$target"
  fi
  if [ -n %[5]s ]; then chown -R %[5]s: "$target"; fi
  if [ -n %[6]s ]; then chmod -R %[6]s "$target"; fi
done
cd / && rm -rf %[1]s %[2]s
`, ctxDir, ScratchDir+"/copy.tar", shellQuote(dest), globWords(src), shellQuote(user), shellQuote(mode))
	if _, err := bx.run(ctx, script, "root", nil, "/", out); err != nil {
		return fmt.Errorf("%s: %w", step.Describe(), err)
	}
	return nil
}

// globWords quotes a COPY source for the shell while keeping its glob
// characters live (E2B's sources may be globs).
func globWords(src string) string {
	var sb strings.Builder
	for _, r := range strings.TrimPrefix(path.Clean(src), "./") {
		switch {
		case r == '*' || r == '?' || r == '[' || r == ']':
			sb.WriteRune(r)
		case r == '/' || r == '.' || r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (r >= '0' && r <= '9'):
			sb.WriteRune(r)
		default:
			sb.WriteString(`\` + string(r))
		}
	}
	return sb.String()
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// replay applies a cached layer in the build sandbox.
func (e *Engine) replay(ctx context.Context, bx *box, key string) error {
	f, err := e.uncompressedLayer(key)
	if err != nil {
		return err
	}
	defer f.Close()
	// The whiteouts are collected while the archive streams to the
	// sandbox (a layer may be hundreds of MiB).
	pr, pw := io.Pipe()
	var removed []string
	split := make(chan error, 1)
	go func() {
		var err error
		removed, err = SplitLayer(f, pw)
		pw.CloseWithError(err)
		split <- err
	}()
	err = bx.upload(ctx, ScratchDir+"/replay.tar", pr)
	pr.CloseWithError(io.ErrClosedPipe)
	if serr := <-split; err == nil {
		err = serr
	}
	if err != nil {
		return err
	}
	var del strings.Builder
	for _, p := range removed {
		del.WriteString(p + "\x00")
	}
	if err := bx.upload(ctx, ScratchDir+"/replay.del", strings.NewReader(del.String())); err != nil {
		return err
	}
	_, err = bx.run(ctx, "set -e; xargs -0 -r rm -rf -- < "+ScratchDir+"/replay.del; tar -xpf "+ScratchDir+"/replay.tar -C / --numeric-owner; rm -f "+ScratchDir+"/replay.tar "+ScratchDir+"/replay.del", "root", nil, "/", nil)
	return err
}

// checkStart starts the start command as the template will and waits for
// its ready command, so a template whose service never gets ready fails
// its build rather than every create.
func (e *Engine) checkStart(ctx context.Context, b *Build, bx *box, st *State, spec Spec, env map[string]string) error {
	// As a create starts it: as the template's user, else the
	// sandbox's default user (no user named to the agent).
	user := st.User
	cwd := st.Workdir
	if cwd == "" {
		cwd = "/"
	}
	b.logf("info", "finalize", "Starting %q", spec.StartCmd)
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	ended := make(chan error, 1)
	go func() {
		_, err := bx.run(sctx, spec.StartCmd, user, stepEnv(st, env), cwd, func(stderr bool, line string) { b.logf("info", "finalize", "%s", line) })
		ended <- err
	}()
	if spec.ReadyCmd == "" {
		select {
		case err := <-ended:
			if err != nil {
				return fmt.Errorf("start command %q: %w", spec.StartCmd, err)
			}
		case <-time.After(time.Second):
		}
		return nil
	}
	deadline := time.Now().Add(e.o.ReadyTimeout)
	for {
		_, err := bx.run(ctx, spec.ReadyCmd, user, stepEnv(st, env), cwd, nil)
		if err == nil {
			b.logf("info", "finalize", "Ready: %q passed", spec.ReadyCmd)
			return nil
		}
		var ee *ExitError
		if !errors.As(err, &ee) {
			return fmt.Errorf("ready command %q: %w", spec.ReadyCmd, err)
		}
		select {
		case err := <-ended:
			return fmt.Errorf("start command %q ended (%v) before %q passed", spec.StartCmd, err, spec.ReadyCmd)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ready command %q did not pass within %s: %w", spec.ReadyCmd, e.o.ReadyTimeout, context.DeadlineExceeded)
		}
	}
}

// compose makes the template's image (the base, then each step's layer,
// and the config the steps set) and imports it as the template. The image
// holds no build time: the same definition and layers give the same
// digest, and the import of an unchanged template is a no-op.
func (e *Engine) compose(ctx context.Context, b *Build, spec Spec, bs base, keys []string, scratch string) error {
	img := bs.img
	st := initState(bs)
	for i, step := range spec.Steps {
		st.Apply(step)
		if !step.Layered() {
			continue
		}
		l, err := e.openLayer(keys[i])
		if err != nil {
			return fmt.Errorf("layer of step %d: %w", i+1, err)
		}
		img, err = mutate.Append(img, mutate.Addendum{Layer: l, History: v1.History{CreatedBy: step.Describe()}})
		if err != nil {
			return err
		}
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	for _, kv := range st.Env {
		k, _, _ := strings.Cut(kv, "=")
		cf.Config.Env = append(removeEnv(cf.Config.Env, k), kv)
	}
	delete(cf.Config.Labels, LabelWorkdir)
	if st.Workdir != "" {
		cf.Config.WorkingDir = st.Workdir
	}
	if st.User != "" {
		cf.Config.User = st.User
	}
	if cf.Config.Labels == nil {
		cf.Config.Labels = map[string]string{}
	}
	delete(cf.Config.Labels, LabelStartCmd)
	delete(cf.Config.Labels, LabelReadyCmd)
	if spec.StartCmd != "" {
		cf.Config.Labels[LabelStartCmd] = spec.StartCmd
	}
	if spec.ReadyCmd != "" {
		cf.Config.Labels[LabelReadyCmd] = spec.ReadyCmd
	}
	if st.Workdir != "" {
		// Commands in its sandboxes start here (E2B's template workdir).
		cf.Config.Labels[LabelWorkdir] = st.Workdir
	}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	d, err := img.Digest()
	if err != nil {
		return err
	}
	if cur, err := e.b.GetTemplate(ctx, b.TemplateID); err == nil {
		if cur.Digest == d.String() {
			b.logf("info", "finalize", "Template %s unchanged (%s)", b.TemplateID, d)
			return e.setOwner(b)
		}
		b.logf("info", "finalize", "Replacing template %s (%s)", b.TemplateID, cur.Digest)
		if _, err := e.b.DeleteTemplate(ctx, b.TemplateID); err != nil {
			return fmt.Errorf("replace template %s: %w", b.TemplateID, err)
		}
	}
	dir := filepath.Join(scratch, "image")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendImage(img); err != nil {
		return fmt.Errorf("write the template image: %w", err)
	}
	b.logf("info", "finalize", "Importing template %s (%s) on every node", b.TemplateID, d)
	start := time.Now()
	if _, err := e.b.ImportTemplate(ctx, master.TemplateImport{ID: b.TemplateID, Source: dir}); err != nil {
		return fmt.Errorf("import template %s: %w", b.TemplateID, err)
	}
	b.logf("info", "finalize", "Imported in %s", time.Since(start).Round(time.Millisecond))
	return e.setOwner(b)
}

func (e *Engine) setOwner(b *Build) error {
	data, _ := json.Marshal(owner{Team: b.Team})
	return os.WriteFile(e.ownerPath(b.TemplateID), data, 0o600)
}

func removeEnv(env []string, k string) []string {
	out := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, k+"=") {
			out = append(out, kv)
		}
	}
	return out
}
