// Command images builds the OCI images the Helm chart (deploy/helm/cube)
// runs, without a container engine (package imagebuild): Go binaries built
// here as layers, Debian packages (apt-get download, with their
// dependencies) unpacked into layers, every image reproducible.
//
//	go run ./hack/images [--out DIR] [--tag TAG] [--push HOST:PORT] [--values FILE]
//
// It writes one OCI layout holding every image (tagged cube/<name>:<tag>),
// optionally pushes them to a registry, and writes a values overlay that
// pins each image by digest. Images:
//
//	cube/cubelet        cubelet, cube-agent, runc, runsc, QEMU, XFS and mount tools,
//	                    the VM guest kernel and initramfs (when --guest-dir has them)
//	cube/network-agent  network-agent
//	cube/cubemaster     cubemaster, cubecli
//	cube/cubeproxy      cubeproxy
//	cube/mariadb        Debian's mariadbd (the catalog's built-in database)
//	cube/pause          busybox sleeping: a pod sandbox image for a cluster without pulls
//	cube/installer      cube (join), cube-k8s (certificates, helm tests), cube-agent,
//	                    the VM guest artifacts and busybox: lays them onto the node
package main

import (
	"context"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/cubesandbox/cube/internal/imagebuild"
	"github.com/cubesandbox/cube/internal/testimage"
)

// The Debian packages each image unpacks (with their dependencies).
var (
	nodeDebs = []string{"runc", "runsc", "qemu-system-x86", "xfsprogs", "e2fsprogs", "util-linux", "mount",
		"iproute2", "busybox-static", "zstd"}
	toolDebs = []string{"busybox-static"}
	// The catalog's built-in database: Debian's mariadbd, started by the
	// chart's script (deploy/helm/cube/files/mariadb-run.sh).
	mariadbDebs = []string{"mariadb-server-core", "busybox-static"}
)

func main() {
	out := flag.String("out", "", "OCI layout to write the images into (required)")
	tag := flag.String("tag", "0.1.0", "tag of every image (never latest: the chart pins digests)")
	push := flag.String("push", "", "registry host:port to push the images to (loopback: plain HTTP)")
	values := flag.String("values", "", "write a Helm values overlay pinning the images by digest here")
	repo := flag.String("repository", "", "repository prefix in the values (default: the --push registry, else none)")
	debCache := flag.String("deb-cache", "/var/cache/cube/debs", "where downloaded .deb files are kept")
	guestDir := flag.String("guest-dir", "/var/lib/cube/vm", "VM guest artifacts (go run ./hack/vm-guest); missing = images without them")
	only := flag.String("only", "", "comma-separated image names to build (default all)")
	var extraLabels labelFlags
	flag.Var(&extraLabels, "label", "KEY=VALUE added to every image's labels (repeatable): a changed input, a new digest")
	flag.Parse()
	if *out == "" {
		flag.Usage()
		os.Exit(2)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	b := &builder{log: log, debCache: *debCache, guestDir: *guestDir, labels: extraLabels}
	if err := b.run(ctx, *out, *tag, *push, *values, *repo, *only); err != nil {
		log.Error("images", "error", err)
		os.Exit(1)
	}
}

type builder struct {
	log      *slog.Logger
	debCache string
	guestDir string
	tmp      string
	bins     string
	labels   labelFlags
}

// labelFlags is --label KEY=VALUE, repeated.
type labelFlags map[string]string

func (l *labelFlags) String() string { return fmt.Sprint(map[string]string(*l)) }

func (l *labelFlags) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || k == "" {
		return fmt.Errorf("--label %q: want KEY=VALUE", v)
	}
	if *l == nil {
		*l = labelFlags{}
	}
	(*l)[k] = val
	return nil
}

func (b *builder) run(ctx context.Context, out, tag, push, valuesFile, repo, only string) error {
	if strings.EqualFold(tag, "latest") {
		return fmt.Errorf("tag latest is refused: the chart pins versions")
	}
	tmp, err := os.MkdirTemp("", "cube-images-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	b.tmp, b.bins = tmp, filepath.Join(tmp, "bin")
	start := time.Now()
	if err := b.buildBinaries(ctx); err != nil {
		return err
	}
	b.log.Info("binaries built", "took", time.Since(start).Round(time.Millisecond))
	specs, err := b.specs(ctx)
	if err != nil {
		return err
	}
	want := map[string]bool{}
	for _, n := range strings.Split(only, ",") {
		if n != "" {
			want[n] = true
		}
	}
	images := map[string]v1.Image{}
	digests := map[string]string{}
	for _, s := range specs {
		short := strings.TrimPrefix(s.Name, "cube/")
		if len(want) > 0 && !want[short] {
			continue
		}
		img, err := imagebuild.Image(s)
		if err != nil {
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		d, err := img.Digest()
		if err != nil {
			return err
		}
		size := int64(0)
		ls, _ := img.Layers()
		for _, l := range ls {
			n, _ := l.Size()
			size += n
		}
		b.log.Info("image", "name", s.Name, "digest", d.String(), "compressed_mib", fmt.Sprintf("%.1f", float64(size)/(1<<20)))
		images[s.Name+":"+tag] = img
		digests[short] = d.String()
		if push != "" {
			if _, err := imagebuild.Push(ctx, img, push+"/"+s.Name+":"+tag); err != nil {
				return err
			}
		}
	}
	if _, err := imagebuild.WriteLayout(out, images); err != nil {
		return err
	}
	b.log.Info("layout written", "dir", out, "took", time.Since(start).Round(time.Millisecond))
	if valuesFile != "" {
		if repo == "" && push != "" {
			repo = push + "/"
		}
		if err := os.WriteFile(valuesFile, []byte(valuesOverlay(repo, tag, digests)), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// valuesOverlay pins each image of the chart by digest.
func valuesOverlay(repo, tag string, digests map[string]string) string {
	var sb strings.Builder
	sb.WriteString("# Written by hack/images: every image pinned by digest.\nimages:\n")
	names := make([]string, 0, len(digests))
	for n := range digests {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if n == "pause" { // the cluster's, not the chart's
			continue
		}
		fmt.Fprintf(&sb, "  %s:\n    repository: %scube/%s\n    tag: %q\n    digest: %s\n", valuesKey(n), repo, n, tag, digests[n])
	}
	return sb.String()
}

// valuesKey is the chart's key of an image: networkAgent for network-agent.
func valuesKey(n string) string {
	parts := strings.Split(n, "-")
	for i := 1; i < len(parts); i++ {
		parts[i] = strings.ToUpper(parts[i][:1]) + parts[i][1:]
	}
	return strings.Join(parts, "")
}

// buildBinaries builds the module's commands the images carry, static and
// without build paths, so the same source gives the same bytes.
func (b *builder) buildBinaries(ctx context.Context) error {
	cmds := []string{"cubelet", "cube-agent", "network-agent", "cubemaster", "cubecli", "cubeproxy", "cube", "cube-k8s"}
	args := []string{"build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w", "-o", b.bins + "/"}
	for _, c := range cmds {
		args = append(args, "./cmd/"+c)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build: %w", err)
	}
	return nil
}

func (b *builder) bin(names ...string) []imagebuild.Entry {
	var es []imagebuild.Entry
	for _, n := range names {
		es = append(es, imagebuild.Entry{Path: "usr/local/bin/" + n, Src: filepath.Join(b.bins, n)})
	}
	return es
}

func (b *builder) debLayer(ctx context.Context, pkgs []string) (v1.Layer, error) {
	names, err := imagebuild.Resolve(ctx, pkgs, nil)
	if err != nil {
		return nil, err
	}
	files, err := imagebuild.Download(ctx, b.debCache, names)
	if err != nil {
		return nil, err
	}
	return imagebuild.DebLayer(ctx, b.tmp, files)
}

// guest lists the VM guest artifacts under dst, or nothing when absent.
func (b *builder) guest(dst string) []imagebuild.Entry {
	var es []imagebuild.Entry
	for _, f := range []string{"vmlinuz", "initrd.img", "guest.json"} {
		p := filepath.Join(b.guestDir, f)
		if _, err := os.Stat(p); err != nil {
			b.log.Warn("no VM guest artifacts: the images leave the vm runtime out", "missing", p)
			return nil
		}
		es = append(es, imagebuild.Entry{Path: dst + "/" + f, Src: p, Mode: 0o644})
	}
	return es
}

// shLink makes busybox (from busybox-static) the images' /bin/sh.
var shLink = []imagebuild.Entry{{Path: "bin/sh", Link: "busybox"}}

// dist is the tree the installer lays onto each node
// (/usr/share/cube/dist, cube-k8s install): cube-agent, which sandboxes
// bind from the host, the VM guest, and the default template's image.
func (b *builder) dist() ([]imagebuild.Entry, error) {
	const root = "usr/share/cube/dist"
	es := []imagebuild.Entry{{Path: root + "/cube-agent", Src: filepath.Join(b.bins, "cube-agent")}}
	es = append(es, b.guest(root+"/vm")...)
	layout := filepath.Join(b.tmp, "busybox-oci")
	if err := testimage.WriteE2BBusybox(layout); err != nil {
		return nil, fmt.Errorf("the default template: %w", err)
	}
	err := filepath.WalkDir(layout, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(layout, p)
		es = append(es, imagebuild.Entry{Path: root + "/templates/busybox/" + rel, Src: p, Mode: 0o644})
		return nil
	})
	return es, err
}

func (b *builder) specs(ctx context.Context) ([]imagebuild.Spec, error) {
	nodeDeb, err := b.debLayer(ctx, nodeDebs)
	if err != nil {
		return nil, err
	}
	toolDeb, err := b.debLayer(ctx, toolDebs)
	if err != nil {
		return nil, err
	}
	layer := func(es ...[]imagebuild.Entry) (v1.Layer, error) {
		var all []imagebuild.Entry
		for _, e := range es {
			all = append(all, e...)
		}
		return imagebuild.FilesLayer(b.tmp, all)
	}
	guest := b.guest("usr/lib/cube/vm")
	cubelet, err := layer(b.bin("cubelet", "cube-agent", "cubecli"), guest, shLink)
	if err != nil {
		return nil, err
	}
	netagent, err := layer(b.bin("network-agent"))
	if err != nil {
		return nil, err
	}
	master, err := layer(b.bin("cubemaster", "cubecli", "cube-k8s"), shLink)
	if err != nil {
		return nil, err
	}
	proxy, err := layer(b.bin("cubeproxy"))
	if err != nil {
		return nil, err
	}
	dist, err := b.dist()
	if err != nil {
		return nil, err
	}
	installer, err := layer(b.bin("cube", "cube-k8s", "cubecli"), dist, shLink)
	if err != nil {
		return nil, err
	}
	mariadbDeb, err := b.debLayer(ctx, mariadbDebs)
	if err != nil {
		return nil, err
	}
	pauseDeb, err := b.debLayer(ctx, []string{"busybox-static"})
	if err != nil {
		return nil, err
	}
	links, err := layer(shLink)
	if err != nil {
		return nil, err
	}
	labels := map[string]string{"org.opencontainers.image.source": "github.com/cubesandbox/cube"}
	for k, v := range b.labels {
		labels[k] = v
	}
	return []imagebuild.Spec{
		{Name: "cube/cubelet", Layers: []v1.Layer{nodeDeb, cubelet}, Entrypoint: []string{"/usr/local/bin/cubelet"}, Labels: labels},
		{Name: "cube/network-agent", Layers: []v1.Layer{netagent}, Entrypoint: []string{"/usr/local/bin/network-agent"}, Labels: labels},
		{Name: "cube/cubemaster", Layers: []v1.Layer{toolDeb, master}, Entrypoint: []string{"/usr/local/bin/cubemaster"}, Labels: labels},
		{Name: "cube/cubeproxy", Layers: []v1.Layer{proxy}, Entrypoint: []string{"/usr/local/bin/cubeproxy"}, Labels: labels},
		// The pod sandbox image hack/kube-up.sh's containerd runs (no pulls).
		{Name: "cube/pause", Layers: []v1.Layer{pauseDeb}, Entrypoint: []string{"/bin/busybox", "sleep", "2147483647"}, Labels: labels},
		{Name: "cube/mariadb", Layers: []v1.Layer{mariadbDeb, links}, Entrypoint: []string{"/bin/sh"}, Labels: labels},
		{Name: "cube/installer", Layers: []v1.Layer{toolDeb, installer}, Entrypoint: []string{"/usr/local/bin/cube-k8s"}, Labels: labels},
	}, nil
}
