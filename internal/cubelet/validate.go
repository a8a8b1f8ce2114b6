package cubelet

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/sandbox"
	"github.com/cubesandbox/cube/internal/sandboxid"
)

var labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?$`)

const maxMapEntries = 256

func validateMap(field string, m map[string]string, keyRE *regexp.Regexp, maxVal int) error {
	if len(m) > maxMapEntries {
		return errdefs.FieldErrorf(field, "%d entries, at most %d", len(m), maxMapEntries)
	}
	for k, v := range m {
		if !keyRE.MatchString(k) {
			return errdefs.FieldErrorf(field, "invalid key %q", k)
		}
		if len(v) > maxVal {
			return errdefs.FieldErrorf(field, "value of %q is %d bytes, at most %d", k, len(v), maxVal)
		}
	}
	return nil
}

func (s *Service) validateCreate(req *CreateRequest) (*sandbox.Template, error) {
	if req.SandboxID != "" {
		if err := sandboxid.Validate("sandbox", req.SandboxID); err != nil {
			return nil, &errdefs.FieldError{Field: "sandbox_id", Msg: err.Error()}
		}
	}
	if req.TemplateID == "" {
		return nil, errdefs.FieldErrorf("template_id", "required")
	}
	if err := sandboxid.Validate("template", req.TemplateID); err != nil {
		return nil, &errdefs.FieldError{Field: "template_id", Msg: err.Error()}
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
		return nil, errdefs.FieldErrorf("runtime", "%q is not available on this node", req.Runtime)
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
			return nil, errdefs.FieldErrorf(l.field, "%d is negative", *l.v)
		case *l.v > l.max:
			return nil, errdefs.FieldErrorf(l.field, "%d exceeds the node maximum %d", *l.v, l.max)
		case *l.v == 0:
			*l.v = l.def
		}
	}
	if r.MemoryMiB < 16 {
		return nil, errdefs.FieldErrorf("resources.memory_mib", "%d MiB is below the 16 MiB minimum", r.MemoryMiB)
	}
	if err := validateMap("labels", req.Labels, labelKeyRE, 256); err != nil {
		return nil, err
	}
	if err := validateMap("annotations", req.Annotations, labelKeyRE, 64<<10); err != nil {
		return nil, err
	}
	if err := validateMap("env", req.Env, sandbox.EnvKeyRE, 128<<10); err != nil {
		return nil, err
	}
	if err := validateToken(req.AccessToken); err != nil {
		return nil, errdefs.FieldErrorf("access_token", "%v", err)
	}
	if len(req.RequestID) > 128 {
		return nil, errdefs.FieldErrorf("request_id", "longer than 128 bytes")
	}
	if req.HostMounts, err = checkHostMounts(s.cfg, req.HostMounts); err != nil {
		return nil, err
	}
	if err := s.checkVolumes(req); err != nil {
		return nil, err
	}
	if err := s.node.Net.CheckPolicy(req.Network); err != nil {
		return nil, err
	}
	return tmpl, nil
}

// maxTokenLen bounds an agent access token (the control plane's are 48
// hex digits).
const maxTokenLen = 512

// validateToken admits access tokens that fit in an HTTP header as they
// are: printable ASCII without spaces.
func validateToken(tok string) error {
	if len(tok) > maxTokenLen {
		return fmt.Errorf("longer than %d bytes", maxTokenLen)
	}
	for i := 0; i < len(tok); i++ {
		if tok[i] <= ' ' || tok[i] > '~' {
			return errors.New("only printable ASCII without spaces")
		}
	}
	return nil
}
