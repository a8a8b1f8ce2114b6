// Command base-image builds (or finds in its cache) the OCI image layout of
// the default `base` template: Debian bookworm minbase + python3, bash,
// coreutils, curl, ca-certificates, procps, users root and user (1000),
// bootstrapped with debootstrap from the mirror apt on this machine uses.
// It prints the layout's path; `cubecli template import base PATH` turns it
// into the template. See docs/templates.md.
//
// With --code-interpreter it builds the code-interpreter image instead
// (base + Debian's Jupyter kernel + the E2B code-interpreter server;
// docs/templates.md), cached beside base.
//
//	go run ./hack/base-image [--rebuild] [--suite bookworm] [--code-interpreter] DIR
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/cubesandbox/cube/internal/template/baseimage"
)

func main() {
	rebuild := flag.Bool("rebuild", false, "ignore the cache and build again")
	ci := flag.Bool("code-interpreter", false, "build the code-interpreter image (base + Jupyter kernel + the E2B code-interpreter server) instead")
	suite := flag.String("suite", baseimage.DefaultSuite, "Debian suite")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: base-image [--rebuild] [--suite SUITE] [--code-interpreter] DIR")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	o := baseimage.Options{Dir: flag.Arg(0), Suite: *suite, Rebuild: *rebuild, Log: log}
	if *ci {
		o = baseimage.CodeInterpreter(o)
	}
	res, err := baseimage.Build(ctx, o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	fmt.Println(res.Layout)
}
