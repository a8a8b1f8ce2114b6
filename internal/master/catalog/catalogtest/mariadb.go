// Package catalogtest starts a private MariaDB server for tests: its own
// data directory in a temp dir, a unix socket and a loopback port, no
// grant tables (nothing but the test can reach it), stopped and removed on
// cleanup. Tests skip, saying so, when mariadb-server is not installed.
package catalogtest

import (
	"context"
	"database/sql"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cubesandbox/cube/internal/testenv"
	"github.com/go-sql-driver/mysql"

	"github.com/cubesandbox/cube/internal/forkthread"
)

// MariaDB is a running private server.
type MariaDB struct {
	Dir    string
	Socket string
	Port   int
	cmd    *exec.Cmd
	n      atomic.Int32
}

func lookPath(names ...string) string {
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
		for _, dir := range []string{"/usr/sbin", "/usr/bin"} {
			if p := filepath.Join(dir, n); fileExists(p) {
				return p
			}
		}
	}
	return ""
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// StartMariaDB starts a server for t, or skips t when mariadb-server is
// missing (CI installs it: hack/deps.sh).
func StartMariaDB(t testing.TB) *MariaDB {
	t.Helper()
	server := lookPath("mariadbd", "mysqld")
	installDB := lookPath("mariadb-install-db", "mysql_install_db")
	if server == "" || installDB == "" {
		testenv.Missing(t, "mariadb-server is not installed (apt-get install mariadb-server; hack/deps.sh does): skipping the MySQL catalog tests")
	}
	dir, err := os.MkdirTemp("", "cube-mariadb-")
	if err != nil {
		t.Fatal(err)
	}
	m := &MariaDB{Dir: dir, Socket: filepath.Join(dir, "mysqld.sock")}
	t.Cleanup(func() { m.stop(t) })
	data := filepath.Join(dir, "data")
	user := []string{}
	if os.Geteuid() == 0 {
		user = []string{"--user=root"}
	}
	install := exec.Command(installDB, append([]string{"--no-defaults", "--datadir=" + data, "--auth-root-authentication-method=normal",
		"--skip-test-db", "--skip-name-resolve"}, user...)...)
	if out, err := install.CombinedOutput(); err != nil {
		t.Fatalf("mariadb-install-db: %v\n%s", err, out)
	}
	if m.Port, err = freePort(); err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(dir, "mysqld.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	m.cmd = exec.Command(server, append([]string{"--no-defaults", "--datadir=" + data, "--socket=" + m.Socket,
		fmt.Sprintf("--port=%d", m.Port), "--bind-address=127.0.0.1", "--skip-grant-tables", "--skip-name-resolve",
		"--pid-file=" + filepath.Join(dir, "mysqld.pid"), "--innodb-buffer-pool-size=32M", "--innodb-log-file-size=16M",
		"--performance-schema=OFF", "--skip-log-bin"}, user...)...)
	m.cmd.Stdout, m.cmd.Stderr = logf, logf
	m.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := forkthread.Start(m.cmd); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = m.cmd.Wait(); close(exited) }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		db, err := sql.Open("mysql", m.dsn(""))
		if err == nil {
			err = db.Ping()
			db.Close()
		}
		if err == nil {
			break
		}
		select {
		case <-exited:
			log, _ := os.ReadFile(filepath.Join(dir, "mysqld.log"))
			t.Fatalf("mariadbd exited at start:\n%s", log)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("mariadbd did not answer in 60s: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return m
}

func (m *MariaDB) dsn(db string) string {
	cfg := mysql.NewConfig()
	cfg.User = "root"
	cfg.Net = "unix"
	cfg.Addr = m.Socket
	cfg.DBName = db
	return cfg.FormatDSN()
}

// NewDatabase creates a fresh database on the server and returns a DSN
// for it over TCP (as production connects).
func (m *MariaDB) NewDatabase(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("cube_test_%d", m.n.Add(1))
	db, err := sql.Open("mysql", m.dsn(""))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(context.Background(), "CREATE DATABASE "+name+" CHARACTER SET utf8mb4"); err != nil {
		t.Fatal(err)
	}
	cfg := mysql.NewConfig()
	cfg.User = "root"
	cfg.Net = "tcp"
	cfg.Addr = fmt.Sprintf("127.0.0.1:%d", m.Port)
	cfg.DBName = name
	return cfg.FormatDSN()
}

func (m *MariaDB) stop(t testing.TB) {
	if m.cmd != nil && m.cmd.Process != nil {
		_ = syscall.Kill(-m.cmd.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() {
			for i := 0; i < 300; i++ {
				if syscall.Kill(m.cmd.Process.Pid, 0) != nil {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
		}
		_ = syscall.Kill(-m.cmd.Process.Pid, syscall.SIGKILL)
	}
	if err := os.RemoveAll(m.Dir); err != nil && !strings.Contains(err.Error(), "no such file") {
		t.Errorf("remove mariadb dir: %v", err)
	}
}
