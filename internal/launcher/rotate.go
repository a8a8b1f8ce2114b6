package launcher

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/pki"
)

// PKI steps of `cube pki`: they change the files in <state>/pki under a
// running (or stopped) `cube up`. Its daemons re-read their certificates
// and the CA bundle when the files change, so none restarts and no call
// fails (internal/serve, reload.go).
const (
	PKIStatus    = "status"     // the bundle's CAs and who signed each certificate
	PKIReissue   = "reissue"    // new master, node and admin certificates from the signing CA
	PKICABegin   = "ca-begin"   // a next CA, trusted alongside the current one
	PKICAPromote = "ca-promote" // the next CA signs; certificates reissued
	PKICAFinish  = "ca-finish"  // the old CA leaves the bundle
)

// leafFiles are the certificates `cube up` issues into its pki directory.
var leafFiles = []string{"master.crt", "node.crt", "admin.crt"}

// PKI runs one step on cfg's state directory and writes what it did to w.
func PKI(cfg Config, step string, w io.Writer) error {
	dir := cfg.pkiDir()
	if _, err := pki.LoadCA(dir); err != nil {
		return fmt.Errorf("%w (cube up makes the CA on its first start)", err)
	}
	switch step {
	case PKIStatus:
	case PKIReissue:
		if err := cfg.reissue(); err != nil {
			return err
		}
	case PKICABegin:
		c, err := pki.BeginRotation(dir, "cube up cluster CA")
		if err != nil {
			return err
		}
		fmt.Fprintf(w, "next CA %q (%s) added to the bundle; the current CA still signs\n", c.Subject.CommonName, fingerprint(c))
	case PKICAPromote:
		if _, err := pki.PromoteRotation(dir); err != nil {
			return err
		}
		if err := cfg.reissue(); err != nil {
			return err
		}
		fmt.Fprintln(w, "the next CA signs now; certificates reissued; the old CA stays in the bundle until ca-finish")
	case PKICAFinish:
		paths := make([]string, len(leafFiles))
		for i, f := range leafFiles {
			paths[i] = filepath.Join(dir, f)
		}
		if err := pki.FinishRotation(dir, paths...); err != nil {
			return err
		}
		fmt.Fprintln(w, "the bundle holds only the signing CA: certificates of the old CA are refused from now on")
	default:
		return fmt.Errorf("cube pki %q: want %s, %s, %s, %s or %s: %w", step, PKIStatus, PKIReissue, PKICABegin, PKICAPromote, PKICAFinish, errdefs.ErrInvalidArgument)
	}
	return printPKI(dir, w)
}

// reissue issues the certificates `cube up` issues at its start, for the
// node ID of the cubelet config it generated.
func (cfg *Config) reissue() error {
	ct, err := os.ReadFile(filepath.Join(cfg.launcherDir(), "cubelet.toml"))
	if err != nil {
		return fmt.Errorf("the generated cubelet config (has cube up run?): %w", err)
	}
	id, err := nodeID(string(ct))
	if err != nil {
		return err
	}
	_, _, err = cfg.certificates(id)
	return err
}

func fingerprint(c *x509.Certificate) string {
	sum := sha256.Sum256(c.Raw)
	return "sha256:" + hex.EncodeToString(sum[:8])
}

// printPKI lists the bundle's CAs, a rotation under way, and which CA
// signed each certificate of the directory.
func printPKI(dir string, w io.Writer) error {
	bundle, err := pki.Bundle(dir)
	if err != nil {
		return err
	}
	for i, c := range bundle {
		what := "trusted"
		if i == 0 {
			what = "trusted, signs"
		}
		fmt.Fprintf(w, "CA    %-40q %s  until %s  %s\n", c.Subject.CommonName, fingerprint(c), c.NotAfter.UTC().Format("2006-01-02"), what)
	}
	if _, err := os.Stat(filepath.Join(dir, pki.NextCACertFile)); err == nil {
		fmt.Fprintf(w, "rotation under way: %s is trusted but does not sign yet (next: cube pki ca-promote)\n", pki.NextCACertFile)
	} else if len(bundle) > 1 {
		fmt.Fprintln(w, "rotation under way: the old CA is still trusted (next: cube pki ca-finish)")
	}
	for _, f := range leafFiles {
		data, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			continue
		}
		certs, err := pki.ParseCertificates(data)
		if err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		leaf := certs[0]
		signer := "no CA of the bundle"
		for _, c := range bundle {
			if leaf.CheckSignatureFrom(c) == nil {
				signer = fingerprint(c)
				break
			}
		}
		fmt.Fprintf(w, "cert  %-40s %s  until %s  signed by %s\n", f+" ("+leaf.Subject.CommonName+")", fingerprint(leaf), leaf.NotAfter.UTC().Format("2006-01-02"), signer)
	}
	return nil
}
