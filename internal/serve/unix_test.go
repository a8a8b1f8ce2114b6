package serve_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/cubesandbox/cube/internal/serve"
	"github.com/cubesandbox/cube/internal/testenv"
)

// dialEnv names the socket the re-executed test binary connects to (see
// TestMain): the probe runs as another account, which a goroutine of this
// process cannot become.
const dialEnv = "CUBE_SERVE_TEST_DIAL"

func TestMain(m *testing.M) {
	if p := os.Getenv(dialEnv); p != "" {
		c, err := net.Dial("unix", p)
		if err != nil {
			fmt.Print(err.Error())
			os.Exit(3)
		}
		c.Close()
		fmt.Print("connected")
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// probe connects to sock from a process running as uid/gid, a copy of
// this test binary in a directory that account may enter. It returns nil
// when the connect succeeded, else what the process said.
func probe(t *testing.T, bin, sock string, uid uint32) error {
	t.Helper()
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), dialEnv+"="+sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	out, err := cmd.Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() == 3 {
			return errors.New(string(out))
		}
		t.Fatalf("probe as uid %d: %v (%s)", uid, err, out)
	}
	if string(out) != "connected" {
		t.Fatalf("probe as uid %d said %q", uid, out)
	}
	return nil
}

// TestUnixSocketOwnerOnly: every daemon socket (they are all made by
// Group.Unix) is 0600 even under umask 0, so an account other than the
// daemon's cannot connect; root can, and the same probe as uid 65534
// connects once the socket is made 0666 (the control: the probe fails
// because of the mode, not for another reason).
func TestUnixSocketOwnerOnly(t *testing.T) {
	testenv.RequireRoot(t, "connects as uid 65534 (SysProcAttr.Credential)")
	old := syscall.Umask(0)
	t.Cleanup(func() { syscall.Umask(old) })

	dir, err := os.MkdirTemp("", "cube-serve-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil { // any account may reach the socket's directory
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "probe")
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}

	// Control for the umask: a plain bind under umask 0 makes a socket
	// every account may connect to.
	raw, err := net.Listen("unix", filepath.Join(dir, "raw.sock"))
	if err != nil {
		t.Fatal(err)
	}
	rfi, err := os.Stat(filepath.Join(dir, "raw.sock"))
	raw.Close()
	if err != nil || rfi.Mode().Perm() != 0o777 {
		t.Fatalf("control: a plain bind under umask 0 made %v (%v), want 0777", rfi.Mode(), err)
	}

	sock := filepath.Join(dir, "run", "api.sock")
	g := &serve.Group{}
	l, err := g.Unix(sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(g.Close)
	if got := l.Addr().String(); got != sock {
		t.Errorf("listener address %q, want %q", got, sock)
	}
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("under umask 0 the socket is %v, want a 0600 socket", fi.Mode())
	}
	t.Logf("under umask 0: %s is %v", sock, fi.Mode())
	// The bind's umask was its own thread's: the process's is still 0.
	if now := syscall.Umask(0); now != 0 {
		t.Fatalf("the process umask is %#o after Unix, want 0 (untouched)", now)
	}
	entries, err := os.ReadDir(filepath.Dir(sock))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 {
		t.Errorf("the socket's directory holds %d entries, want the socket only", len(entries))
	}

	err = probe(t, bin, sock, 65534)
	if err == nil {
		t.Fatal("uid 65534 connected to a 0600 socket owned by root")
	}
	if !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("uid 65534: %v, want permission denied", err)
	}
	t.Logf("uid 65534 refused: %v", err)
	if err := probe(t, bin, sock, 0); err != nil {
		t.Fatalf("control: root could not connect: %v", err)
	}
	t.Log("control: root connects")
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	if err := probe(t, bin, sock, 65534); err != nil {
		t.Fatalf("control: uid 65534 could not connect to the socket made 0666: %v", err)
	}
	t.Log("control: uid 65534 connects once the socket is 0666")
}
