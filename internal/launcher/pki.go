package launcher

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	toml "github.com/pelletier/go-toml/v2"

	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// pkiDir holds the cluster CA (made on the first start, kept) and the
// certificates issued from it at every start.
func (cfg *Config) pkiDir() string { return filepath.Join(cfg.StateDir, "pki") }

// loopbackHosts are the names a certificate of a component of `cube up`
// must carry: its listeners are on this machine.
var loopbackHosts = []string{"127.0.0.1", "::1", "localhost"}

// certificates makes the CA on the first start and issues, from it, the
// master's, the node's (its common name the node ID) and an operator's
// (role admin: cubecli --tls-*, curl --cert) certificates. They are issued
// afresh at every start, so a restart rotates them; the CA stays.
func (cfg *Config) certificates(nodeID string) (master, node serve.TLSFiles, err error) {
	ca, err := pki.LoadOrCreateCA(cfg.pkiDir(), "cube up cluster CA")
	if err != nil {
		return master, node, fmt.Errorf("cluster CA: %w", err)
	}
	if master, err = ca.Issue(cfg.pkiDir(), "master", "cubemaster", pki.RoleMaster, loopbackHosts...); err != nil {
		return master, node, err
	}
	hosts := loopbackHosts
	if h, err := os.Hostname(); err == nil {
		hosts = append(append([]string(nil), hosts...), h)
	}
	if node, err = ca.Issue(cfg.pkiDir(), "node", nodeID, pki.RoleNode, hosts...); err != nil {
		return master, node, err
	}
	if _, err = ca.Issue(cfg.pkiDir(), "admin", "admin", pki.RoleAdmin); err != nil {
		return master, node, err
	}
	return master, node, nil
}

// withTLS adds a [tls] table naming f to a generated config, unless the
// operator's extra config brought one.
func withTLS(config string, f serve.TLSFiles) (string, error) {
	var m map[string]any
	if err := toml.Unmarshal([]byte(config), &m); err != nil {
		return "", err
	}
	if _, ok := m["tls"]; ok {
		return config, nil
	}
	if !strings.HasSuffix(config, "\n") {
		config += "\n"
	}
	return config + "[tls]\ncert = " + strconv.Quote(f.Cert) + "\nkey = " + strconv.Quote(f.Key) + "\nca = " + strconv.Quote(f.CA) + "\n", nil
}

// nodeID is the node ID a generated cubelet config gives: node.id, else
// the host name (cubelet's default).
func nodeID(cubeletTOML string) (string, error) {
	var c struct {
		Node struct {
			ID string `toml:"id"`
		} `toml:"node"`
	}
	if err := toml.Unmarshal([]byte(cubeletTOML), &c); err != nil {
		return "", err
	}
	if c.Node.ID != "" {
		return c.Node.ID, nil
	}
	return os.Hostname()
}

// systemRoots are where distributions keep the system's trusted roots as
// one PEM file (Debian and derivatives first).
var systemRoots = []string{"/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"}

func (cfg *Config) caBundle() string { return filepath.Join(cfg.pkiDir(), "ca-bundle.pem") }

// domainHost is the domain without its port (cube.localhost:8081 ->
// cube.localhost): what certificates name.
func domainHost(domain string) string {
	if h, _, err := net.SplitHostPort(domain); err == nil {
		return h
	}
	return domain
}

// routeCADir holds the route CA of domain mode, one per domain (its
// name constraints name the domain).
func (cfg *Config) routeCADir() string {
	return filepath.Join(cfg.pkiDir(), "route-ca", domainHost(cfg.domain()))
}

// routeCACert is the route CA's certificate: what clients trust.
func (cfg *Config) routeCACert() string { return filepath.Join(cfg.routeCADir(), pki.CACertFile) }

// routeCertificate returns the route's certificate in domain mode: the
// operator's files, else one issued for <domain>, *.<domain> and loopback
// (role route, server authentication only) from a route CA of its own —
// not the cluster CA, which signs the components' mTLS identities: the
// route CA is name-constrained to the domain and loopback, so a shell
// that trusts it to reach the route trusts nothing else. With it comes
// the trust bundle clients point SSL_CERT_FILE at: the system's roots and
// the route CA.
func (cfg *Config) routeCertificate() (serve.TLSFiles, error) {
	if cfg.TLSCert != "" || cfg.TLSKey != "" {
		if cfg.TLSCert == "" || cfg.TLSKey == "" {
			return serve.TLSFiles{}, fmt.Errorf("domain mode: --tls-cert and --tls-key go together")
		}
		return serve.TLSFiles{Cert: cfg.TLSCert, Key: cfg.TLSKey}, nil
	}
	host := domainHost(cfg.domain())
	ca, err := pki.LoadOrCreateRouteCA(cfg.routeCADir(), "cube up route CA for "+host, host)
	if err != nil {
		return serve.TLSFiles{}, fmt.Errorf("route CA: %w", err)
	}
	f, err := ca.Issue(cfg.routeCADir(), "route", host, pki.RoleRoute, append([]string{host, "*." + host}, loopbackHosts...)...)
	if err != nil {
		return serve.TLSFiles{}, fmt.Errorf("domain mode certificate: %w", err)
	}
	bundle := []byte{}
	for _, p := range systemRoots {
		if b, err := os.ReadFile(p); err == nil {
			bundle = append(bundle, b...)
			if len(b) > 0 && b[len(b)-1] != '\n' {
				bundle = append(bundle, '\n')
			}
			break
		}
	}
	bundle = append(bundle, ca.CertPEM...)
	if err := os.WriteFile(cfg.caBundle(), bundle, 0o644); err != nil {
		return serve.TLSFiles{}, err
	}
	return f, nil
}
