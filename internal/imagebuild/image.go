package imagebuild

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Spec is one image.
type Spec struct {
	Name       string // repository name, e.g. cube/cubelet
	Layers     []v1.Layer
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
	Labels     map[string]string
}

// Image assembles spec as a linux/amd64 OCI image with the fixed time.
func Image(spec Spec) (v1.Image, error) {
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	adds := make([]mutate.Addendum, 0, len(spec.Layers))
	for _, l := range spec.Layers {
		adds = append(adds, mutate.Addendum{Layer: l, MediaType: types.OCILayer})
	}
	img, err := mutate.Append(img, adds...)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = "amd64", "linux"
	cf.Config.Entrypoint = spec.Entrypoint
	cf.Config.Cmd = spec.Cmd
	cf.Config.Env = append([]string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, spec.Env...)
	cf.Config.WorkingDir = spec.WorkingDir
	cf.Config.Labels = spec.Labels
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return nil, err
	}
	// mutate.Append stamps history entries with the zero time; CreatedAt
	// sets the config's and every history entry's to Epoch.
	return mutate.CreatedAt(img, v1.Time{Time: Epoch})
}

// WriteLayout writes images into the OCI layout at dir (created when
// absent), each tagged with the org.opencontainers.image.ref.name
// annotation ref (e.g. "cube/cubelet:v0.1.0"), the name `ctr images
// import` and skopeo give the image.
func WriteLayout(dir string, images map[string]v1.Image) (layout.Path, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		if p, err = layout.Write(dir, empty.Index); err != nil {
			return "", err
		}
	}
	for _, ref := range sortedKeys(images) {
		if err := p.ReplaceImage(images[ref], refMatcher(ref), layout.WithAnnotations(map[string]string{
			"org.opencontainers.image.ref.name": ref,
			// containerd's import names the image by this one.
			"io.containerd.image.name": FullName(ref),
		})); err != nil {
			return "", fmt.Errorf("write %s: %w", ref, err)
		}
	}
	return p, nil
}

// FullName is ref with the registry Kubernetes assumes when it names
// none (docker.io), as the kubelet asks containerd for it.
func FullName(ref string) string {
	first, _, found := strings.Cut(ref, "/")
	if !found || !strings.ContainsAny(first, ".:") && first != "localhost" {
		return "docker.io/" + ref
	}
	return ref
}

func refMatcher(ref string) func(v1.Descriptor) bool {
	return func(d v1.Descriptor) bool { return d.Annotations["org.opencontainers.image.ref.name"] == ref }
}

// Push uploads img to ref (host/repo:tag) over plain HTTP when the host is
// loopback, as the test registries are.
func Push(ctx context.Context, img v1.Image, ref string) (v1.Hash, error) {
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := remote.Write(r, img, remote.WithContext(ctx)); err != nil {
		return v1.Hash{}, fmt.Errorf("push %s: %w", ref, err)
	}
	return img.Digest()
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
