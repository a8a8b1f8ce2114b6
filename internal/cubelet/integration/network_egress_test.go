package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/cubelet/cubelettest"
	"github.com/cubesandbox/cube/internal/network/nettest"
	"github.com/cubesandbox/cube/internal/network/policy"
	"github.com/cubesandbox/cube/internal/nsdial"
	"github.com/cubesandbox/cube/internal/objstore/objstoretest"
	"github.com/cubesandbox/cube/internal/testenv"
)

// TestNetworkEgressCredentials: a sandbox created with a credential rule
// trusts the node's egress CA (its trust store holds it, in every
// container runtime), an HTTPS request from its network namespace that
// verifies against that trust store reaches the upstream with the
// credential injected, and the secret is nowhere the sandbox can look:
// not in any process's environment or command line, not in its files, not
// in the memory of its processes (runc: read from the host). Each search
// has its control: a marker planted the same way is found by the same
// search.
func TestNetworkEgressCredentials(t *testing.T) {
	store := objstoretest.Start(t)
	env := cubelettest.New(t, "[gvisor]\ncheckpoint = false\n"+storeTOML(store))
	w := nettest.NewWorld(t)
	api := w.Addrs[1]
	up := w.ServeDNS(t, map[string][]netip.Addr{"secret.test": {api}})
	ca := nettest.NewTestCA(t, "world-ca")
	cert := ca.Issue(t, "secret.test")
	web := w.ServeWeb(t, func(string) *tls.Certificate { return &cert })
	agent := env.StartNetworkAgent(t, nettest.Options{DNSUpstreams: []string{up.String()}, UpstreamCA: ca.File})
	svc := env.Start(t)
	env.ImportBusybox(t, svc, "busybox")
	ctx := context.Background()
	no := false

	for _, rt := range []string{"runc", "gvisor"} {
		t.Run(rt, func(t *testing.T) {
			if rt == "gvisor" {
				testenv.RequireBinary(t, "runsc", "runsc")
			}
			secret := fmt.Sprintf("Bearer s3cr3t-%s-%d", rt, time.Now().UnixNano())
			marker := fmt.Sprintf("m4rker-%s-%d", rt, time.Now().UnixNano())
			res, err := svc.Create(ctx, cubelet.CreateRequest{TemplateID: "busybox", Runtime: rt,
				Network: netPolicy(t, policy.Spec{AllowInternet: &no, Allow: []string{"secret.test"},
					Credentials: []policy.Credential{{Host: "secret.test", Header: "Authorization", Value: secret}}})})
			if err != nil {
				t.Fatalf("create: %v", err)
			}
			sb := res.Sandbox
			cleanupDelete(t, svc, sb.ID)

			// The trust store.
			bundle, code := shIn(t, sb, "cat $SSL_CERT_FILE")
			roots := x509.NewCertPool()
			if code != 0 || !roots.AppendCertsFromPEM([]byte(bundle)) {
				t.Fatalf("the sandbox's SSL_CERT_FILE (exit %d): %q", code, bundle)
			}
			if !strings.Contains(bundle, strings.TrimSpace(string(agent.Agent.EgressCA()))) {
				t.Fatalf("the sandbox's bundle lacks the node's egress CA:\n%s", bundle)
			}
			t.Logf("the sandbox's trust store holds the egress CA")

			// Plant the controls: the marker in a process's environment
			// and memory, and in a file.
			if out, code := shIn(t, sb, "echo "+marker+" > /tmp/planted; (M="+marker+" sleep 300 &) ; sleep 0.2"); code != 0 {
				t.Fatalf("plant: %q", out)
			}
			// The pattern spells each character as a bracket expression,
			// so the searching processes' own command lines never match.
			search := func(what string) (string, int32) {
				var re strings.Builder
				for _, c := range what {
					if c == ' ' {
						re.WriteString(" ")
						continue
					}
					re.WriteString("[" + string(c) + "]")
				}
				return shIn(t, sb, fmt.Sprintf(`for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do (tr '\0' '\n' < $f) 2>/dev/null; done | grep -c '%s'; `+
					`grep -rsl '%s' /bin /etc /home /root /tmp /usr /var /run 2>/dev/null`, re.String(), re.String()))
			}
			out, _ := search(secret)
			if strings.TrimSpace(out) != "0" {
				t.Fatalf("the secret is visible in the sandbox: %q", out)
			}
			out, _ = search(marker)
			if !strings.HasPrefix(out, "1\n") && !strings.HasPrefix(out, "2\n") || !strings.Contains(out, "/tmp/planted") {
				t.Fatalf("control: the planted marker was not found by the same search: %q", out)
			}
			t.Logf("environments, command lines and files: secret absent, marker found (%q)", strings.Fields(out))

			if rt != "runc" {
				return
			}
			ns := fmt.Sprintf("/proc/%d/ns/net", sb.Container.PID)
			// A request from the sandbox's namespace, verified against
			// the sandbox's own trust store: the upstream sees the
			// credential, the sandbox its digest only.
			c, err := nsdial.DialContext(ctx, ns, "tcp4", netip.AddrPortFrom(api, 443).String())
			if err != nil {
				t.Fatal(err)
			}
			tc := tls.Client(c, &tls.Config{ServerName: "secret.test", RootCAs: roots})
			req, _ := http.NewRequest(http.MethodGet, "https://secret.test/", nil)
			if err := req.Write(tc); err != nil {
				t.Fatalf("request: %v", err)
			}
			resp, err := http.ReadResponse(bufio.NewReader(tc), req)
			if err != nil {
				t.Fatalf("response: %v", err)
			}
			var body bytes.Buffer
			_, _ = body.ReadFrom(resp.Body)
			resp.Body.Close()
			tc.Close()
			if !strings.Contains(body.String(), "auth="+nettest.AuthDigest(secret)) {
				t.Fatalf("upstream did not get the credential: %q", body.String())
			}
			reqs := web.Requests()
			if got := reqs[len(reqs)-1].Header.Get("Authorization"); got != secret {
				t.Fatalf("upstream saw Authorization %q", got)
			}
			t.Logf("upstream received the injected credential; the sandbox verified the proxy with its own trust store")

			// Memory: every process of the sandbox, read from the host.
			found := map[string]bool{}
			for _, pid := range pidsInSandbox(t, sb.Container.PID) {
				for _, s := range []string{secret, marker} {
					if memContains(pid, []byte(s)) {
						found[s] = true
					}
				}
			}
			if found[secret] {
				t.Fatal("the secret is in the memory of a sandbox process")
			}
			if !found[marker] {
				t.Fatal("control: the marker planted in a sandbox process's environment was not found in memory")
			}
			t.Logf("memory of the sandbox's processes: secret absent, marker found")

			// A snapshot exported to the object store: every object in
			// the bucket is searched; the marker (in a file of the disk
			// image) is found, the secret is not.
			sn := mustSnapshot(t, svc, cubelet.SnapshotRequest{SandboxID: sb.ID, Name: "with-credentials"})
			t.Cleanup(func() { _ = svc.DeleteSnapshot(context.Background(), sn.ID) })
			if _, _, err := svc.ExportSnapshot(ctx, sn.ID); err != nil {
				t.Fatalf("export: %v", err)
			}
			inStore := func(what string) bool {
				mc, err := minio.New(store.Endpoint, &minio.Options{Creds: credentials.NewStaticV4(store.AccessKey, store.SecretKey, "")})
				if err != nil {
					t.Fatal(err)
				}
				for oi := range mc.ListObjects(ctx, store.Bucket, minio.ListObjectsOptions{Recursive: true}) {
					if oi.Err != nil {
						t.Fatal(oi.Err)
					}
					obj, err := mc.GetObject(ctx, store.Bucket, oi.Key, minio.GetObjectOptions{})
					if err != nil {
						t.Fatal(err)
					}
					b, err := io.ReadAll(obj)
					obj.Close()
					if err != nil {
						t.Fatal(err)
					}
					if bytes.Contains(b, []byte(what)) {
						return true
					}
				}
				return false
			}
			if inStore(secret) {
				t.Fatal("the secret went to the object store with the snapshot")
			}
			if !inStore(marker) {
				t.Fatal("control: the marker planted in a file was not found in the exported snapshot")
			}
			t.Logf("exported snapshot: secret absent from the object store, marker found")
		})
	}
}

// pidsInSandbox lists the host PIDs in init's PID namespace.
func pidsInSandbox(t *testing.T, initPID int) []int {
	t.Helper()
	want, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", initPID))
	if err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid)); err == nil && ns == want {
			out = append(out, pid)
		}
	}
	return out
}

// memContains reports whether s is in any readable mapping of pid.
func memContains(pid int, s []byte) bool {
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return false
	}
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return false
	}
	defer mem.Close()
	for _, line := range strings.Split(string(maps), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || f[1][0] != 'r' {
			continue
		}
		lo, hi, _ := strings.Cut(f[0], "-")
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || end-start > 1<<30 {
			continue
		}
		buf := make([]byte, end-start)
		n, _ := mem.ReadAt(buf, int64(start))
		if bytes.Contains(buf[:n], s) {
			return true
		}
	}
	return false
}
