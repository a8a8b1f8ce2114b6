package nettest

import (
	"bytes"
	"errors"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"

	"github.com/cubesandbox/cube/internal/network"
	"github.com/cubesandbox/cube/internal/network/nft"
)

// DeleteAntiSpoofRule removes, in the current network namespace (a
// slot's: run it through netnsdir.Do), the slot forward rule that drops
// packets whose source is not the sandbox's; an error if there is none.
// Tests use it as the control of the anti-spoofing rule.
func DeleteAntiSpoofRule() error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: nft.SlotTable}
	rules, err := c.GetRules(t, &nftables.Chain{Name: "forward", Table: t})
	if err != nil {
		return err
	}
	sbIP := network.SandboxIP.AsSlice()
	for _, r := range rules {
		for _, e := range r.Exprs {
			if cmp, ok := e.(*expr.Cmp); ok && cmp.Op == expr.CmpOpNeq && bytes.Equal(cmp.Data, sbIP) {
				if err := c.DelRule(r); err != nil {
					return err
				}
				return c.Flush()
			}
		}
	}
	return errors.New("no anti-spoofing rule in the slot's forward chain")
}
