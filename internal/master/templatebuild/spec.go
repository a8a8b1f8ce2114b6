// Package templatebuild builds templates from E2B's template definitions
// (the SDKs' Template builder: a base image or template, then RUN, COPY,
// ENV, WORKDIR and USER steps, a start and a ready command) without an
// image builder: every step that changes files runs in a build sandbox on
// a node (the node's own runtime), and the files it changed become an OCI
// layer. Layers are cached by a key chained over the base and the steps,
// so a build whose first steps did not change reuses their layers. The
// result is imported as a cluster template (the master's template store),
// which every node pulls.
package templatebuild

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"path"
	"regexp"
	"strings"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Spec is E2B's TemplateBuildStartV2: what POST
// /v2/templates/{id}/builds/{buildID} carries.
type Spec struct {
	FromImage         string          `json:"fromImage,omitempty"`
	FromTemplate      string          `json:"fromTemplate,omitempty"`
	FromImageRegistry json.RawMessage `json:"fromImageRegistry,omitempty"`
	StartCmd          string          `json:"startCmd,omitempty"`
	ReadyCmd          string          `json:"readyCmd,omitempty"`
	Steps             []Step          `json:"steps,omitempty"`
	// Force runs every step whatever the cache holds.
	Force bool `json:"force,omitempty"`
}

// Step is E2B's TemplateStep.
type Step struct {
	Type      string   `json:"type"`
	Args      []string `json:"args,omitempty"`
	FilesHash string   `json:"filesHash,omitempty"`
	Force     bool     `json:"force,omitempty"`
}

// filesHashRE is what the SDKs send for a COPY's files (a SHA-256 in hex).
var filesHashRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// ValidFilesHash reports whether h names an upload (hex SHA-256).
func ValidFilesHash(h string) bool { return filesHashRE.MatchString(h) }

// Validate checks the definition before any work starts.
func (s *Spec) Validate() error {
	if (s.FromImage == "") == (s.FromTemplate == "") {
		return fmt.Errorf("exactly one of fromImage or fromTemplate must be given and non-empty: %w", errdefs.ErrInvalidArgument)
	}
	if len(s.FromImageRegistry) > 0 && string(s.FromImageRegistry) != "null" {
		return fmt.Errorf("fromImageRegistry: this system pulls no registry image for a build (only images it has locally): %w", errdefs.ErrInvalidArgument)
	}
	if s.ReadyCmd != "" && s.StartCmd == "" {
		return fmt.Errorf("readyCmd without startCmd: %w", errdefs.ErrInvalidArgument)
	}
	for i, st := range s.Steps {
		if err := st.validate(); err != nil {
			return &StepError{Step: i + 1, Err: err}
		}
	}
	return nil
}

func (st Step) validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%s step: "+format+": %w", append(append([]any{st.Type}, a...), errdefs.ErrInvalidArgument)...)
	}
	switch st.Type {
	case "RUN":
		if len(st.Args) < 1 || len(st.Args) > 2 || strings.TrimSpace(st.Args[0]) == "" {
			return bad("args are [command] or [command, user]")
		}
	case "COPY":
		if len(st.Args) < 2 || len(st.Args) > 4 || st.Args[0] == "" || st.Args[1] == "" {
			return bad("args are [src, dest, user?, mode?]")
		}
		if !ValidFilesHash(st.FilesHash) {
			return bad("filesHash %q is not a hex SHA-256", st.FilesHash)
		}
		if len(st.Args) == 4 && st.Args[3] != "" && !regexp.MustCompile(`^[0-7]{3,4}$`).MatchString(st.Args[3]) {
			return bad("mode %q is not octal", st.Args[3])
		}
	case "ENV":
		if len(st.Args) == 0 || len(st.Args)%2 != 0 {
			return bad("args are key, value pairs")
		}
		for i := 0; i < len(st.Args); i += 2 {
			if !regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`).MatchString(st.Args[i]) {
				return bad("%q is not a variable name", st.Args[i])
			}
		}
	case "WORKDIR":
		if len(st.Args) != 1 || st.Args[0] == "" {
			return bad("args are [dir]")
		}
	case "USER":
		if len(st.Args) != 1 || !regexp.MustCompile(`^[a-z_][a-z0-9_-]*$`).MatchString(st.Args[0]) {
			return bad("args are [user name]")
		}
	default:
		return fmt.Errorf("step type %q: this system builds RUN, COPY, ENV, WORKDIR and USER steps: %w", st.Type, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Layered reports whether the step changes files (and so runs in the
// build sandbox and makes a layer); ENV and USER change the image's
// config only.
func (st Step) Layered() bool { return st.Type == "RUN" || st.Type == "COPY" || st.Type == "WORKDIR" }

// Describe is the step as the build log names it.
func (st Step) Describe() string {
	switch st.Type {
	case "RUN":
		return "RUN " + st.Args[0]
	case "COPY":
		return "COPY " + st.Args[0] + " " + st.Args[1]
	}
	return st.Type + " " + strings.Join(st.Args, " ")
}

// BaseKey is the first link of the cache chain: the base image by digest,
// and the team. A COPY's files are known by the hash the SDK computed,
// which the master cannot check against the upload: with the team in the
// chain, what one team uploaded under a hash never reaches another
// team's build.
func BaseKey(team, baseDigest string) string {
	h := sha256.Sum256([]byte("cube-template-build/v1\x00base\x00" + team + "\x00" + baseDigest))
	return hex.EncodeToString(h[:])
}

// NextKey chains a step onto the key of everything before it: the step's
// type and args, and for a COPY the hash of its files. Force is not part
// of it: a forced step is run again and its result replaces the cached
// one under the same key.
func NextKey(prev string, st Step) string {
	def, _ := json.Marshal(struct {
		Type      string   `json:"t"`
		Args      []string `json:"a"`
		FilesHash string   `json:"f,omitempty"`
	}{st.Type, st.Args, st.FilesHash})
	h := sha256.New()
	h.Write([]byte(prev))
	h.Write([]byte{0})
	h.Write(def)
	return hex.EncodeToString(h.Sum(nil))
}

// State is the image config the steps build up.
type State struct {
	// Env holds the variables set by ENV steps, in the order set.
	Env     []string
	Workdir string
	User    string
}

// Apply folds a config step into the state.
func (s *State) Apply(st Step) {
	switch st.Type {
	case "ENV":
		for i := 0; i+1 < len(st.Args); i += 2 {
			s.setEnv(st.Args[i], st.Args[i+1])
		}
	case "WORKDIR":
		s.Workdir = s.abs(st.Args[0])
	case "USER":
		s.User = st.Args[0]
	}
}

func (s *State) setEnv(k, v string) {
	for i, kv := range s.Env {
		if strings.HasPrefix(kv, k+"=") {
			s.Env[i] = k + "=" + v
			return
		}
	}
	s.Env = append(s.Env, k+"="+v)
}

// EnvMap is Env as a map (what a process start takes).
func (s *State) EnvMap() map[string]string {
	m := make(map[string]string, len(s.Env))
	for _, kv := range s.Env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}

// abs resolves a path against the working directory, as Docker does.
func (s *State) abs(p string) string {
	if path.IsAbs(p) {
		return path.Clean(p)
	}
	wd := s.Workdir
	if wd == "" {
		wd = "/"
	}
	return path.Join(wd, p)
}

// StepError is a build that failed at one step (1-based, as E2B's
// BuildStatusReason.step numbers them; 0 is the base, "finalize" the
// start command).
type StepError struct {
	Step int
	// Finalize: the start or ready command failed.
	Finalize bool
	Err      error
}

func (e *StepError) Error() string {
	if e.Finalize {
		return "finalize: " + e.Err.Error()
	}
	return fmt.Sprintf("step %d: %v", e.Step, e.Err)
}

func (e *StepError) Unwrap() error { return e.Err }

// StepName is the step as E2B's status reason names it.
func (e *StepError) StepName() string {
	if e.Finalize {
		return "finalize"
	}
	if e.Step == 0 {
		return "base"
	}
	return fmt.Sprint(e.Step)
}
