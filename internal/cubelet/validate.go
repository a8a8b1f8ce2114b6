package cubelet

import (
	"fmt"
	"regexp"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

// FieldError is an InvalidArgument about one request field.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Msg }
func (e *FieldError) Unwrap() error { return errdefs.ErrInvalidArgument }

func fieldErr(field, f string, a ...any) error {
	return &FieldError{Field: field, Msg: fmt.Sprintf(f, a...)}
}

var (
	labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$`)
	envKeyRE   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
)

const maxMapEntries = 256

func validateMap(field string, m map[string]string, keyRE *regexp.Regexp, maxVal int) error {
	if len(m) > maxMapEntries {
		return fieldErr(field, "%d entries, at most %d", len(m), maxMapEntries)
	}
	for k, v := range m {
		if !keyRE.MatchString(k) {
			return fieldErr(field, "invalid key %q", k)
		}
		if len(v) > maxVal {
			return fieldErr(field, "value of %q is %d bytes, at most %d", k, len(v), maxVal)
		}
	}
	return nil
}

func (s *Service) validateCreate(req *CreateRequest) (*sandbox.Template, error) {
	if req.SandboxID != "" {
		if err := sandboxid.Validate("sandbox", req.SandboxID); err != nil {
			return nil, &FieldError{Field: "sandbox_id", Msg: err.Error()}
		}
	}
	if req.TemplateID == "" {
		return nil, fieldErr("template_id", "required")
	}
	if err := sandboxid.Validate("template", req.TemplateID); err != nil {
		return nil, &FieldError{Field: "template_id", Msg: err.Error()}
	}
	tmpl, err := s.store.GetTemplate(req.TemplateID)
	if err != nil {
		return nil, err
	}
	if req.Runtime == "" {
		req.Runtime = tmpl.Runtime
	}
	if req.Runtime == "" {
		req.Runtime = s.cfg.Node.DefaultRuntime
	}
	if _, ok := s.node.Drivers[req.Runtime]; !ok {
		return nil, fieldErr("runtime", "%q is not available on this node", req.Runtime)
	}
	if err := s.runtimeUsable(req.Runtime); err != nil {
		return nil, err
	}
	c := s.cfg.Sandbox
	r := &req.Resources
	for _, l := range []struct {
		field    string
		v        *int64
		def, max int64
	}{
		{"resources.milli_cpu", &r.MilliCPU, c.DefaultMilliCPU, c.MaxMilliCPU},
		{"resources.memory_mib", &r.MemoryMiB, c.DefaultMemoryMiB, c.MaxMemoryMiB},
		{"resources.pids", &r.Pids, c.DefaultPids, c.MaxPids},
		{"resources.disk_mib", &r.DiskMiB, 0, c.MaxDiskMiB},
	} {
		switch {
		case *l.v < 0:
			return nil, fieldErr(l.field, "%d is negative", *l.v)
		case *l.v > l.max:
			return nil, fieldErr(l.field, "%d exceeds the node maximum %d", *l.v, l.max)
		case *l.v == 0:
			*l.v = l.def
		}
	}
	if r.MemoryMiB < 16 {
		return nil, fieldErr("resources.memory_mib", "%d MiB is below the 16 MiB minimum", r.MemoryMiB)
	}
	if err := validateMap("labels", req.Labels, labelKeyRE, 256); err != nil {
		return nil, err
	}
	if err := validateMap("annotations", req.Annotations, labelKeyRE, 64<<10); err != nil {
		return nil, err
	}
	if err := validateMap("env", req.Env, envKeyRE, 128<<10); err != nil {
		return nil, err
	}
	if len(req.RequestID) > 128 {
		return nil, fieldErr("request_id", "longer than 128 bytes")
	}
	if req.HostMounts, err = checkHostMounts(s.cfg, req.HostMounts); err != nil {
		return nil, err
	}
	if err := s.node.Net.CheckPolicy(req.Network); err != nil {
		return nil, err
	}
	return tmpl, nil
}
