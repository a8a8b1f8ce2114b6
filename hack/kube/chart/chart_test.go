// Package chart tests the Helm chart deploy/helm/cube with helm as a
// library: lint, rendering of every values overlay in ci/, each rendered
// object validated against the OpenAPI schema of Kubernetes v1.34 (the
// same release hack/kube-up.sh runs), and each probe pointed at an
// endpoint the component serves.
package chart

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/BurntSushi/toml"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/lint"
	"helm.sh/helm/v3/pkg/lint/support"
	"k8s.io/kube-openapi/pkg/validation/spec"
	"sigs.k8s.io/yaml"
)

const kubeVersion = "v1.34.4"

var (
	repoRoot = func() string { p, _ := filepath.Abs("../../.."); return p }()
	chartDir = filepath.Join(repoRoot, "deploy/helm/cube")
)

func overlays(t *testing.T) map[string]map[string]any {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(chartDir, "ci", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no overlays in %s/ci: %v", chartDir, err)
	}
	out := map[string]map[string]any{"defaults": {}}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		v := map[string]any{}
		if err := yaml.Unmarshal(b, &v); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		out[strings.TrimSuffix(filepath.Base(f), ".yaml")] = v
	}
	return out
}

func load(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// render is `helm install --dry-run` without a cluster: every manifest,
// hooks and tests included.
func render(c *chart.Chart, vals map[string]any) ([]map[string]any, error) {
	kv, err := chartutil.ParseKubeVersion(kubeVersion)
	if err != nil {
		return nil, err
	}
	in := action.NewInstall(&action.Configuration{})
	in.ClientOnly, in.DryRun, in.Replace = true, true, true
	in.ReleaseName, in.Namespace = "cube", "cube-system"
	in.KubeVersion = kv
	in.APIVersions = append(chartutil.DefaultVersionSet, "cert-manager.io/v1", "cert-manager.io/v1/Certificate")
	rel, err := in.Run(c, vals)
	if err != nil {
		return nil, err
	}
	docs := []string{rel.Manifest}
	for _, h := range rel.Hooks {
		docs = append(docs, h.Manifest)
	}
	var objs []map[string]any
	for _, d := range docs {
		dec := yamlDocs(d)
		for _, doc := range dec {
			var o map[string]any
			if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
				return nil, fmt.Errorf("%w\n%s", err, doc)
			}
			if o != nil {
				objs = append(objs, o)
			}
		}
	}
	return objs, nil
}

func yamlDocs(s string) []string {
	var out []string
	for _, d := range regexp.MustCompile(`(?m)^---\s*$`).Split(s, -1) {
		if strings.TrimSpace(d) != "" {
			out = append(out, d)
		}
	}
	return out
}

func TestLint(t *testing.T) {
	kv, _ := chartutil.ParseKubeVersion(kubeVersion)
	for name, vals := range overlays(t) {
		t.Run(name, func(t *testing.T) {
			l := lint.AllWithKubeVersion(chartDir, vals, "cube-system", kv)
			for _, m := range l.Messages {
				t.Log(m)
				if m.Severity >= support.WarningSev {
					t.Errorf("lint: %s", m)
				}
			}
		})
	}
}

// openAPI is Kubernetes' OpenAPI (v2) document of the release built by
// hack/kube, from the k8s.io/kubernetes module.
func openAPI(t *testing.T) *spec.Swagger {
	t.Helper()
	dir := moduleDir(t, "k8s.io/kubernetes")
	b, err := os.ReadFile(filepath.Join(dir, "api/openapi-spec/swagger.json"))
	if err != nil {
		t.Fatal(err)
	}
	var sw spec.Swagger
	if err := json.Unmarshal(b, &sw); err != nil {
		t.Fatal(err)
	}
	return &sw
}

// moduleDir is where the module cache holds mod at the version go.mod
// selects, downloading it first (through the module proxy) when it is
// not there: on a fresh machine nothing has needed its source yet (the
// Kubernetes build, which does, runs after these tests).
func moduleDir(t *testing.T, mod string) string {
	t.Helper()
	out, err := execGo("mod", "download", "-json", mod)
	var m struct{ Dir, Error string }
	if jerr := json.Unmarshal([]byte(out), &m); err != nil || jerr != nil || m.Error != "" || m.Dir == "" {
		t.Fatalf("go mod download %s: %v %s", mod, err, out)
	}
	return m.Dir
}

// gvkIndex maps apiVersion/kind to the definition that declares it.
func gvkIndex(sw *spec.Swagger) map[string]string {
	idx := map[string]string{}
	for name, s := range sw.Definitions {
		raw, ok := s.Extensions["x-kubernetes-group-version-kind"]
		if !ok {
			continue
		}
		b, _ := json.Marshal(raw)
		var gvks []struct{ Group, Version, Kind string }
		_ = json.Unmarshal(b, &gvks)
		for _, g := range gvks {
			av := g.Version
			if g.Group != "" {
				av = g.Group + "/" + g.Version
			}
			if _, dup := idx[av+"/"+g.Kind]; !dup || !strings.HasPrefix(name, "io.k8s.apimachinery") {
				idx[av+"/"+g.Kind] = name
			}
		}
	}
	return idx
}

// TestRender renders every overlay and validates each object against the
// Kubernetes OpenAPI schema of its kind (unknown fields rejected, as the
// API server's strict field validation does). Objects of kinds the
// release does not serve (cert-manager's Certificate) are named, and
// only they are let through.
func TestRender(t *testing.T) {
	sw := openAPI(t)
	idx := gvkIndex(sw)
	c := load(t)
	// Control: the validator rejects a misspelt field, a wrong type and a
	// missing required field in an otherwise valid Deployment.
	for _, bad := range []string{
		`{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"x"},"spec":{"selector":{},"template":{"spec":{"containerz":[]}}}}`,
		`{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"x"},"spec":{"replicas":"two","selector":{},"template":{}}}`,
		`{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"x"},"spec":{"selector":{},"template":{"spec":{"containers":[{"image":"x"}]}}}}`,
	} {
		var o map[string]any
		if err := json.Unmarshal([]byte(bad), &o); err != nil {
			t.Fatal(err)
		}
		err := validateObject(sw, idx["apps/v1/Deployment"], o)
		if err == nil {
			t.Fatalf("the validator accepted %s", bad)
		}
		t.Logf("control: rejected (%v)", err)
	}
	good := `{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"x"},"spec":{"selector":{},"template":{"spec":{"containers":[{"name":"a","image":"x"}]}}}}`
	var o map[string]any
	_ = json.Unmarshal([]byte(good), &o)
	if err := validateObject(sw, idx["apps/v1/Deployment"], o); err != nil {
		t.Fatalf("the validator rejected a valid Deployment: %v", err)
	}
	for name, vals := range overlays(t) {
		t.Run(name, func(t *testing.T) {
			objs, err := render(c, vals)
			if err != nil {
				t.Fatal(err)
			}
			kinds := map[string]int{}
			for _, o := range objs {
				av, _ := o["apiVersion"].(string)
				kind, _ := o["kind"].(string)
				meta, _ := o["metadata"].(map[string]any)
				id := fmt.Sprintf("%s %s/%v", av, kind, meta["name"])
				kinds[kind]++
				def, ok := idx[av+"/"+kind]
				if !ok {
					if av == "cert-manager.io/v1" && kind == "Certificate" {
						continue
					}
					t.Errorf("%s: no such kind in Kubernetes %s", id, kubeVersion)
					continue
				}
				if err := validateObject(sw, def, o); err != nil {
					t.Errorf("%s: %v", id, err)
				}
				checkImages(t, id, o)
				checkConfigMap(t, sw, idx, id, o)
			}
			t.Logf("%d objects valid against Kubernetes %s: %v", len(objs), kubeVersion, kinds)
		})
	}
}

// checkConfigMap checks what a ConfigMap carries for the pods: each
// daemon config (*.toml) parses, each pod spec (*.json: the uninstall
// hook's drain and purge pods) is a valid Pod.
func checkConfigMap(t *testing.T, sw *spec.Swagger, idx map[string]string, id string, o map[string]any) {
	t.Helper()
	if o["kind"] != "ConfigMap" {
		return
	}
	data, _ := o["data"].(map[string]any)
	for k, v := range data {
		text, _ := v.(string)
		switch {
		case strings.HasSuffix(k, ".toml"):
			var m map[string]any
			if _, err := toml.Decode(text, &m); err != nil {
				t.Errorf("%s: %s: %v", id, k, err)
			}
		case strings.HasSuffix(k, ".json"):
			var pod map[string]any
			if err := json.Unmarshal([]byte(text), &pod); err != nil {
				t.Errorf("%s: %s: %v", id, k, err)
				continue
			}
			if pod["kind"] != "Pod" {
				t.Errorf("%s: %s: not a Pod", id, k)
				continue
			}
			if err := validateObject(sw, idx["v1/Pod"], pod); err != nil {
				t.Errorf("%s: %s: %v", id, k, err)
			}
			checkImages(t, id+" "+k, pod)
		}
	}
}

func validateObject(sw *spec.Swagger, def string, o map[string]any) error {
	var errs []string
	v := &validator{defs: sw.Definitions, errs: &errs}
	v.check("", o, &spec.Schema{SchemaProps: spec.SchemaProps{Ref: spec.MustCreateRef("#/definitions/" + def)}}, 0)
	if len(errs) == 0 {
		return nil
	}
	slices.Sort(errs)
	return errors.New(strings.Join(errs, "; "))
}

// validator checks a value against the OpenAPI (v2) schema of
// Kubernetes: types, required fields, enums, and fields the schema does
// not declare (rejected, as the API server's strict field validation
// rejects them).
type validator struct {
	defs spec.Definitions
	errs *[]string
}

func (v *validator) fail(path, f string, a ...any) {
	*v.errs = append(*v.errs, path+": "+fmt.Sprintf(f, a...))
}

func (v *validator) resolve(s *spec.Schema) *spec.Schema {
	for s.Ref.String() != "" {
		name := strings.TrimPrefix(s.Ref.String(), "#/definitions/")
		d, ok := v.defs[name]
		if !ok {
			return nil
		}
		s = &d
	}
	return s
}

func (v *validator) check(path string, val any, s *spec.Schema, depth int) {
	if depth > 64 {
		return
	}
	s = v.resolve(s)
	if s == nil || val == nil {
		return
	}
	if len(s.AllOf) == 1 { // a $ref wrapped for a description
		v.check(path, val, &s.AllOf[0], depth+1)
		return
	}
	if f, _ := s.Extensions["x-kubernetes-int-or-string"].(bool); f || s.Format == "int-or-string" {
		switch val.(type) {
		case string, float64:
		default:
			v.fail(path, "want an integer or a string, got %T", val)
		}
		return
	}
	typ := ""
	if len(s.Type) > 0 {
		typ = s.Type[0]
	}
	switch typ {
	case "object", "":
		m, ok := val.(map[string]any)
		if !ok {
			if typ == "object" {
				v.fail(path, "want an object, got %T", val)
			}
			return
		}
		for _, r := range s.Required {
			if _, ok := m[r]; !ok {
				v.fail(path, "required field %q missing", r)
			}
		}
		for k, sub := range m {
			if p, ok := s.Properties[k]; ok {
				v.check(path+"."+k, sub, &p, depth+1)
			} else if s.AdditionalProperties != nil && s.AdditionalProperties.Schema != nil {
				v.check(path+"."+k, sub, s.AdditionalProperties.Schema, depth+1)
			} else if len(s.Properties) > 0 {
				v.fail(path, "unknown field %q", k)
			}
		}
	case "array":
		a, ok := val.([]any)
		if !ok {
			v.fail(path, "want an array, got %T", val)
			return
		}
		if s.Items != nil && s.Items.Schema != nil {
			for i, e := range a {
				v.check(fmt.Sprintf("%s[%d]", path, i), e, s.Items.Schema, depth+1)
			}
		}
	case "string":
		str, ok := val.(string)
		if !ok {
			v.fail(path, "want a string, got %T (%v)", val, val)
			return
		}
		if len(s.Enum) > 0 && !slices.ContainsFunc(s.Enum, func(e any) bool { return e == str }) {
			v.fail(path, "%q is not one of %v", str, s.Enum)
		}
	case "integer":
		f, ok := val.(float64)
		if !ok || f != float64(int64(f)) {
			v.fail(path, "want an integer, got %T (%v)", val, val)
		}
	case "number":
		if _, ok := val.(float64); !ok {
			v.fail(path, "want a number, got %T", val)
		}
	case "boolean":
		if _, ok := val.(bool); !ok {
			v.fail(path, "want a boolean, got %T (%v)", val, val)
		}
	}
}

func containers(o map[string]any) (podSpec map[string]any, cs []map[string]any) {
	var ps map[string]any
	switch o["kind"] {
	case "Pod":
		ps, _ = o["spec"].(map[string]any)
	case "Deployment", "DaemonSet", "StatefulSet", "Job":
		tpl, _ := o["spec"].(map[string]any)["template"].(map[string]any)
		ps, _ = tpl["spec"].(map[string]any)
	default:
		return nil, nil
	}
	for _, key := range []string{"initContainers", "containers"} {
		list, _ := ps[key].([]any)
		for _, c := range list {
			if m, ok := c.(map[string]any); ok {
				cs = append(cs, m)
			}
		}
	}
	return ps, cs
}

func checkImages(t *testing.T, id string, o map[string]any) {
	_, cs := containers(o)
	for _, c := range cs {
		img, _ := c["image"].(string)
		if img == "" || strings.HasSuffix(img, ":latest") || !strings.ContainsAny(img, ":@") {
			t.Errorf("%s container %v: image %q is not pinned", id, c["name"], img)
		}
	}
}

// endpoints are the health endpoints each image's program serves, found
// in its source: a probe must name one that exists.
var endpoints = map[string]struct {
	file, pattern string
	paths         []string
}{
	"cube/cubemaster":    {"internal/master/e2bapi/server.go", `HandleFunc("GET /health"`, []string{"/health"}},
	"cube/cubeproxy":     {"internal/cubeproxy/server.go", `HandleFunc("GET /health"`, []string{"/health"}},
	"cube/network-agent": {"internal/network/agentapi/serve.go", `HandleFunc("/readyz"`, []string{"/healthz", "/readyz"}},
}

// TestProbes checks that every probe of every rendered pod points at an
// endpoint that exists: an HTTP probe's port is a port the container
// declares or, on the host network, the port its config listens on; its
// path is served by the program (checked in the source); HTTPS where the
// listener serves TLS; an exec probe's program is one the image carries.
func TestProbes(t *testing.T) {
	c := load(t)
	for name, vals := range overlays(t) {
		t.Run(name, func(t *testing.T) {
			objs, err := render(c, vals)
			if err != nil {
				t.Fatal(err)
			}
			configs := map[string]string{}
			for _, o := range objs {
				if o["kind"] == "ConfigMap" {
					data, _ := o["data"].(map[string]any)
					for k, v := range data {
						configs[k], _ = v.(string)
					}
				}
			}
			probes := 0
			for _, o := range objs {
				ps, cs := containers(o)
				hostNet, _ := ps["hostNetwork"].(bool)
				for _, ctr := range cs {
					for _, kind := range []string{"readinessProbe", "livenessProbe", "startupProbe"} {
						p, ok := ctr[kind].(map[string]any)
						if !ok {
							continue
						}
						probes++
						where := fmt.Sprintf("%s/%v %v %s", o["kind"], o["metadata"].(map[string]any)["name"], ctr["name"], kind)
						checkProbe(t, where, ctr, p, hostNet, configs)
					}
				}
			}
			if probes == 0 {
				t.Fatal("no probes rendered")
			}
			t.Logf("%d probes point at existing endpoints", probes)
		})
	}
}

func imageRepo(img string) string {
	if i := strings.Index(img, "@"); i >= 0 {
		img = img[:i]
	} else if i := strings.LastIndex(img, ":"); i > strings.LastIndex(img, "/") {
		img = img[:i]
	}
	// A registry host before the repository (host:port/cube/x).
	if parts := strings.Split(img, "/"); len(parts) > 2 {
		img = strings.Join(parts[len(parts)-2:], "/")
	}
	return img
}

func checkProbe(t *testing.T, where string, ctr, p map[string]any, hostNet bool, configs map[string]string) {
	repo := imageRepo(ctr["image"].(string))
	if h, ok := p["httpGet"].(map[string]any); ok {
		ep, ok := endpoints[repo]
		if !ok {
			t.Errorf("%s: HTTP probe on %s, which serves no known health endpoint", where, repo)
			return
		}
		src, err := os.ReadFile(filepath.Join(repoRoot, ep.file))
		if err != nil || !bytes.Contains(src, []byte(ep.pattern)) {
			t.Errorf("%s: %s no longer serves %s (%v)", where, ep.file, ep.pattern, err)
		}
		path, _ := h["path"].(string)
		if !slices.Contains(ep.paths, path) {
			t.Errorf("%s: path %q, %s serves %v", where, path, repo, ep.paths)
		}
		switch port := h["port"].(type) {
		case string:
			if !declaresPort(ctr, port) {
				t.Errorf("%s: port %q is not a port of the container", where, port)
			}
		case float64:
			host, _ := h["host"].(string)
			listen := fmt.Sprintf(`http = "127.0.0.1:%d"`, int(port))
			if !hostNet || host != "127.0.0.1" || !strings.Contains(configs["network-agent.toml"], listen) {
				t.Errorf("%s: port %d on host %q: no listener of the config (%s) is there", where, int(port), host, listen)
			}
		}
		scheme, _ := h["scheme"].(string)
		wantTLS := repo == "cube/cubemaster" && strings.Contains(configs["cubemaster.toml"], `e2b_tls_cert = "/`) ||
			repo == "cube/cubeproxy"
		if (scheme == "HTTPS") != wantTLS {
			t.Errorf("%s: scheme %q, the listener serves TLS: %v", where, scheme, wantTLS)
		}
		return
	}
	if e, ok := p["exec"].(map[string]any); ok {
		cmd, _ := e["command"].([]any)
		if len(cmd) == 0 {
			t.Errorf("%s: empty exec probe", where)
			return
		}
		prog := filepath.Base(fmt.Sprint(cmd[0]))
		// hack/images puts these programs into these images.
		carried := map[string][]string{"cube/cubelet": {"cubelet", "cube-agent", "cubecli"}}
		if !slices.Contains(carried[repo], prog) {
			t.Errorf("%s: exec %s, which %s does not carry", where, prog, repo)
		}
		if _, err := os.Stat(filepath.Join(repoRoot, "cmd", prog)); err != nil {
			t.Errorf("%s: exec %s: no such command in cmd/", where, prog)
		}
		return
	}
	if s, ok := p["tcpSocket"].(map[string]any); ok {
		if port, ok := s["port"].(string); !ok || !declaresPort(ctr, port) {
			t.Errorf("%s: tcpSocket port %v is not a port of the container", where, s["port"])
		}
		return
	}
	t.Errorf("%s: probe of no known kind: %v", where, p)
}

func declaresPort(ctr map[string]any, name string) bool {
	ports, _ := ctr["ports"].([]any)
	for _, p := range ports {
		if m, ok := p.(map[string]any); ok && m["name"] == name {
			return true
		}
	}
	return false
}

// TestRefusals: bad values fail with a message that says what to change;
// the control renders the same values less the fault.
func TestRefusals(t *testing.T) {
	c := load(t)
	for _, tc := range []struct {
		name string
		vals string
		want string
	}{
		{"sqlite with replicas", "catalog: {type: sqlite}\nmaster: {replicas: 2}", "with master.replicas > 1 use catalog.type mariadb or mysql"},
		{"latest tag", "images: {cubelet: {repository: cube/cubelet, tag: latest}}", "/images/cubelet/tag"},
		{"unknown key", "master: {replica: 2}", "replica"},
		{"bad mode", "mode: everything", "mode"},
		{"bad digest", "images: {cubelet: {repository: cube/cubelet, tag: '1', digest: 'sha256:xyz'}}", "digest"},
		{"compute-only without a token", "mode: compute-only", "needs join.masterAddr, join.joinAddr and join.tokenSecret"},
		{"mysql without a host", "catalog: {type: mysql}", "needs catalog.mysql.host"},
		{"tls secret without a name", "proxy: {tls: {mode: secret}}", "needs proxy.tls.secretName"},
		{"domain with upper case", "domain: Sandbox.Example", "domain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vals := map[string]any{}
			if err := yaml.Unmarshal([]byte(tc.vals), &vals); err != nil {
				t.Fatal(err)
			}
			_, err := render(c, vals)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("values %q: error %v, want one naming %q", tc.vals, err, tc.want)
			}
			t.Logf("refused: %v", firstLine(err.Error()))
		})
	}
	// Control: the defaults render, so each refusal above is the fault's.
	if _, err := render(c, map[string]any{}); err != nil {
		t.Fatalf("defaults: %v", err)
	}
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}

// TestPKI: the generated CA is one cube's pki package reads (ECDSA, EC
// PRIVATE KEY), since every component's certificate is issued from it.
func TestPKI(t *testing.T) {
	objs, err := render(load(t), map[string]any{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if o["kind"] != "Secret" || !strings.HasSuffix(fmt.Sprint(o["metadata"].(map[string]any)["name"]), "-pki") {
			continue
		}
		data := o["data"].(map[string]any)
		key := decode(t, data["ca.key"])
		crt := decode(t, data["ca.crt"])
		if !strings.HasPrefix(key, "-----BEGIN EC PRIVATE KEY-----") || !strings.HasPrefix(crt, "-----BEGIN CERTIFICATE-----") {
			t.Fatalf("CA key %.40q cert %.40q: want an EC key and a certificate", key, crt)
		}
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "ca.crt"), []byte(crt), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "ca.key"), []byte(key), 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := execGoRun(repoRoot, "./cmd/cube-k8s", "cert", "--ca-dir", dir, "--role", "master", "--name", "m1", "--hosts", "10.0.0.1", "--out", filepath.Join(dir, "pki"))
		if err != nil {
			t.Fatalf("cube-k8s cert from the chart's CA: %v\n%s", err, out)
		}
		t.Logf("%s", strings.TrimSpace(out))
		return
	}
	t.Fatal("no -pki Secret rendered")
}

func decode(t *testing.T, v any) string {
	t.Helper()
	s, _ := v.(string)
	b, err := base64Decode(s)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestObjectStore: objectStore's values reach cubemaster's
// [templates.object_store] and [store] and cubelet's [store] (the keys
// their config structs read), with the credentials' files mounted where
// the configs name them; without an endpoint neither config has them.
func TestObjectStore(t *testing.T) {
	c := load(t)
	all := overlays(t)
	for _, name := range []string{"object-store", "defaults"} {
		objs, err := render(c, all[name])
		if err != nil {
			t.Fatal(err)
		}
		cfg := map[string]map[string]any{}
		mounts := map[string]bool{}
		for _, o := range objs {
			if o["kind"] == "ConfigMap" {
				data, _ := o["data"].(map[string]any)
				for _, k := range []string{"cubemaster.toml", "cubelet.toml"} {
					if text, ok := data[k].(string); ok {
						m := map[string]any{}
						if _, err := toml.Decode(text, &m); err != nil {
							t.Fatalf("%s: %v", k, err)
						}
						cfg[k] = m
					}
				}
			}
			_, cs := containers(o)
			for _, ct := range cs {
				vms, _ := ct["volumeMounts"].([]any)
				for _, vm := range vms {
					m, _ := vm.(map[string]any)
					if m["mountPath"] == "/etc/cube/objstore" {
						mounts[fmt.Sprint(ct["name"])] = true
					}
				}
			}
		}
		get := func(file string, path ...string) any {
			var v any = cfg[file]
			for _, p := range path {
				m, _ := v.(map[string]any)
				v = m[p]
			}
			return v
		}
		tmpl := get("cubemaster.toml", "templates", "object_store")
		mstore := get("cubemaster.toml", "store")
		nstore := get("cubelet.toml", "store")
		t.Logf("%s: cubemaster [templates.object_store] %v [store] %v; cubelet [store] %v; credentials mounted in %v", name, tmpl, mstore, nstore, mounts)
		if name == "defaults" {
			if tmpl != nil || mstore != nil || nstore != nil || len(mounts) > 0 {
				t.Errorf("no objectStore.endpoint, yet an object store is configured")
			}
			continue
		}
		for _, got := range []any{tmpl, nstore} {
			m, _ := got.(map[string]any)
			if m["endpoint"] != "s3.storage.svc:9000" || m["bucket"] != "cube" || m["prefix"] != "prod/" || m["region"] != "us-east-1" ||
				m["access_key_file"] != "/etc/cube/objstore/access-key" || m["secret_key_file"] != "/etc/cube/objstore/secret-key" {
				t.Errorf("object store config %v: not the overlay's values", got)
			}
		}
		if m, _ := mstore.(map[string]any); m["export_snapshots"] != true || m["export_on_pause"] != true {
			t.Errorf("cubemaster [store] %v: exports not set", mstore)
		}
		if !mounts["cubemaster"] || !mounts["cubelet"] {
			t.Errorf("the credentials are not mounted into cubemaster and cubelet: %v", mounts)
		}
	}
}

// TestNodeHoldsNoCAKey: in every overlay the node DaemonSet's pods get
// the cluster CA's certificate but never its key (full-mode nodes join
// through the master's join issuer); control: the master's pods do get
// the key (they sign the joins), so the search finds one where it is.
func TestNodeHoldsNoCAKey(t *testing.T) {
	c := load(t)
	for name, vals := range overlays(t) {
		objs, err := render(c, vals)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			meta, _ := o["metadata"].(map[string]any)
			n := fmt.Sprint(meta["name"])
			b, _ := json.Marshal(o)
			holds := strings.Contains(string(b), `"key":"ca.key"`)
			switch {
			case o["kind"] == "DaemonSet" && strings.HasSuffix(n, "-node") && holds:
				t.Errorf("%s: DaemonSet %s mounts the CA key", name, n)
			case o["kind"] == "Deployment" && strings.HasSuffix(n, "-master") && !holds:
				t.Errorf("%s: control: the master Deployment %s has no CA key: the search is wrong", name, n)
			}
		}
	}
}
