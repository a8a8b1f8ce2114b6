package nft

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// A re-apply of a slot's unchanged rule set (every resume re-applies its
// sandbox's policy) would still delete and re-add every rule, and a
// commit that deletes waits for an RCU grace period: ~10 ms per resume.
// The kernel numbers every nftables commit in a network namespace (the
// ruleset generation), so ApplySlot remembers, per namespace, the
// generation its own commit produced and what it committed. When both
// still match, nothing has committed there since (no tampering, no other
// writer) and the rule set is what the caller asks for: ApplySlot then
// commits nothing. A generation is remembered only when it is exactly one
// past the one read before ApplySlot built its batch, so a commit by
// anyone else while ApplySlot ran is never taken for its own.
//
// Namespaces are told apart by their cookie, which the kernel never
// reuses (an inode number is, once a namespace is gone).

// appliedSlot is what ApplySlot last committed in one namespace.
type appliedSlot struct {
	gen uint32
	sum [sha256.Size]byte
}

// appliedSlots maps a namespace cookie to its appliedSlot.
var appliedSlots sync.Map

// maxAppliedSlots bounds appliedSlots: slots are pooled and their
// namespaces live long, so the map holds about one entry per slot; past
// the bound (namespaces recreated over and over) it starts again empty.
const maxAppliedSlots = 1 << 16

var appliedCount struct {
	sync.Mutex
	n int
}

// slotSum identifies the rule set s describes.
func slotSum(s Slot) ([sha256.Size]byte, error) {
	b, err := json.Marshal(s)
	if err != nil {
		return [sha256.Size]byte{}, err
	}
	return sha256.Sum256(b), nil
}

// slotCurrent reports whether the namespace open at nsFD holds what
// ApplySlot last committed there for a Slot whose sum is sum, with no
// commit since; gen is the namespace's generation now. cookie is 0 when
// the namespace could not be asked.
func slotCurrent(nsFD int, sum [sha256.Size]byte) (cookie uint64, gen uint32, current bool) {
	cookie, gen, err := generation(nsFD)
	if err != nil {
		return 0, 0, false
	}
	v, ok := appliedSlots.Load(cookie)
	return cookie, gen, ok && v.(appliedSlot) == appliedSlot{gen: gen, sum: sum}
}

// rememberSlot records the generation ApplySlot's commit left, read
// right after it. The kernel adds one per commit, so it is remembered
// only when it is before+1, before being the generation read before the
// batch was built: a commit by anyone else in between (the generation
// moved further) leaves nothing remembered, and the next ApplySlot there
// commits in full. With mayBeEmpty (UpdateSlotPolicy, whose batch can be
// empty) an unchanged generation means the batch had nothing to commit
// and no one else committed: the table is still the one known before.
func rememberSlot(nsFD int, cookie uint64, before uint32, sum [sha256.Size]byte, mayBeEmpty bool) {
	if cookie == 0 {
		return
	}
	c, gen, err := generation(nsFD)
	if err != nil || c != cookie || (gen != nextGen(before) && (!mayBeEmpty || gen != before)) {
		if _, loaded := appliedSlots.LoadAndDelete(cookie); loaded {
			appliedCount.Lock()
			appliedCount.n--
			appliedCount.Unlock()
		}
		return
	}
	if _, loaded := appliedSlots.Swap(cookie, appliedSlot{gen: gen, sum: sum}); !loaded {
		appliedCount.Lock()
		appliedCount.n++
		if appliedCount.n > maxAppliedSlots {
			appliedSlots.Clear()
			appliedCount.n = 0
		}
		appliedCount.Unlock()
	}
}

// besideSlot runs commit, a commit in the namespace open at nsFD that
// changes only what ApplySlot leaves as it finds it (the resolved set's
// elements), and moves the remembered generation past it when nothing
// else committed there around it: the DNS forwarder's additions do not
// turn the next re-apply into a full one.
func besideSlot(nsFD int, commit func() error) error {
	cookie, before, err := generation(nsFD)
	if err != nil {
		return commit()
	}
	if err := commit(); err != nil {
		return err
	}
	v, ok := appliedSlots.Load(cookie)
	if !ok || v.(appliedSlot).gen != before {
		return nil
	}
	if c, after, err := generation(nsFD); err == nil && c == cookie && after == nextGen(before) {
		appliedSlots.CompareAndSwap(cookie, v, appliedSlot{gen: after, sum: v.(appliedSlot).sum})
	}
	return nil
}

// nextGen is the generation a commit after gen leaves: the kernel skips 0
// when the counter wraps.
func nextGen(gen uint32) uint32 {
	if gen++; gen == 0 {
		gen++
	}
	return gen
}

// generation returns the cookie and the nftables ruleset generation of
// the namespace open at nsFD (NFT_MSG_GETGEN).
func generation(nsFD int) (cookie uint64, gen uint32, err error) {
	cfg := &netlink.Config{}
	if nsFD >= 0 {
		cfg.NetNS = nsFD
	}
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, cfg)
	if err != nil {
		return 0, 0, fmt.Errorf("nft generation: %w", err)
	}
	defer conn.Close()
	raw, err := conn.SyscallConn()
	if err != nil {
		return 0, 0, fmt.Errorf("nft generation: %w", err)
	}
	var serr error
	if err := raw.Control(func(fd uintptr) {
		cookie, serr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	}); err != nil {
		return 0, 0, fmt.Errorf("nft generation: %w", err)
	}
	if serr != nil {
		return 0, 0, fmt.Errorf("nft generation: netns cookie: %w", serr)
	}
	msgs, err := conn.Execute(netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN),
			Flags: netlink.Request,
		},
		// nfgenmsg: family, version, resource ID.
		Data: []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return 0, 0, fmt.Errorf("nft generation: %w", err)
	}
	for _, m := range msgs {
		if len(m.Data) < 4 {
			continue
		}
		ad, err := netlink.NewAttributeDecoder(m.Data[4:])
		if err != nil {
			return 0, 0, fmt.Errorf("nft generation: %w", err)
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			if ad.Type() == unix.NFTA_GEN_ID {
				return cookie, ad.Uint32(), nil
			}
		}
		if err := ad.Err(); err != nil {
			return 0, 0, fmt.Errorf("nft generation: %w", err)
		}
	}
	return 0, 0, fmt.Errorf("nft generation: no generation in the answer")
}
