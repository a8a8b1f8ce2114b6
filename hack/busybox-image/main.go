// Command busybox-image writes the busybox OCI image layout that tests and
// the quick start use, built locally from Debian's busybox-static.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/cubesandbox/cube/internal/testimage"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: busybox-image DIR")
		os.Exit(2)
	}
	layout, err := testimage.Busybox(context.Background(), os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	fmt.Println(layout)
}
