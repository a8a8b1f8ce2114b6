package launcher

import (
	"fmt"
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
