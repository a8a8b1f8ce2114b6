// Command cube-k8s is the Kubernetes chart's helper (deploy/helm/cube),
// shipped in the installer and cubemaster images:
//
//	cube-k8s install --from DIR --to DIR --version V
//	    lay the node's runtime artifacts (cube-agent, VM guest, default
//	    template) onto the host at <to>/<V>, then point <to>/current at it
//	cube-k8s config --in FILE --out FILE
//	    write a daemon's config with ${VAR}s from the pod's environment
//	cube-k8s cert --ca-dir DIR --role ROLE --name NAME --hosts H[,H] --out DIR
//	    issue a component certificate from the cluster CA (a Secret mount)
//	cube-k8s template --socket PATH --id ID --source DIR [--stay]
//	    import a template into the node's cubelet once it answers
//	cube-k8s smoke --api URL --proxy URL --admin HOST:PORT --ca-dir DIR ...
//	    the chart's helm test: a sandbox through the E2B API, a command,
//	    a file, pause and resume, a port through the proxy, kill
//	cube-k8s join-issuer --service-account NS:NAME [--listen ADDR]
//	    beside cubemaster: a one-time join token for a node pod's own node,
//	    on its projected service account token (TokenReview)
//	cube-k8s join-token --issuer URL --node NAME
//	    the node side: ask the issuer for a join token, print it
//	cube-k8s uninstall --specs DIR --namespace NS --selector SEL --daemonset NAME
//	    the chart's pre-delete hook: destroy every sandbox on every node,
//	    delete the node DaemonSet, purge the nodes' host rules and mounts
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	var err error
	args := os.Args[2:]
	switch os.Args[1] {
	case "install":
		err = install(args)
	case "config":
		err = config(args)
	case "cert":
		err = cert(args)
	case "template":
		err = template(ctx, args)
	case "smoke":
		err = smoke(ctx, args)
	case "uninstall":
		err = uninstall(ctx, args)
	case "join-issuer":
		err = joinIssuer(ctx, args)
	case "join-token":
		err = joinToken(ctx, args)
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "cube-k8s:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: cube-k8s install|config|cert|template|smoke|uninstall|join-issuer|join-token [flags]")
	os.Exit(2)
}
