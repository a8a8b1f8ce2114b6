// Package ipam hands out slot numbers and derives each slot's addresses
// from the node CIDR: slot i owns the i-th /30 of the CIDR, whose first
// usable address is the host's end of the slot's veth pair and whose
// second is the slot's host-facing address (the one the host dials to
// reach the sandbox).
//
//	node CIDR 10.200.0.0/16, slot 3:  block 10.200.0.12/30
//	  gateway (host end)   10.200.0.13
//	  host IP (slot end)   10.200.0.14
//
// Allocation is next-fit, so a released slot's addresses are the last to
// be handed out again (stale conntrack or ARP entries of the old slot
// have long expired by then).
package ipam

import (
	"fmt"
	"net/netip"
	"sync"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// BlockBits is the prefix length of one slot's block.
const BlockBits = 30

// Addrs are one slot's addresses.
type Addrs struct {
	Block   netip.Prefix // the slot's /30
	Gateway netip.Addr   // host end of the veth pair
	HostIP  netip.Addr   // slot end: what the host dials
}

// Space is a node CIDR cut into slot blocks. Safe for concurrent use.
type Space struct {
	cidr netip.Prefix
	size int

	mu   sync.Mutex
	used []bool
	n    int // slots in use
	next int // where the next search starts
}

// New returns the slot space of cidr (IPv4, masked, /30 or larger).
func New(cidr netip.Prefix) (*Space, error) {
	if !cidr.IsValid() || !cidr.Addr().Is4() || cidr.Masked() != cidr {
		return nil, fmt.Errorf("ipam: %s is not a masked IPv4 CIDR: %w", cidr, errdefs.ErrInvalidArgument)
	}
	if cidr.Bits() > BlockBits {
		return nil, fmt.Errorf("ipam: %s is smaller than one /%d slot block: %w", cidr, BlockBits, errdefs.ErrInvalidArgument)
	}
	if cidr.Bits() < 8 {
		return nil, fmt.Errorf("ipam: %s is larger than a /8: %w", cidr, errdefs.ErrInvalidArgument)
	}
	size := 1 << (BlockBits - cidr.Bits())
	return &Space{cidr: cidr, size: size, used: make([]bool, size)}, nil
}

// CIDR returns the node CIDR.
func (s *Space) CIDR() netip.Prefix { return s.cidr }

// Size is the number of slots the CIDR holds.
func (s *Space) Size() int { return s.size }

// Addrs returns slot i's addresses.
func (s *Space) Addrs(i int) (Addrs, error) {
	if i < 0 || i >= s.size {
		return Addrs{}, fmt.Errorf("ipam: slot %d outside %s (%d slots): %w", i, s.cidr, s.size, errdefs.ErrInvalidArgument)
	}
	base := s.cidr.Addr().As4()
	v := uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])
	v += uint32(i) << (32 - BlockBits)
	at := func(off uint32) netip.Addr {
		x := v + off
		return netip.AddrFrom4([4]byte{byte(x >> 24), byte(x >> 16), byte(x >> 8), byte(x)})
	}
	return Addrs{Block: netip.PrefixFrom(at(0), BlockBits), Gateway: at(1), HostIP: at(2)}, nil
}

// Allocate takes the next free slot. A full space is
// errdefs.ErrResourceExhausted.
func (s *Space) Allocate() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k := 0; k < s.size; k++ {
		i := (s.next + k) % s.size
		if !s.used[i] {
			s.used[i] = true
			s.n++
			s.next = (i + 1) % s.size
			return i, nil
		}
	}
	return 0, fmt.Errorf("ipam: all %d slots of %s are in use: %w", s.size, s.cidr, errdefs.ErrResourceExhausted)
}

// Reserve marks slot i used (restart: slots found in the store). Reserving
// a used slot is errdefs.ErrAlreadyExists.
func (s *Space) Reserve(i int) error {
	if i < 0 || i >= s.size {
		return fmt.Errorf("ipam: slot %d outside %s: %w", i, s.cidr, errdefs.ErrInvalidArgument)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used[i] {
		return fmt.Errorf("ipam: slot %d: %w", i, errdefs.ErrAlreadyExists)
	}
	s.used[i] = true
	s.n++
	if i >= s.next {
		s.next = (i + 1) % s.size
	}
	return nil
}

// Free returns slot i; freeing a free slot is harmless.
func (s *Space) Free(i int) {
	if i < 0 || i >= s.size {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.used[i] {
		s.used[i] = false
		s.n--
	}
}

// InUse returns the number of allocated slots.
func (s *Space) InUse() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}
