package chart

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// The values reference in docs/kubernetes.md is generated from the
// chart's values.schema.json (descriptions, types, allowed values) and
// values.yaml (defaults). CUBE_UPDATE_DOCS=1 rewrites it; otherwise the
// test fails when it is stale.
func TestValuesReference(t *testing.T) {
	var schema map[string]any
	b, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatal(err)
	}
	var defaults map[string]any
	b, err = os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &defaults); err != nil {
		t.Fatal(err)
	}
	defs, _ := schema["definitions"].(map[string]any)
	var rows []string
	var walk func(prefix string, s map[string]any, def any)
	walk = func(prefix string, s map[string]any, def any) {
		if ref, ok := s["$ref"].(string); ok {
			name := strings.TrimPrefix(ref, "#/definitions/")
			if d, ok := defs[name].(map[string]any); ok {
				merged := map[string]any{}
				for k, v := range d {
					merged[k] = v
				}
				for k, v := range s {
					if k != "$ref" {
						merged[k] = v
					}
				}
				s = merged
			}
		}
		props, _ := s["properties"].(map[string]any)
		if len(props) > 0 && s["type"] == "object" && prefix != "resources" && !strings.HasSuffix(prefix, ".resources") {
			keys := make([]string, 0, len(props))
			for k := range props {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			dm, _ := def.(map[string]any)
			for _, k := range keys {
				p := k
				if prefix != "" {
					p = prefix + "." + k
				}
				sub, _ := props[k].(map[string]any)
				walk(p, sub, dm[k])
			}
			return
		}
		typ := fmt.Sprint(s["type"])
		if e, ok := s["enum"].([]any); ok {
			var vs []string
			for _, v := range e {
				vs = append(vs, fmt.Sprintf("`%v`", v))
			}
			typ = strings.Join(vs, ", ")
		}
		dj, _ := json.Marshal(def)
		dflt := "`" + string(dj) + "`"
		if def == nil {
			dflt = ""
		}
		desc, _ := s["description"].(string)
		rows = append(rows, fmt.Sprintf("| `%s` | %s | %s | %s |", prefix, typ, dflt, strings.ReplaceAll(desc, "|", "\\|")))
	}
	walk("", schema, defaults)
	table := "| key | type or values | default | description |\n|---|---|---|---|\n" + strings.Join(rows, "\n") + "\n"

	doc := filepath.Join(repoRoot, "docs/kubernetes.md")
	b, err = os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	const begin, end = "<!-- values:begin (generated: CUBE_UPDATE_DOCS=1 go test -C hack/kube ./chart/ -run TestValuesReference) -->\n", "<!-- values:end -->"
	text := string(b)
	i, j := strings.Index(text, begin), strings.Index(text, end)
	if i < 0 || j < i {
		t.Fatalf("%s has no values markers", doc)
	}
	want := text[:i+len(begin)] + table + text[j:]
	if want == text {
		t.Logf("values reference: %d keys, up to date", len(rows))
		return
	}
	if os.Getenv("CUBE_UPDATE_DOCS") == "1" {
		if err := os.WriteFile(doc, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("rewrote the values reference (%d keys)", len(rows))
		return
	}
	t.Fatalf("docs/kubernetes.md's values reference is stale: CUBE_UPDATE_DOCS=1 go test -C hack/kube ./chart/ -run TestValuesReference")
}
