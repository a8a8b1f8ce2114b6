package agent

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// Where distributions keep their trust store: the PEM bundle that
// OpenSSL, curl, Go, git and most runtimes read, per family.
var trustBundles = []string{
	"etc/ssl/certs/ca-certificates.crt",                // Debian, Ubuntu, Alpine, Arch
	"etc/pki/tls/certs/ca-bundle.crt",                  // Fedora, RHEL, CentOS
	"etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", // RHEL's extracted bundle
	"etc/ssl/ca-bundle.pem",                            // openSUSE
	"etc/ssl/cert.pem",                                 // Alpine's LibreSSL, macOS-style
}

// EgressCAFile is where the CA lands on its own (update-ca-certificates'
// input directory on Debian-like images, so a later run keeps it), and
// what NODE_EXTRA_CA_CERTS names.
const EgressCAFile = "usr/local/share/ca-certificates/cube-egress.crt"

// DefaultTrustBundle is the bundle made when an image has none.
const DefaultTrustBundle = "etc/ssl/certs/ca-certificates.crt"

// InstallCA adds a CA certificate (DER) to the trust store of the
// filesystem at root: appended to every bundle the image has (once:
// a clone or restore that starts again finds it there), or written as
// DefaultTrustBundle when it has none, and as EgressCAFile. It returns the
// bundle to name in SSL_CERT_FILE and similar variables.
func InstallCA(root string, der []byte) (bundle string, err error) {
	if _, err := x509.ParseCertificate(der); err != nil {
		return "", fmt.Errorf("egress CA: %w", err)
	}
	block := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	entry := append([]byte("\n# cube egress CA\n"), block...)
	var errs []error
	for _, b := range trustBundles {
		p := filepath.Join(root, b)
		fi, err := os.Lstat(p)
		if err != nil {
			continue
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			// Another name of a bundle in the list (ssl/cert.pem →
			// certs/ca-certificates.crt): appended through its target.
			continue
		}
		cur, err := os.ReadFile(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if bundle == "" {
			bundle = "/" + b
		}
		if bytes.Contains(cur, block) {
			continue
		}
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
		if err == nil {
			_, err = f.Write(entry)
			err = errors.Join(err, f.Close())
		}
		errs = append(errs, err)
	}
	if bundle == "" {
		p := filepath.Join(root, DefaultTrustBundle)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(p, entry, 0o644); err != nil {
			return "", err
		}
		bundle = "/" + DefaultTrustBundle
	}
	p := filepath.Join(root, EgressCAFile)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
		errs = append(errs, os.WriteFile(p, block, 0o644))
	} else {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return bundle, fmt.Errorf("egress CA: %w", err)
	}
	return bundle, nil
}

// TrustEnv are the variables that point runtimes with their own CA lists
// (Python's certifi through requests and httpx, Node) at the system
// bundle holding the egress CA; set in the sandbox's environment where
// the image has not set them.
func TrustEnv(bundle string) map[string]string {
	return map[string]string{
		"SSL_CERT_FILE":       bundle,
		"REQUESTS_CA_BUNDLE":  bundle,
		"NODE_EXTRA_CA_CERTS": "/" + EgressCAFile,
	}
}
