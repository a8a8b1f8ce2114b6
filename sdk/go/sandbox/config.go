package sandbox

import (
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// DefaultDomain is E2B's domain, used when neither Config.Domain nor
// E2B_DOMAIN names one.
const DefaultDomain = "e2b.app"

// EnvdPort is the port the sandbox agent (envd) listens on.
const EnvdPort = 49983

// DefaultRequestTimeout bounds each API and agent call (not streams) when
// Config.RequestTimeout is zero, as E2B's SDKs do.
const DefaultRequestTimeout = 60 * time.Second

// Config says where the service is and how to authenticate. The zero value
// takes everything from the environment.
type Config struct {
	// APIKey is sent in X-API-Key; default E2B_API_KEY.
	APIKey string
	// Domain is the service's domain; default E2B_DOMAIN, else
	// DefaultDomain. The API is https://api.<domain> and a sandbox's port
	// https://<port>-<sandboxID>.<domain> unless the URLs below are set.
	Domain string
	// APIURL is the E2B API's base URL; default E2B_API_URL, else
	// https://api.<domain>.
	APIURL string
	// SandboxURL is one URL that reaches every sandbox's ports, naming the
	// sandbox and port in the E2b-Sandbox-Id and E2b-Sandbox-Port headers
	// (CubeSandbox's cubeproxy serves both forms); default E2B_SANDBOX_URL,
	// else per-sandbox hosts under the domain.
	SandboxURL string
	// Debug talks to a local agent at http://localhost:49983 and an API at
	// http://localhost:3000, as E2B_DEBUG does; default E2B_DEBUG=true.
	Debug bool
	// RequestTimeout bounds each unary call when the context has no
	// earlier deadline; default DefaultRequestTimeout. Negative: none.
	RequestTimeout time.Duration
	// HTTPClient makes every request; default a client with
	// http.DefaultTransport's settings. Its Timeout must be zero for
	// streams (commands, watches) to outlive it.
	HTTPClient *http.Client
	// Headers are added to every API request.
	Headers http.Header
}

// resolved fills the defaults from the environment.
func (c Config) resolved() (Config, error) {
	env := func(v *string, name string) {
		if *v == "" {
			*v = os.Getenv(name)
		}
	}
	env(&c.APIKey, "E2B_API_KEY")
	env(&c.Domain, "E2B_DOMAIN")
	env(&c.APIURL, "E2B_API_URL")
	env(&c.SandboxURL, "E2B_SANDBOX_URL")
	if !c.Debug {
		c.Debug = strings.EqualFold(os.Getenv("E2B_DEBUG"), "true")
	}
	if c.Domain == "" {
		c.Domain = DefaultDomain
	}
	if c.APIURL == "" {
		c.APIURL = "https://api." + c.Domain
		if c.Debug {
			c.APIURL = "http://localhost:3000"
		}
	}
	c.APIURL = strings.TrimRight(c.APIURL, "/")
	c.SandboxURL = strings.TrimRight(c.SandboxURL, "/")
	if c.RequestTimeout == 0 {
		c.RequestTimeout = DefaultRequestTimeout
	}
	if c.HTTPClient == nil {
		c.HTTPClient = &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	}
	if c.APIKey == "" && !c.Debug {
		return c, fmt.Errorf("sandbox: no API key (set Config.APIKey or E2B_API_KEY): %w", ErrAuth)
	}
	return c, nil
}

// sandboxBase is the base URL of port on a sandbox, and whether requests
// must name the sandbox in headers (one URL for all sandboxes).
func (c *Config) sandboxBase(id, domain string, port int) (base string, headers bool) {
	switch {
	case c.Debug:
		return "http://localhost:" + strconv.Itoa(port), false
	case c.SandboxURL != "":
		return c.SandboxURL, true
	}
	if domain == "" {
		domain = c.Domain
	}
	return "https://" + strconv.Itoa(port) + "-" + id + "." + domain, false
}
