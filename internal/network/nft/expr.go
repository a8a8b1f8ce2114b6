package nft

import (
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Small builders for the expressions the rule sets use, named after the
// nft syntax they produce so that a rule reads like its `nft list` line.

const ipsDstNAT = 1 << 5 // IPS_DST_NAT: the connection was DNATed

// ifname is an exact interface-name match: nft compares the whole
// IFNAMSIZ buffer, so the name is NUL padded.
func ifname(name string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return b
}

func iifname(op expr.CmpOp, name []byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: name},
	}
}

func oifname(op expr.CmpOp, name []byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: name},
	}
}

// prefixMatch is a wildcard interface name ("cube-*"): comparing only the
// prefix's bytes is how nft implements the trailing '*'.
func prefixMatch(prefix string) []byte { return []byte(prefix) }

func ipAddr(offset uint32, op expr.CmpOp, a netip.Addr) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Cmp{Op: op, Register: 1, Data: a.AsSlice()},
	}
}

func saddr(a netip.Addr) []expr.Any { return ipAddr(12, expr.CmpOpEq, a) }
func daddr(a netip.Addr) []expr.Any { return ipAddr(16, expr.CmpOpEq, a) }

// saddrNot matches any other source (ip saddr != a).
func saddrNot(a netip.Addr) []expr.Any { return ipAddr(12, expr.CmpOpNeq, a) }

// saddrIn matches a source prefix (ip saddr 10.200.0.0/16).
func saddrIn(p netip.Prefix) []expr.Any {
	m := make([]byte, 4)
	for i := 0; i < p.Bits(); i++ {
		m[i/8] |= 0x80 >> (i % 8)
	}
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: m, Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Masked().Addr().AsSlice()},
	}
}

// daddrInSet matches `ip daddr @set`.
func daddrInSet(s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID},
	}
}

// daddrNotInSet matches a destination outside set s (ip daddr != @s).
func daddrNotInSet(s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID, Invert: true},
	}
}

// ctBits matches `ct <key> <bits>` (any of bits set).
func ctBits(key expr.CtKey, bits uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: key},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(bits), Xor: binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
}

func ctState(bits uint32) []expr.Any { return ctBits(expr.CtKeySTATE, bits) }
func ctStatusDNAT() []expr.Any       { return ctBits(expr.CtKeySTATUS, ipsDstNAT) }

func accept() expr.Any { return &expr.Verdict{Kind: expr.VerdictAccept} }
func drop() expr.Any   { return &expr.Verdict{Kind: expr.VerdictDrop} }
func jump(chain string) expr.Any {
	return &expr.Verdict{Kind: expr.VerdictJump, Chain: chain}
}

func rule(parts ...any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		switch v := p.(type) {
		case expr.Any:
			out = append(out, v)
		case []expr.Any:
			out = append(out, v...)
		}
	}
	return out
}

// intervalElements turns sorted, non-overlapping prefixes into the
// start/end element pairs of an interval set. A range that reaches
// 255.255.255.255 has no end element: the interval runs to the top.
func intervalElements(ps []netip.Prefix) []nftables.SetElement {
	var out []nftables.SetElement
	for _, p := range ps {
		out = append(out, nftables.SetElement{Key: p.Addr().AsSlice()})
		last := lastAddr(p)
		if next := last.Next(); next.IsValid() {
			out = append(out, nftables.SetElement{Key: next.AsSlice(), IntervalEnd: true})
		}
	}
	return out
}

func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	host := 32 - p.Bits()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	if host > 0 {
		v |= (1 << host) - 1
	}
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// l4proto matches the transport protocol (meta l4proto).
func l4proto(proto byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

// dport matches the transport header's destination port (th dport).
func dport(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
	}
}

// dportInSet matches `th dport @set`.
func dportInSet(s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID},
	}
}
