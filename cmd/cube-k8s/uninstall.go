package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// The service account files every pod gets (unless it opts out).
const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// uninstall is the chart's pre-delete hook: it leaves the nodes as they
// were before the chart. While the node pods still run, a drain pod on
// each node destroys every sandbox through its cubelet (which releases
// their mounts, loop devices, cgroups and network slots); then the node
// DaemonSet is deleted (its daemons would otherwise restart what is
// purged), and a purge pod on each node releases network-agent's slots
// and host rules (network-agent --purge) and unmounts the storage pool.
// The two pod specs are the chart's (a ConfigMap); this only places one
// of each on every node that ran a node pod and waits for it.
func uninstall(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("uninstall", flag.ExitOnError)
	specs := fs.String("specs", "/specs", "directory with drain.json and purge.json: the pods to run on each node")
	ns := fs.String("namespace", os.Getenv("POD_NAMESPACE"), "the release's namespace")
	selector := fs.String("selector", "", "label selector of the node pods")
	ds := fs.String("daemonset", "", "the node DaemonSet")
	api := fs.String("api", "", "the Kubernetes API, https://host:port (default: the in-cluster address)")
	timeout := fs.Duration("timeout", 8*time.Minute, "the whole uninstall")
	_ = fs.Parse(args)
	if *ns == "" || *selector == "" || *ds == "" {
		return fmt.Errorf("uninstall: --namespace, --selector and --daemonset are required")
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	k, err := newKubeClient(*api)
	if err != nil {
		return err
	}
	drain, err := os.ReadFile(filepath.Join(*specs, "drain.json"))
	if err != nil {
		return err
	}
	purge, err := os.ReadFile(filepath.Join(*specs, "purge.json"))
	if err != nil {
		return err
	}
	nodes, err := k.podNodes(ctx, *ns, *selector)
	if err != nil {
		return err
	}
	fmt.Printf("node pods on %d node(s): %s\n", len(nodes), strings.Join(nodes, " "))
	began := time.Now()
	if err := k.onEveryNode(ctx, *ns, "drain", drain, nodes); err != nil {
		return err
	}
	fmt.Printf("ok  sandboxes destroyed on every node   %s\n", time.Since(began).Round(time.Millisecond))
	t0 := time.Now()
	q := url.Values{"propagationPolicy": {"Background"}}
	if err := k.do(ctx, http.MethodDelete, "/apis/apps/v1/namespaces/"+*ns+"/daemonsets/"+*ds+"?"+q.Encode(), nil, nil); err != nil && !isNotFound(err) {
		return fmt.Errorf("delete daemonset %s: %w", *ds, err)
	}
	for {
		left, err := k.podNodes(ctx, *ns, *selector)
		if err != nil {
			return err
		}
		if len(left) == 0 {
			break
		}
		if err := sleepCtx(ctx, time.Second); err != nil {
			return fmt.Errorf("node pods still running on %v: %w", left, err)
		}
	}
	fmt.Printf("ok  node pods gone                      %s\n", time.Since(t0).Round(time.Millisecond))
	t0 = time.Now()
	if err := k.onEveryNode(ctx, *ns, "purge", purge, nodes); err != nil {
		return err
	}
	fmt.Printf("ok  host rules, slots and pool released %s\n", time.Since(t0).Round(time.Millisecond))
	return nil
}

// onEveryNode runs one pod of spec on each node, prints its log, waits
// for every one to succeed, and deletes them.
func (k *kubeClient) onEveryNode(ctx context.Context, ns, phase string, spec []byte, nodes []string) error {
	var names []string
	defer func() {
		// Deleted even when the context is done: they are the hook's own.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		for _, n := range names {
			_ = k.do(dctx, http.MethodDelete, "/api/v1/namespaces/"+ns+"/pods/"+n+"?gracePeriodSeconds=0", nil, nil)
		}
	}()
	for i, node := range nodes {
		var pod map[string]any
		if err := json.Unmarshal(spec, &pod); err != nil {
			return fmt.Errorf("%s pod spec: %w", phase, err)
		}
		meta, _ := pod["metadata"].(map[string]any)
		s, _ := pod["spec"].(map[string]any)
		if meta == nil || s == nil {
			return fmt.Errorf("%s pod spec: no metadata or spec", phase)
		}
		base, _ := meta["name"].(string)
		name := fmt.Sprintf("%s-%d", base, i)
		meta["name"] = name
		s["nodeName"] = node // placed by name: no scheduler, taints tolerated
		body, _ := json.Marshal(pod)
		// A pod of that name left by an interrupted run goes first.
		_ = k.do(ctx, http.MethodDelete, "/api/v1/namespaces/"+ns+"/pods/"+name+"?gracePeriodSeconds=0", nil, nil)
		for {
			err := k.do(ctx, http.MethodPost, "/api/v1/namespaces/"+ns+"/pods", body, nil)
			if err == nil {
				break
			}
			if ae, ok := err.(*apiError); !ok || ae.status != http.StatusConflict { //nolint:errorlint // do returns it unwrapped
				// 409: the pod deleted above is still terminating.
				return fmt.Errorf("create %s pod on %s: %w", phase, node, err)
			}
			if err := sleepCtx(ctx, time.Second); err != nil {
				return fmt.Errorf("create %s pod on %s: %w", phase, node, err)
			}
		}
		names = append(names, name)
	}
	var failed []string
	for i, name := range names {
		phaseOf := ""
		for phaseOf != "Succeeded" && phaseOf != "Failed" {
			var pod struct {
				Status struct{ Phase string } `json:"status"`
			}
			if err := k.do(ctx, http.MethodGet, "/api/v1/namespaces/"+ns+"/pods/"+name, nil, &pod); err != nil {
				return err
			}
			phaseOf = pod.Status.Phase
			if phaseOf == "Succeeded" || phaseOf == "Failed" {
				break
			}
			if err := sleepCtx(ctx, time.Second); err != nil {
				return fmt.Errorf("%s pod on %s: still %s: %w", phase, nodes[i], phaseOf, err)
			}
		}
		fmt.Printf("-- %s on %s: %s\n", phase, nodes[i], phaseOf)
		k.printLogs(ctx, ns, name)
		if phaseOf != "Succeeded" {
			failed = append(failed, nodes[i])
		}
	}
	if len(failed) > 0 {
		return fmt.Errorf("%s failed on %v (its log above)", phase, failed)
	}
	return nil
}

// printLogs prints every container's log of a pod (best effort).
func (k *kubeClient) printLogs(ctx context.Context, ns, name string) {
	var pod struct {
		Spec struct {
			InitContainers []struct{ Name string } `json:"initContainers"`
			Containers     []struct{ Name string } `json:"containers"`
		} `json:"spec"`
	}
	if err := k.do(ctx, http.MethodGet, "/api/v1/namespaces/"+ns+"/pods/"+name, nil, &pod); err != nil {
		return
	}
	for _, c := range append(pod.Spec.InitContainers, pod.Spec.Containers...) {
		var buf bytes.Buffer
		if err := k.do(ctx, http.MethodGet, "/api/v1/namespaces/"+ns+"/pods/"+name+"/log?container="+c.Name, nil, &buf); err == nil {
			for _, l := range strings.Split(strings.TrimRight(buf.String(), "\n"), "\n") {
				fmt.Printf("   %s: %s\n", c.Name, l)
			}
		}
	}
}

// podNodes lists the nodes that run a pod matching selector.
func (k *kubeClient) podNodes(ctx context.Context, ns, selector string) ([]string, error) {
	var list struct {
		Items []struct {
			Spec struct{ NodeName string } `json:"spec"`
		} `json:"items"`
	}
	if err := k.do(ctx, http.MethodGet, "/api/v1/namespaces/"+ns+"/pods?labelSelector="+url.QueryEscape(selector), nil, &list); err != nil {
		return nil, fmt.Errorf("list node pods: %w", err)
	}
	seen := map[string]bool{}
	var nodes []string
	for _, p := range list.Items {
		if n := p.Spec.NodeName; n != "" && !seen[n] {
			seen[n] = true
			nodes = append(nodes, n)
		}
	}
	sort.Strings(nodes)
	return nodes, nil
}

// kubeClient is the few calls of the Kubernetes API the hook makes, as
// its service account (no client library: the images stay small).
type kubeClient struct {
	base  string
	token string
	http  *http.Client
}

func newKubeClient(api string) (*kubeClient, error) {
	if api == "" {
		host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
		if host == "" {
			return nil, fmt.Errorf("not in a cluster (no KUBERNETES_SERVICE_HOST) and no --api")
		}
		api = "https://" + net.JoinHostPort(host, port)
	}
	token, err := os.ReadFile(filepath.Join(saDir, "token"))
	if err != nil {
		return nil, fmt.Errorf("service account token: %w", err)
	}
	caPEM, err := os.ReadFile(filepath.Join(saDir, "ca.crt"))
	if err != nil {
		return nil, fmt.Errorf("service account CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("service account CA: no certificate in %s/ca.crt", saDir)
	}
	return &kubeClient{
		base:  strings.TrimRight(api, "/"),
		token: strings.TrimSpace(string(token)),
		http:  &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}},
	}, nil
}

type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return fmt.Sprintf("%d: %s", e.status, e.msg) }

func isNotFound(err error) bool {
	e, ok := err.(*apiError) //nolint:errorlint // do returns it unwrapped
	return ok && e.status == http.StatusNotFound
}

// do calls the API; out is a *bytes.Buffer (the raw body) or decoded JSON.
func (k *kubeClient) do(ctx context.Context, method, path string, body []byte, out any) error {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, k.base+path, rd) //nolint:gosec // G704: the API server the operator named, paths of our own
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+k.token)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := k.http.Do(req) //nolint:gosec // G704: as above
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		return &apiError{status: resp.StatusCode, msg: method + " " + path + ": " + strings.TrimSpace(string(data))}
	}
	switch o := out.(type) {
	case nil:
		return nil
	case *bytes.Buffer:
		o.Write(data)
		return nil
	default:
		return json.Unmarshal(data, out)
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}
