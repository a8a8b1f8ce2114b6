// Command cubecli is the operator CLI.
package main

import (
	"os"

	"github.com/cubesandbox/cube/internal/cli"
)

func main() { os.Exit(cli.Main(os.Args[1:], os.Stdout, os.Stderr)) }
