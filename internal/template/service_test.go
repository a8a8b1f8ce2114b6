package template

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/cubesandbox/cube/internal/testimage"
)

// The image labels that declare a template's service reach the import's
// Meta; an image without them declares none.
func TestResolveServiceLabels(t *testing.T) {
	img, err := testimage.BusyboxImage()
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	labelled := cf.Config.DeepCopy()
	labelled.Labels = map[string]string{LabelStartCmd: "exec server --port 49999", LabelReadyCmd: "nc -z 127.0.0.1 49999", "other": "x"}
	withLabels, err := mutate.Config(img, *labelled)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name         string
		start, ready string
	}{
		{"labelled", "exec server --port 49999", "nc -z 127.0.0.1 49999"},
		{"plain", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "layout")
			p, err := layout.Write(dir, empty.Index)
			if err != nil {
				t.Fatal(err)
			}
			im := withLabels
			if tc.name == "plain" {
				im = img
			}
			if err := p.AppendImage(im); err != nil {
				t.Fatal(err)
			}
			r, err := Resolve(context.Background(), ImportRequest{Source: dir, WorkDir: t.TempDir(), Output: filepath.Join(t.TempDir(), "out.img"), AgentBinary: "/bin/true"})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			if r.Meta.StartCmd != tc.start || r.Meta.ReadyCmd != tc.ready {
				t.Errorf("start %q ready %q, want %q %q", r.Meta.StartCmd, r.Meta.ReadyCmd, tc.start, tc.ready)
			}
		})
	}
}
