package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
)

// The extra a bound service account token carries naming the node its pod
// runs on (Kubernetes >= 1.30).
const nodeNameExtra = "authentication.kubernetes.io/node-name"

// joinIssuer runs beside cubemaster (full mode): it gives a node pod a
// one-time join token for its own node, so that nodes join through the
// master's join listener and never hold the cluster CA's key. A node pod
// proves who it is with a service account token projected for the
// issuer's audience; the API server's TokenReview says whose it is and on
// which node its pod runs. Only the node DaemonSet's service account, for
// the node its pod runs on, gets a token, and that token is for that node
// ID only.
func joinIssuer(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("join-issuer", flag.ExitOnError)
	listen := fs.String("listen", "0.0.0.0:8091", "HTTPS listener")
	certFile := fs.String("tls-cert", "/etc/cube/pki/master.crt", "the listener's certificate")
	keyFile := fs.String("tls-key", "/etc/cube/pki/master.key", "its key")
	socket := fs.String("master", "/run/cube/cubemaster.sock", "cubemaster's admin socket")
	sa := fs.String("service-account", "", "NAMESPACE:NAME of the node pods' service account")
	audience := fs.String("audience", "cube-join", "the audience node tokens are projected for")
	api := fs.String("api", "", "the Kubernetes API, https://host:port (default: the in-cluster address)")
	ttl := fs.Duration("ttl", 10*time.Minute, "validity of the join tokens given")
	_ = fs.Parse(args)
	ns, name, ok := strings.Cut(*sa, ":")
	if !ok || ns == "" || name == "" {
		return fmt.Errorf("join-issuer: --service-account NAMESPACE:NAME is required")
	}
	k, err := newKubeClient(*api)
	if err != nil {
		return err
	}
	conn, err := grpc.NewClient("unix://"+*socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	admin := masterpb.NewAdminServiceClient(conn)
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	iss := &issuer{
		review: k.reviewToken,
		mint: func(ctx context.Context, node string) (string, error) {
			r, err := admin.CreateJoinToken(ctx, &masterpb.CreateJoinTokenRequest{NodeId: node, Ttl: durationpb.New(*ttl)})
			if err != nil {
				return "", err
			}
			return r.Token, nil
		},
		user:     "system:serviceaccount:" + ns + ":" + name,
		audience: *audience,
		log:      log,
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/join-token", iss.serve)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	srv := &http.Server{Addr: *listen, Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		TLSConfig: &tls.Config{MinVersion: tls.VersionTLS12}}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Info("join issuer listening", "addr", *listen, "service_account", iss.user, "audience", *audience)
	if err := srv.ListenAndServeTLS(*certFile, *keyFile); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// reviewed is what the API server says of a token.
type reviewed struct {
	Authenticated bool
	User          string
	Audiences     []string
	Extra         map[string][]string
}

type issuer struct {
	review   func(ctx context.Context, token, audience string) (reviewed, error)
	mint     func(ctx context.Context, node string) (string, error)
	user     string
	audience string
	log      *slog.Logger
}

// serve answers POST /v1/join-token {"node": NAME} with {"token": ...}
// for a bearer token of the node pods' service account whose pod runs on
// node NAME; 401 or 403 (and why, in the log only) otherwise.
func (i *issuer) serve(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Node string `json:"node"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&req); err != nil || req.Node == "" {
		http.Error(w, "want {\"node\": NAME}", http.StatusBadRequest)
		return
	}
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || token == "" {
		http.Error(w, "a bearer token is required", http.StatusUnauthorized)
		return
	}
	if code, why := i.check(r.Context(), token, req.Node); code != http.StatusOK {
		i.log.Warn("join token refused", "node", req.Node, "from", r.RemoteAddr, "why", why)
		http.Error(w, http.StatusText(code), code)
		return
	}
	tok, err := i.mint(r.Context(), req.Node)
	if err != nil {
		i.log.Error("join token", "node", req.Node, "err", err)
		http.Error(w, "the master could not make a join token", http.StatusBadGateway)
		return
	}
	i.log.Info("join token given", "node", req.Node, "from", r.RemoteAddr)
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]string{"token": tok})
}

// check asks the API server about the token and decides.
func (i *issuer) check(ctx context.Context, token, node string) (int, string) {
	rv, err := i.review(ctx, token, i.audience)
	if err != nil {
		return http.StatusServiceUnavailable, "token review: " + err.Error()
	}
	return decide(rv, i.user, i.audience, node)
}

// decide: 200 for a token the API server authenticated for the audience,
// of service account user, whose pod runs on node; 401/403 and why
// otherwise.
func decide(rv reviewed, user, audience, node string) (int, string) {
	if !rv.Authenticated {
		return http.StatusUnauthorized, "the API server does not authenticate the token (for audience " + audience + ")"
	}
	if rv.User != user {
		return http.StatusForbidden, "the token is " + rv.User + "'s, not " + user + "'s"
	}
	nodes := rv.Extra[nodeNameExtra]
	if len(nodes) != 1 {
		return http.StatusForbidden, "the token names no node (not bound to a pod, or an API server before 1.30)"
	}
	if nodes[0] != node {
		return http.StatusForbidden, "the token's pod runs on " + nodes[0] + ", not on " + node
	}
	return http.StatusOK, ""
}

// reviewToken asks the API server whose token this is (TokenReview; the
// caller's service account needs system:auth-delegator).
func (k *kubeClient) reviewToken(ctx context.Context, token, audience string) (reviewed, error) {
	body, _ := json.Marshal(map[string]any{
		"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
		"spec": map[string]any{"token": token, "audiences": []string{audience}},
	})
	var out struct {
		Status struct {
			Authenticated bool     `json:"authenticated"`
			Audiences     []string `json:"audiences"`
			User          struct {
				Username string              `json:"username"`
				Extra    map[string][]string `json:"extra"`
			} `json:"user"`
		} `json:"status"`
	}
	if err := k.do(ctx, http.MethodPost, "/apis/authentication.k8s.io/v1/tokenreviews", body, &out); err != nil {
		return reviewed{}, err
	}
	return reviewed{Authenticated: out.Status.Authenticated, User: out.Status.User.Username,
		Audiences: out.Status.Audiences, Extra: out.Status.User.Extra}, nil
}

// joinToken is the node side: it asks the issuer for a join token for
// its node with its projected service account token, and prints it.
func joinToken(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("join-token", flag.ExitOnError)
	url := fs.String("issuer", "", "the join issuer, https://host:port")
	caFile := fs.String("ca", "/etc/cube/ca/ca.crt", "the cluster CA (the issuer's certificate is the master's)")
	tokenFile := fs.String("token-file", "/var/run/secrets/cube-join/token", "the projected service account token")
	node := fs.String("node", os.Getenv("NODE_NAME"), "this node's name")
	wait := fs.Duration("wait", 5*time.Minute, "keep trying this long while the issuer is unreachable or not ready")
	_ = fs.Parse(args)
	if *url == "" || *node == "" {
		return fmt.Errorf("join-token: --issuer and --node are required")
	}
	caPEM, err := os.ReadFile(*caFile)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return fmt.Errorf("join-token: no certificate in %s", *caFile)
	}
	hc := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}
	body, _ := json.Marshal(map[string]string{"node": *node})
	deadline := time.Now().Add(*wait)
	for {
		// Read each try: the kubelet rotates projected tokens.
		sa, err := os.ReadFile(*tokenFile)
		if err != nil {
			return err
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(*url, "/")+"/v1/join-token", bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(sa)))
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err == nil {
			data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
			switch resp.StatusCode {
			case http.StatusOK:
				var out struct{ Token string }
				if err := json.Unmarshal(data, &out); err != nil || out.Token == "" {
					return fmt.Errorf("join-token: a bad answer: %q", data)
				}
				fmt.Println(out.Token)
				return nil
			case http.StatusUnauthorized, http.StatusForbidden:
				return fmt.Errorf("join-token: refused (%d): the issuer's log says why", resp.StatusCode)
			}
			err = fmt.Errorf("%d %s", resp.StatusCode, strings.TrimSpace(string(data)))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("join-token: %w", err)
		}
		fmt.Fprintln(os.Stderr, "join-token: issuer not ready:", err)
		if err := sleepCtx(ctx, 3*time.Second); err != nil {
			return err
		}
	}
}
