package nettest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nl"
	"github.com/cubesandbox/cube/internal/nsdial"
)

// World is a namespace that plays the internet: a veth to the host, a few
// TEST-NET addresses (198.51.100.0/24) routed to it explicitly, and a TCP
// server on every one of them that greets and then echoes.
//
//	host  wXXXX 203.0.113.(4k+1)/30  <--veth-->  eth0 203.0.113.(4k+2)/30  world
//	host routes 198.51.100.(4k+1..4k+3)/32 and 172.31.255.k/32 via 203.0.113.(4k+2)
//	world lo: those /32s
type World struct {
	NS    string       // pinned namespace
	Addrs []netip.Addr // the world's "internet" addresses
	Port  int          // where every address serves
	// HostEnd is the host's address on the link to the world: a host
	// address a sandbox must not reach.
	HostEnd netip.Addr
	// Private is a world address in a private range (PrivateRange):
	// unreachable unless the agent opens the range (Options.OpenPrivate)
	// and a policy allows it.
	Private netip.Addr
	// Closed is a world address in a private range no test agent opens
	// (172.31.254.0/24): unreachable whatever the policy.
	Closed netip.Addr
	link   string
}

// PrivateRange holds every world's Private address.
const PrivateRange = "172.31.255.0/24"

// ForgedSource is a TEST-NET address no world holds (worlds take
// 198.51.100.4k+1..4k+3 for k from 1), for probes that forge a source: a
// world drops a packet whose source is one of its own addresses as
// martian, so a forged source a world holds would never arrive there,
// whatever the slot's rules.
var ForgedSource = netip.MustParseAddr("198.51.100.2")

// NewWorld makes a world with three addresses; its cleanup removes it.
func NewWorld(t testing.TB) *World {
	t.Helper()
	RequireRoot(t)
	w := &World{NS: filepath.Join(t.TempDir(), "world"), link: "w" + randHex(3), Port: 8000 + int(randInt(1000))}
	t.Cleanup(func() { w.close(t) })
	if err := netnsdir.Create(w.NS); err != nil {
		t.Fatal(err)
	}
	var err error
	for try := 0; try < 8; try++ {
		k := int(randInt(63)) + 1
		if err = w.wire(k); err == nil {
			break
		}
		_ = delLink(w.link)
	}
	if err != nil {
		t.Fatalf("world: %v", err)
	}
	ServeIn(t, w.NS, w.Port)
	return w
}

func addr4(a, b, c, d int) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(a), byte(b), byte(c), byte(d)})
}

func (w *World) wire(k int) error {
	w.HostEnd = addr4(203, 0, 113, 4*k+1)
	worldEnd := addr4(203, 0, 113, 4*k+2)
	w.Addrs = []netip.Addr{addr4(198, 51, 100, 4*k+1), addr4(198, 51, 100, 4*k+2), addr4(198, 51, 100, 4*k+3)}
	w.Private = addr4(172, 31, 255, k)
	w.Closed = addr4(172, 31, 254, k)
	// Refuse a block another test already routes.
	routes, err := nl.Dump(func() ([]netlink.Route, error) { return netlink.RouteList(nil, netlink.FAMILY_V4) })
	if err != nil {
		return err
	}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		if ones, _ := r.Dst.Mask.Size(); ones == 0 {
			continue // the default route is not a collision
		}
		for _, a := range append([]netip.Addr{w.HostEnd, w.Private, w.Closed}, w.Addrs...) {
			if r.Dst.Contains(a.AsSlice()) {
				return fmt.Errorf("%s already routed", a)
			}
		}
	}
	ns, err := netns.GetFromPath(w.NS)
	if err != nil {
		return err
	}
	defer ns.Close()
	in, err := netlink.NewHandleAt(ns)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: w.link}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(ns))}); err != nil {
		return err
	}
	host, err := netlink.LinkByName(w.link)
	if err != nil {
		return err
	}
	if err := netlink.AddrAdd(host, addr(w.HostEnd, 30)); err != nil {
		return err
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return err
	}
	eth, err := in.LinkByName("eth0")
	if err != nil {
		return err
	}
	lo, _ := in.LinkByName("lo")
	for _, step := range []error{in.AddrAdd(eth, addr(worldEnd, 30)), in.LinkSetUp(eth), in.LinkSetUp(lo)} {
		if step != nil {
			return step
		}
	}
	for _, a := range append([]netip.Addr{w.Private, w.Closed}, w.Addrs...) {
		if err := in.AddrAdd(lo, addr(a, 32)); err != nil {
			return err
		}
		gw := net.IP(worldEnd.AsSlice())
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: host.Attrs().Index, Dst: addr(a, 32).IPNet, Gw: gw}); err != nil {
			return err
		}
	}
	return in.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: net.IP(w.HostEnd.AsSlice())})
}

func addr(a netip.Addr, bits int) *netlink.Addr {
	return &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, 32)}}
}

// ServeIn starts a TCP server on port in the namespace pinned at nsPath
// ("" = the host) that greets every connection with "hello <local
// address>\n" and then echoes lines; it stops on t's cleanup.
func ServeIn(t testing.TB, nsPath string, port int) {
	t.Helper()
	var ln net.Listener
	listen := func() (err error) {
		ln, err = net.Listen("tcp4", ":"+strconv.Itoa(port))
		return err
	}
	var err error
	if nsPath == "" {
		err = listen()
	} else {
		err = netnsdir.Do(nsPath, listen)
	}
	if err != nil {
		t.Fatalf("listen in %q: %v", nsPath, err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				local := c.LocalAddr().(*net.TCPAddr).IP.String()
				if _, err := fmt.Fprintf(c, "hello %s\n", local); err != nil {
					return
				}
				_, _ = io.Copy(c, c)
			}()
		}
	}()
}

func (w *World) close(t testing.TB) {
	if err := delLink(w.link); err != nil {
		t.Errorf("world: %v", err)
	}
	if err := netnsdir.Remove(w.NS); err != nil {
		t.Errorf("world: %v", err)
	}
}

func delLink(name string) error {
	l, err := netlink.LinkByName(name)
	var nf netlink.LinkNotFoundError
	if errors.As(err, &nf) {
		return nil // nothing to delete
	}
	if err != nil {
		return err
	}
	return netlink.LinkDel(l)
}

// Greet connects from inside the namespace nsPath to addr, reads the
// greeting line and returns it. A blocked destination (dropped) is a
// timeout after `wait`.
func Greet(ctx context.Context, nsPath string, addr netip.AddrPort, wait time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	c, err := dial(ctx, nsPath, addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(wait))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("read greeting: %w", err)
	}
	return line, nil
}

// dial connects from the namespace pinned at nsPath ("" = the host).
func dial(ctx context.Context, nsPath string, addr netip.AddrPort) (net.Conn, error) {
	if nsPath == "" {
		return (&net.Dialer{}).DialContext(ctx, "tcp4", addr.String())
	}
	return nsdial.DialContext(ctx, nsPath, "tcp4", addr.String())
}

// Conn is an open connection from a namespace to the world, to check
// whether an established connection survives a policy change.
type Conn struct {
	c net.Conn
	r *bufio.Reader
}

// Open connects from nsPath and reads the greeting.
func Open(ctx context.Context, nsPath string, addr netip.AddrPort) (*Conn, error) {
	c, err := dial(ctx, nsPath, addr)
	if err != nil {
		return nil, err
	}
	cc := &Conn{c: c, r: bufio.NewReader(c)}
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := cc.r.ReadString('\n'); err != nil {
		c.Close()
		return nil, err
	}
	return cc, nil
}

// Echo sends a line and waits up to wait for it to come back.
func (c *Conn) Echo(line string, wait time.Duration) error {
	_ = c.c.SetDeadline(time.Now().Add(wait))
	if _, err := fmt.Fprintln(c.c, line); err != nil {
		return err
	}
	got, err := c.r.ReadString('\n')
	if err != nil {
		return err
	}
	if got != line+"\n" {
		return errors.New("echo mismatch: " + got)
	}
	return nil
}

// Close closes the connection.
func (c *Conn) Close() error { return c.c.Close() }

// IsTimeout reports whether err is a dial or read that got no answer
// (what a dropping firewall looks like), as opposed to a refusal.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

// Transfer sends n bytes through the echo server and reads them back,
// returning how long it took.
func (c *Conn) Transfer(n int, wait time.Duration) (time.Duration, error) {
	start := time.Now()
	_ = c.c.SetDeadline(start.Add(wait))
	errc := make(chan error, 1)
	go func() {
		buf := make([]byte, 32<<10)
		for i := range buf {
			buf[i] = 'x'
		}
		left := n
		for left > 0 {
			k, err := c.c.Write(buf[:min(left, len(buf))])
			if err != nil {
				errc <- err
				return
			}
			left -= k
		}
		errc <- nil
	}()
	if _, err := io.CopyN(io.Discard, c.r, int64(n)); err != nil {
		return 0, err
	}
	return time.Since(start), <-errc
}

// MetadataAddr is the cloud metadata address (169.254.169.254).
var MetadataAddr = netip.MustParseAddr("169.254.169.254")

// ServeMetadata puts a responder on the metadata address: the world gets
// 169.254.169.254/32 (its TCP server and anything else listening on all
// addresses answer there) and the host routes it to the world, so a test
// that a sandbox cannot reach the metadata service can fail. Only one
// world on the host can hold the route: it waits up to a minute for
// another test's to go. Its cleanup removes both.
func (w *World) ServeMetadata(t testing.TB) netip.Addr {
	t.Helper()
	ns, err := netns.GetFromPath(w.NS)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	in, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	lo, err := in.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := in.AddrAdd(lo, addr(MetadataAddr, 32)); err != nil {
		t.Fatalf("metadata address in the world: %v", err)
	}
	host, err := netlink.LinkByName(w.link)
	if err != nil {
		t.Fatal(err)
	}
	gw := w.HostEnd.Next() // the world's end of the /30
	route := &netlink.Route{LinkIndex: host.Attrs().Index, Dst: addr(MetadataAddr, 32).IPNet, Gw: net.IP(gw.AsSlice())}
	deadline := time.Now().Add(time.Minute)
	for {
		err = netlink.RouteAdd(route)
		if err == nil || !errors.Is(err, syscall.EEXIST) || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("host route to the metadata address: %v", err)
	}
	t.Cleanup(func() {
		if err := netlink.RouteDel(route); err != nil {
			t.Errorf("metadata route: %v", err)
		}
	})
	return MetadataAddr
}
