// Command harness runs a command (the Node suite) against a real cube
// sandbox: it starts a private cubelet in-process, imports the busybox
// template (plus a bash shim the E2B SDK needs), creates a sandbox,
// initialises its agent the way cubelet will (access token, default user,
// env), forwards a host port into the sandbox's network namespace, and
// serves the single control-plane call the SDK makes. The sandbox is
// created with its access token, as the control plane creates every one:
// the harness first checks that the agent refuses a request without it. Then it runs the
// command with the E2B_* variables pointing there, tears everything down,
// checks for leaks, and exits with the command's status.
//
//	go run ./test/e2e/node/harness -- npm --prefix test/e2e/node test
//
// With -runtime vm (or gvisor) the sandbox gets a network slot from an
// in-process network-agent and the SDK talks to the slot's host IP
// directly; vm also builds the guest kernel and initramfs once.
//
// It also reports the closing-note figure it can see from outside: the
// agent's resident size, idle and after the suite (for a VM, QEMU's: the
// agent runs inside the guest).
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cubesandbox/cube/internal/agentproto"
	"github.com/cubesandbox/cube/internal/nsdial"
)

func main() {
	agentBin := flag.String("agent", "", "prebuilt static cube-agent; built from ./cmd/cube-agent when empty")
	verbose := flag.Bool("v", false, "log cubelet and the harness at info level")
	runtime := flag.String("runtime", "runc", "sandbox runtime: runc, vm (QEMU micro-VM; CUBE_VM_ACCEL=tcg|kvm|auto, tcg by default) or gvisor")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: harness [-agent path] [-runtime runc|vm|gvisor] [-v] -- command [args...]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	switch *runtime {
	case "runc", "vm", "gvisor":
	default:
		fmt.Fprintf(os.Stderr, "harness: -runtime %q: want runc, vm or gvisor\n", *runtime)
		os.Exit(2)
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelInfo
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("component", "e2e-harness")
	os.Exit(run(*agentBin, *runtime, flag.Args(), log))
}

func run(agentBin, runtime string, command []string, log *slog.Logger) (code int) {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "harness: needs root (loop devices, mounts, cgroups, runc)")
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	fail := func(err error) int {
		fmt.Fprintf(os.Stderr, "harness: %v\n", err)
		return 1
	}

	setupCtx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	n, err := startNode(setupCtx, agentBin, runtime, log)
	if err != nil {
		return fail(err)
	}
	defer func() {
		if err := n.teardown(context.Background()); err != nil {
			fmt.Fprintf(os.Stderr, "harness: teardown: %v\n", err)
			code = max(code, 1)
		}
	}()
	token := randHex(16)
	created := time.Now()
	sb, err := n.createSandbox(setupCtx, token)
	if err != nil {
		return fail(err)
	}
	took := time.Since(created)
	pid := sb.Container.PID
	// agentAddr is where the harness reaches the agent, sandboxAddr where
	// the SDK does. A runc sandbox without a slot is reachable only inside
	// its netns (a forwarder brings it to 127.0.0.1); a slotted one (vm,
	// gvisor) at its slot's host IP, from the host directly.
	var agentAddr, sandboxAddr string
	var agent *http.Client
	if sb.Network != nil && sb.Network.HostIP != "" {
		agentAddr = net.JoinHostPort(sb.Network.HostIP, strconv.Itoa(agentproto.Port))
		sandboxAddr = agentAddr
		agent = &http.Client{Transport: &http.Transport{Proxy: nil}, Timeout: 30 * time.Second}
	} else {
		netns := fmt.Sprintf("/proc/%d/ns/net", pid)
		agentAddr = net.JoinHostPort("127.0.0.1", strconv.Itoa(agentproto.Port))
		fwd, err := nsdial.Forward("127.0.0.1:0", netns, agentAddr, log)
		if err != nil {
			return fail(err)
		}
		defer fwd.Close()
		sandboxAddr = fwd.Addr()
		agent = nsdial.HTTPClient(netns)
	}
	defer agent.CloseIdleConnections()

	var info struct {
		EnvdVersion string `json:"envdVersion"`
	}
	// Before anything initialised the agent: without the token, 401.
	if err := call(setupCtx, agent, "GET", "http://"+agentAddr+"/_cube/info", "", nil, nil); err == nil || !strings.Contains(err.Error(), "401") {
		return fail(fmt.Errorf("agent info without the access token right after create: %v, want 401", err))
	}
	if err := call(setupCtx, agent, "GET", "http://"+agentAddr+"/_cube/info", token, nil, &info); err != nil {
		return fail(fmt.Errorf("agent info: %w", err))
	}
	initBody, _ := json.Marshal(map[string]any{
		"accessToken": token,
		"defaultUser": "user",
		"envVars":     map[string]string{"CUBE_SANDBOX_ID": sb.ID, "CUBE_E2E": "1"},
		"timestamp":   time.Now().UTC(),
	})
	if err := call(setupCtx, agent, "POST", "http://"+agentAddr+"/init", token, initBody, nil); err != nil {
		return fail(fmt.Errorf("agent init: %w", err))
	}
	time.Sleep(time.Second) // let the agent settle before measuring it idle
	idleRSS := rss(pid)

	apiKey := "e2b_" + randHex(16)
	api := &fakeAPI{apiKey: apiKey, sandboxID: sb.ID, templateID: sb.TemplateID, envdVersion: info.EnvdVersion, accessToken: token, started: time.Now()}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	apiSrv := &http.Server{Handler: api.handler(), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = apiSrv.Serve(ln) }()
	defer apiSrv.Close()

	fmt.Fprintf(os.Stderr, "harness: %s sandbox %s (%s pid %d, envd %s, created to agent ready in %v) at http://%s; API at http://%s\n",
		runtime, sb.ID, procName(runtime), pid, info.EnvdVersion, took.Round(time.Millisecond), sandboxAddr, ln.Addr())
	cmd := exec.CommandContext(ctx, command[0], command[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(),
		"E2B_API_URL=http://"+ln.Addr().String(),
		"E2B_SANDBOX_URL=http://"+sandboxAddr,
		"E2B_API_KEY="+apiKey,
		"CUBE_SANDBOX_ID="+sb.ID,
		"CUBE_ENVD_VERSION="+info.EnvdVersion,
		"CUBE_E2E_RUNTIME="+runtime,
	)
	runErr := cmd.Run()
	fmt.Fprintf(os.Stderr, "harness: figure: %s RSS idle %s; after the suite %s\n", procName(runtime), idleRSS, rss(pid))
	if runErr != nil {
		var ee *exec.ExitError
		if errors.As(runErr, &ee) {
			return max(ee.ExitCode(), 1)
		}
		return fail(runErr)
	}
	return 0
}

// procName names the process whose size the figure line reports: the
// agent itself for runc; for a VM, QEMU (the agent runs inside the guest,
// and QEMU's RSS is what the sandbox costs the host); for gvisor, the
// pid cubelet records for the sandbox.
func procName(runtime string) string {
	switch runtime {
	case "vm":
		return "QEMU"
	case "gvisor":
		return "runsc sandbox"
	}
	return "cube-agent"
}

// call does one JSON request to the agent; out may be nil.
func call(ctx context.Context, c *http.Client, method, url, token string, body []byte, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("X-Access-Token", token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %s: %s", method, url, resp.Status, b)
	}
	if out != nil {
		return json.Unmarshal(b, out)
	}
	return nil
}

// rss describes a process's resident set: total, anonymous (heap,
// stacks) and file-backed (the binary's pages; each sandbox has its own
// copy of the agent, so they are not shared between sandboxes).
func rss(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "gone"
	}
	kib := map[string]int{}
	for line := range strings.SplitSeq(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && strings.HasPrefix(k, "Rss") || k == "VmRSS" {
			kib[k], _ = strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
		}
	}
	return fmt.Sprintf("%d KiB (anon %d, file %d)", kib["VmRSS"], kib["RssAnon"], kib["RssFile"])
}
