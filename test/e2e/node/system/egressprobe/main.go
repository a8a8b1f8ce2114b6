// Command egressprobe is the egress spec's client inside a sandbox
// (test/e2e/node/egress.test.mjs uploads it through the SDK): a static
// binary, so it runs alike in every runtime and on images without curl,
// and it can forge what the spec needs (a TLS server name that is not the
// host, a connection to another address, curl's --resolve).
//
//	egressprobe dns [-server IP:PORT] NAME
//	egressprobe dnsburst [-n N] NAME
//	egressprobe get [-connect IP:PORT] [-sni NAME] [-ca FILE] [-insecure] URL
//	egressprobe hold [-ca FILE] [-every D] [-for D] URL
//
// Every subcommand prints one JSON object per line. dns asks the first
// nameserver of /etc/resolv.conf itself (the rcode matters: REFUSED is
// the forwarder's refusal), or -server. dnsburst sends N queries to that
// nameserver, a millisecond apart, and counts the answers that came by two
// seconds after the last (the forwarder's per-sandbox rate limit drops
// the rest). get exits 1 when the request failed. hold
// sends a request every -every on one TLS connection and exits 3 at the
// first failure (a connection the egress proxy cut).
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/miekg/dns"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: egressprobe dns|get|hold ...")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "dns":
		os.Exit(lookup(os.Args[2:]))
	case "dnsburst":
		os.Exit(burst(os.Args[2:]))
	case "get":
		os.Exit(get(os.Args[2:]))
	case "hold":
		os.Exit(hold(os.Args[2:]))
	}
	fmt.Fprintln(os.Stderr, "egressprobe: unknown subcommand", os.Args[1])
	os.Exit(2)
}

func emit(v map[string]any) {
	b, _ := json.Marshal(v)
	fmt.Println(string(b))
}

// resolver is the first nameserver of /etc/resolv.conf.
func resolver() (string, error) {
	conf, err := dns.ClientConfigFromFile("/etc/resolv.conf")
	if err != nil {
		return "", fmt.Errorf("resolv.conf: %w", err)
	}
	if len(conf.Servers) == 0 {
		return "", errors.New("resolv.conf names no nameserver")
	}
	return net.JoinHostPort(conf.Servers[0], conf.Port), nil
}

func lookup(args []string) int {
	fs := flag.NewFlagSet("dns", flag.ExitOnError)
	server := fs.String("server", "", "ask this IP:PORT (default: resolv.conf's first nameserver)")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: egressprobe dns [-server IP:PORT] NAME")
		return 2
	}
	if *server == "" {
		var err error
		if *server, err = resolver(); err != nil {
			emit(map[string]any{"err": err.Error()})
			return 1
		}
	}
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(fs.Arg(0)), dns.TypeA)
	c := &dns.Client{Timeout: 3 * time.Second}
	r, _, err := c.Exchange(m, *server)
	if err != nil {
		emit(map[string]any{"server": *server, "err": err.Error()})
		return 1
	}
	addrs := []string{}
	for _, rr := range r.Answer {
		if a, ok := rr.(*dns.A); ok {
			addrs = append(addrs, a.A.String())
		}
	}
	emit(map[string]any{"server": *server, "rcode": dns.RcodeToString[r.Rcode], "addrs": addrs})
	return 0
}

func burst(args []string) int {
	fs := flag.NewFlagSet("dnsburst", flag.ExitOnError)
	n := fs.Int("n", 400, "queries")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: egressprobe dnsburst [-n N] NAME")
		return 2
	}
	server, err := resolver()
	if err != nil {
		emit(map[string]any{"err": err.Error()})
		return 1
	}
	c, err := net.Dial("udp", server)
	if err != nil {
		emit(map[string]any{"err": err.Error()})
		return 1
	}
	defer c.Close()
	// Answers are read while the queries go out, a millisecond apart, so
	// that no socket buffer on the way (gVisor's netstack has small ones)
	// drops what the forwarder's limit would let through.
	answered := map[uint16]bool{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 4096)
		for {
			k, err := c.Read(buf)
			if err != nil {
				return
			}
			var r dns.Msg
			if r.Unpack(buf[:k]) == nil {
				answered[r.Id] = true
			}
		}
	}()
	start := time.Now()
	for i := range *n {
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn(fs.Arg(0)), dns.TypeA)
		m.Id = uint16(i)
		b, _ := m.Pack()
		if _, err := c.Write(b); err != nil {
			emit(map[string]any{"err": err.Error()})
			return 1
		}
		time.Sleep(time.Millisecond)
	}
	sending := time.Since(start)
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	<-done
	emit(map[string]any{"sent": *n, "answered": len(answered), "sendingMs": sending.Milliseconds()})
	return 0
}

// tlsConfig trusts caFile's certificates, or the system's roots (which
// honour SSL_CERT_FILE: what cube-agent points at the bundle holding the
// node's egress CA).
func tlsConfig(caFile, sni string, insecure bool) (*tls.Config, error) {
	// -insecure is for the IP-literal row only.
	cfg := &tls.Config{ServerName: sni, InsecureSkipVerify: insecure}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, err
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, errors.New("no certificate in " + caFile)
		}
	}
	return cfg, nil
}

func get(args []string) int {
	fs := flag.NewFlagSet("get", flag.ExitOnError)
	connect := fs.String("connect", "", "dial this IP:PORT instead of the URL's host (curl --resolve)")
	sni := fs.String("sni", "", "TLS server name (default: the URL's host)")
	caFile := fs.String("ca", "", "trust only these CAs (default: the system's)")
	insecure := fs.Bool("insecure", false, "skip certificate verification")
	timeout := fs.Duration("timeout", 5*time.Second, "")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: egressprobe get [flags] URL")
		return 2
	}
	u, err := url.Parse(fs.Arg(0))
	if err != nil {
		emit(map[string]any{"ok": false, "err": err.Error()})
		return 2
	}
	name := *sni
	if name == "" {
		name = u.Hostname()
	}
	tc, err := tlsConfig(*caFile, name, *insecure)
	if err != nil {
		emit(map[string]any{"ok": false, "err": err.Error()})
		return 2
	}
	d := &net.Dialer{Timeout: *timeout}
	tr := &http.Transport{TLSClientConfig: tc, DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if *connect != "" {
				addr = *connect
			}
			return d.DialContext(ctx, network, addr)
		}}
	client := &http.Client{Transport: tr, Timeout: *timeout}
	resp, err := client.Get(u.String())
	if err != nil {
		emit(map[string]any{"ok": false, "err": err.Error()})
		return 1
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	emit(map[string]any{"ok": true, "status": resp.StatusCode, "body": strings.TrimSpace(string(body))})
	return 0
}

func hold(args []string) int {
	fs := flag.NewFlagSet("hold", flag.ExitOnError)
	caFile := fs.String("ca", "", "trust only these CAs")
	every := fs.Duration("every", 300*time.Millisecond, "")
	total := fs.Duration("for", time.Minute, "")
	_ = fs.Parse(args)
	if fs.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: egressprobe hold [flags] https://NAME/")
		return 2
	}
	u, err := url.Parse(fs.Arg(0))
	if err != nil {
		return 2
	}
	tc, err := tlsConfig(*caFile, u.Hostname(), false)
	if err != nil {
		emit(map[string]any{"ok": false, "err": err.Error()})
		return 2
	}
	port := u.Port()
	if port == "" {
		port = "443"
	}
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", net.JoinHostPort(u.Hostname(), port), tc)
	if err != nil {
		emit(map[string]any{"ok": false, "err": err.Error()})
		return 1
	}
	defer c.Close()
	r := bufio.NewReader(c)
	end := time.Now().Add(*total)
	for i := 1; time.Now().Before(end); i++ {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, err := fmt.Fprintf(c, "GET /hold/%d HTTP/1.1\r\nHost: %s\r\n\r\n", i, u.Hostname())
		var resp *http.Response
		if err == nil {
			resp, err = http.ReadResponse(r, nil)
		}
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		if err != nil {
			emit(map[string]any{"ok": false, "n": i, "err": err.Error()})
			return 3
		}
		emit(map[string]any{"ok": true, "n": i, "status": resp.StatusCode})
		time.Sleep(*every)
	}
	return 0
}
