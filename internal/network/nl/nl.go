// Package nl holds what every user of github.com/vishvananda/netlink in
// this project needs around dumps.
package nl

import (
	"errors"

	"github.com/vishvananda/netlink"
)

// Dump runs a netlink dump (LinkList, AddrList, RouteList, ...) until it
// is consistent. The kernel flags a dump that raced with a change
// (NLM_F_DUMP_INTR) and netlink returns ErrDumpInterrupted with partial
// results: on a node creating and deleting slots concurrently that is
// routine, so the dump is simply repeated.
func Dump[T any](fn func() (T, error)) (T, error) {
	var v T
	var err error
	for range 20 {
		if v, err = fn(); !errors.Is(err, netlink.ErrDumpInterrupted) {
			return v, err
		}
	}
	return v, err
}
