package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	cubeletpb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/cubeletclient"
	"github.com/cubesandbox/cube/internal/pki"
)

// install copies the tree at from into to/version (through a temporary
// directory renamed into place, so a reader never sees half of it) and
// points to/current at it. Versions already laid down are kept: running
// sandboxes bind the cube-agent of the version they started with.
func install(args []string) error {
	fs := flag.NewFlagSet("install", flag.ExitOnError)
	from := fs.String("from", "/usr/share/cube/dist", "the tree to lay down")
	to := fs.String("to", "/host/var/lib/cube/dist", "where versions are kept on the host")
	version := fs.String("version", "", "this version's directory name")
	_ = fs.Parse(args)
	if *version == "" || strings.ContainsAny(*version, "/") || *version == "." || *version == ".." {
		return fmt.Errorf("install: --version must be a plain name")
	}
	dst := filepath.Join(*to, *version)
	if _, err := os.Stat(filepath.Join(dst, ".complete")); err != nil {
		if err := os.MkdirAll(*to, 0o755); err != nil {
			return err
		}
		tmp, err := os.MkdirTemp(*to, ".install-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		if err := copyTree(*from, tmp); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(tmp, ".complete"), nil, 0o644); err != nil {
			return err
		}
		if err := os.Chmod(tmp, 0o755); err != nil {
			return err
		}
		_ = os.RemoveAll(dst)
		if err := os.Rename(tmp, dst); err != nil {
			return err
		}
	}
	link := filepath.Join(*to, ".current-new")
	_ = os.Remove(link)
	if err := os.Symlink(*version, link); err != nil {
		return err
	}
	if err := os.Rename(link, filepath.Join(*to, "current")); err != nil {
		return err
	}
	fmt.Printf("installed %s at %s\n", *version, dst)
	return nil
}

// copyTree copies the image's own tree (read-only, written by the image
// build) into a fresh temporary directory: nothing else writes either
// side while it runs.
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		out := filepath.Join(dst, rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return os.MkdirAll(out, info.Mode().Perm()|0o700)
		case info.Mode()&fs.ModeSymlink != 0:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(target, out) //nolint:gosec // G122: see copyTree
		default:
			in, err := os.Open(p) //nolint:gosec // G122: see copyTree
			if err != nil {
				return err
			}
			defer in.Close()
			f, err := os.OpenFile(out, os.O_CREATE|os.O_EXCL|os.O_WRONLY, info.Mode().Perm())
			if err != nil {
				return err
			}
			if _, err := io.Copy(f, in); err != nil {
				f.Close()
				return err
			}
			return f.Close()
		}
	})
}

// cert issues name's certificate of role from the CA in ca-dir.
func cert(args []string) error {
	fs := flag.NewFlagSet("cert", flag.ExitOnError)
	caDir := fs.String("ca-dir", "/etc/cube/ca", "the cluster CA: ca.crt and ca.key")
	role := fs.String("role", "", "master, node, proxy or admin")
	name := fs.String("name", "", "the component's name (certificate common name)")
	hosts := fs.String("hosts", "", "comma-separated IP addresses and DNS names it serves on")
	out := fs.String("out", "/etc/cube/pki", "where to write <base>.crt, <base>.key and ca.crt")
	base := fs.String("base", "", "file base name (default: the role)")
	_ = fs.Parse(args)
	r := pki.Role(*role)
	switch r {
	case pki.RoleMaster, pki.RoleNode, pki.RoleProxy, pki.RoleAdmin:
	default:
		return fmt.Errorf("cert: --role %q: want master, node, proxy or admin", *role)
	}
	if _, err := os.Stat(filepath.Join(*caDir, pki.CAKeyFile)); err != nil {
		return fmt.Errorf("cert: the CA key: %w", err)
	}
	ca, err := pki.LoadCA(*caDir)
	if err != nil {
		return err
	}
	if *base == "" {
		*base = *role
	}
	var hs []string
	for _, h := range strings.Split(*hosts, ",") {
		if h = strings.TrimSpace(h); h != "" {
			hs = append(hs, h)
		}
	}
	f, err := ca.Issue(*out, *base, *name, r, hs...)
	if err != nil {
		return err
	}
	fmt.Printf("issued %s (%s) for %v: %s\n", *name, r, hs, f.Cert)
	return nil
}

// template imports a template into the cubelet at socket once it answers
// (imports are idempotent by image digest), then with --stay waits for
// the end of ctx: as a container of the node pod it re-imports whenever
// the pod restarts.
func template(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("template", flag.ExitOnError)
	socket := fs.String("socket", "/run/cube/cubelet.sock", "cubelet's API socket")
	id := fs.String("id", "busybox", "template ID")
	source := fs.String("source", "", "the image's OCI layout, a path cubelet sees")
	wait := fs.Duration("wait", 10*time.Minute, "how long to wait for cubelet")
	stay := fs.Bool("stay", false, "after the import, wait for a signal")
	_ = fs.Parse(args)
	if *source == "" {
		return fmt.Errorf("template: --source is required")
	}
	deadline := time.Now().Add(*wait)
	for {
		err := importOnce(ctx, *socket, *id, *source)
		if err == nil {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("import %s: %w", *id, err)
		}
		fmt.Fprintf(os.Stderr, "cube-k8s: import %s: %v (retrying)\n", *id, err)
		select {
		case <-ctx.Done():
		case <-time.After(3 * time.Second):
		}
	}
	fmt.Printf("template %s imported from %s\n", *id, *source)
	if *stay {
		<-ctx.Done()
	}
	return nil
}

func importOnce(ctx context.Context, socket, id, source string) error {
	conn, err := cubeletclient.Dial(socket)
	if err != nil {
		return err
	}
	defer conn.Close()
	ictx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	stream, err := cubeletclient.New(conn).ImportTemplate(ictx, &cubeletpb.ImportTemplateRequest{TemplateId: id, Source: source})
	if err != nil {
		return err
	}
	for {
		if _, err := stream.Recv(); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return err
		}
	}
}

// config writes the file at in to out with every ${VAR} replaced by the
// environment's value escaped for a TOML basic string: the chart's
// ConfigMaps carry the daemons' configs with the pod's address, name and
// the Secrets' values (a database password may hold any character) left
// to the pod.
func config(args []string) error {
	fs := flag.NewFlagSet("config", flag.ExitOnError)
	in := fs.String("in", "", "the template")
	out := fs.String("out", "", "the config to write (0600)")
	_ = fs.Parse(args)
	b, err := os.ReadFile(*in)
	if err != nil {
		return err
	}
	var missing []string
	s := os.Expand(string(b), func(k string) string {
		v, ok := os.LookupEnv(k)
		if !ok {
			missing = append(missing, k)
		}
		return tomlEscape(v)
	})
	if len(missing) > 0 {
		return fmt.Errorf("config %s: unset variables %v", *in, missing)
	}
	if err := os.MkdirAll(filepath.Dir(*out), 0o700); err != nil {
		return err
	}
	return os.WriteFile(*out, []byte(s), 0o600)
}

func tomlEscape(s string) string {
	var sb strings.Builder
	for _, r := range s {
		switch {
		case r == '\\' || r == '"':
			sb.WriteByte('\\')
			sb.WriteRune(r)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&sb, "\\u%04X", r)
		default:
			sb.WriteRune(r)
		}
	}
	return sb.String()
}
