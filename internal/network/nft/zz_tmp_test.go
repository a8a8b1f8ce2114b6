package nft

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/cubesandbox/cube/internal/network/policy"
)

func TestTmpTiming(t *testing.T) {
	_, fd := nsFixture(t)
	ApplySlot(fd, testSlot(policy.Policy{}))
	tb := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: SlotTable}
	ch := &nftables.Chain{Name: "egress", Table: tb}
	fwd := &nftables.Chain{Name: "forward", Table: tb}
	st := &nftables.Set{Table: tb, Name: "allow", KeyType: nftables.TypeIPAddr, Interval: true}
	for _, tc := range []struct {
		name string
		fn   func(c *nftables.Conn)
	}{
		{"noop-addtable", func(c *nftables.Conn) { c.AddTable(tb) }},
		{"flush-egress", func(c *nftables.Conn) { c.FlushChain(ch) }},
		{"add-rule", func(c *nftables.Conn) { c.AddRule(&nftables.Rule{Table: tb, Chain: ch, Exprs: []expr.Any{accept()}}) }},
		{"flush-forward", func(c *nftables.Conn) { c.FlushChain(fwd) }},
		{"flush-set", func(c *nftables.Conn) { c.FlushSet(st) }},
		{"shape", func(c *nftables.Conn) { sameShape(c, tb) }},
	} {
		for i := 0; i < 3; i++ {
			t0 := time.Now()
			c, _ := nftables.New(nftables.WithNetNSFd(fd))
			tc.fn(c)
			err := c.Flush()
			fmt.Println(tc.name, time.Since(t0), err)
		}
	}
}
