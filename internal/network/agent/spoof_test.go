package agent_test

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/netnsdir"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
)

// TestAntiSpoofing: a sandbox that forges its source address on a raw
// socket gets nothing out of its slot. Two controls make the probe count:
// the same packet with the sandbox's own address arrives, and with the
// slot's anti-spoofing rule deleted the forged one arrives too.
//
// The path to the world runs through the host, so the host's reverse-path
// filter must not drop the forged source itself (rp_filter 0 or 2, as on
// these machines); a strict host would make the second control fail.
func TestAntiSpoofing(t *testing.T) {
	e := nettest.Start(t, nettest.Options{})
	a := e.Agent
	w := nettest.NewWorld(t)
	sb := ensure(t, a, "sb-spoof", network.Container, policy.Policy{})
	defer func() {
		if _, err := a.Release(ctx, "sb-spoof"); err != nil {
			t.Error(err)
		}
	}()
	capture := listenUDP(t, w.NS, w.Port)
	dst := w.Addrs[0]
	forged := nettest.ForgedSource // an address the sandbox does not have, and no world's

	send := func(src netip.Addr) string {
		t.Helper()
		nonce := make([]byte, 8)
		_, _ = rand.Read(nonce)
		msg := "probe-" + hex.EncodeToString(nonce)
		if err := sendRawUDP(sb.NetNS, src, dst, w.Port, []byte(msg)); err != nil {
			t.Fatalf("raw send from %s: %v", src, err)
		}
		return msg
	}

	// Control 1: the sandbox's own address goes out (through the same raw
	// socket path), so the capture and the route work.
	if got := capture.wait(send(network.SandboxIP), 5*time.Second); !got {
		t.Fatal("control: a packet with the sandbox's own source never arrived")
	}
	// The attack: a forged source is dropped in the slot.
	if capture.wait(send(forged), blockedWait) {
		t.Fatalf("a packet forged from %s left the slot", forged)
	}
	t.Logf("forged source %s: dropped by the slot's anti-spoofing rule", forged)

	// Control 2: without that one rule, the forged packet gets out.
	if err := netnsdir.Do(sb.SlotNetNS, nettest.DeleteAntiSpoofRule); err != nil {
		t.Fatal(err)
	}
	if !capture.wait(send(forged), 5*time.Second) {
		t.Fatal("control: with the anti-spoofing rule deleted, the forged packet still never arrived (does the host's rp_filter drop it?)")
	}
	// Re-applying the policy (what resume and reconcile do) restores it.
	if _, err := a.UpdatePolicy(ctx, "sb-spoof", nil); err != nil {
		t.Fatal(err)
	}
	if err := netnsdir.Do(sb.SlotNetNS, nettest.DeleteAntiSpoofRule); err != nil {
		t.Fatalf("after re-apply: %v", err)
	}
}

type udpCapture struct{ got chan string }

// listenUDP collects the datagrams that reach port in the namespace.
func listenUDP(t *testing.T, nsPath string, port int) *udpCapture {
	t.Helper()
	var pc net.PacketConn
	if err := netnsdir.Do(nsPath, func() (err error) {
		pc, err = net.ListenPacket("udp4", ":"+strconv.Itoa(port))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	c := &udpCapture{got: make(chan string, 64)}
	done := make(chan struct{})
	t.Cleanup(func() { pc.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 2048)
		for {
			n, _, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			select {
			case c.got <- string(buf[:n]):
			default: // nobody waits for this many: drop, never block Close
			}
		}
	}()
	return c
}

// wait reports whether msg arrives within d.
func (c *udpCapture) wait(msg string, d time.Duration) bool {
	deadline := time.After(d)
	for {
		select {
		case m := <-c.got:
			if m == msg {
				return true
			}
		case <-deadline:
			return false
		}
	}
}

// sendRawUDP sends one UDP datagram with the given source address from
// inside the namespace, on a raw socket that writes its own IP header
// (what CAP_NET_RAW allows a sandbox).
func sendRawUDP(nsPath string, src, dst netip.Addr, port int, payload []byte) error {
	return netnsdir.Do(nsPath, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		pkt := make([]byte, 20+8+len(payload))
		pkt[0] = 0x45                                                // IPv4, 20-byte header
		binary.BigEndian.PutUint16(pkt[2:], uint16(len(pkt)))        // total length
		pkt[8], pkt[9] = 64, unix.IPPROTO_UDP                        // TTL, protocol
		copy(pkt[12:16], src.AsSlice())                              // the (forged) source
		copy(pkt[16:20], dst.AsSlice())                              //
		binary.BigEndian.PutUint16(pkt[20:], 40000)                  // source port
		binary.BigEndian.PutUint16(pkt[22:], uint16(port))           // destination port
		binary.BigEndian.PutUint16(pkt[24:], uint16(8+len(payload))) // UDP length; checksum 0 = none
		copy(pkt[28:], payload)
		return unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: dst.As4()})
	})
}
