# Domain mode with the unmodified E2B Python SDK configured by E2B_DOMAIN
# alone (and SSL_CERT_FILE, a bundle of the system's roots and the cluster
# CA): the SDK calls https://api.<domain> and reaches sandboxes at
# https://<port>-<id>.<domain>. Written against the sync API as every 2.x
# release has it (run-py.sh runs it against each published version).
import os
import socket
import ssl
import time
import urllib.request

import pytest
from e2b import Sandbox
from e2b.exceptions import AuthenticationException, SandboxException
from e2b.sandbox.commands.command_handle import CommandExitException

DOMAIN = os.environ.get("E2B_DOMAIN", "")
HOST, _, PORT = DOMAIN.partition(":")
TEMPLATE = os.environ.get("CUBE_E2E_TEMPLATE", "")


@pytest.fixture
def sbx():
    s = Sandbox.create(TEMPLATE)
    yield s
    try:
        s.kill()
    except Exception:
        pass


def handshake(name, cafile):
    ctx = ssl.create_default_context(cafile=cafile)
    with socket.create_connection((name, int(PORT)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=name):
            return True


def test_tls_certificate_verified_with_the_ca():
    # With SSL_CERT_FILE's bundle the handshake verifies; the control, the
    # same handshake with the public roots alone (certifi's, or the
    # system's file without the CA), fails on the certificate.
    import certifi

    for name in (f"api.{HOST}", f"49983-nosuchsandbox.{HOST}"):
        assert handshake(name, os.environ["SSL_CERT_FILE"])
        with pytest.raises(ssl.SSLCertVerificationError):
            handshake(name, certifi.where())


def test_create_and_commands(sbx):
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo hi; echo oops >&2; exit 3")
    assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "hi\n", "oops\n")
    assert sbx.get_host(49983) == f"49983-{sbx.sandbox_id}.{DOMAIN}"


def test_files(sbx):
    sbx.files.write("/tmp/domain.txt", "over TLS\n")
    assert sbx.files.read("/tmp/domain.txt") == "over TLS\n"
    assert "domain.txt" in [e.name for e in sbx.files.list("/tmp")]


def test_get_host_server(sbx):
    sbx.commands.run('mkdir -p /tmp/www && echo "served from $(hostname)" > /tmp/www/index.html')
    sbx.commands.run("busybox httpd -f -p 8000 -h /tmp/www", background=True)
    url = f"https://{sbx.get_host(8000)}/index.html"
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
    body = ""
    for _ in range(50):
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
                body = r.read().decode()
                break
        except Exception:
            time.sleep(0.1)
    assert body.startswith("served from ")


def test_list_timeout_kill(sbx):
    listed = Sandbox.list()
    items = listed.next_items() if hasattr(listed, "next_items") else listed
    assert sbx.sandbox_id in [s.sandbox_id for s in items]
    sbx.set_timeout(120)
    sbx.kill()
    assert not sbx.is_running()


def test_create_metadata_envs_get_info():
    s = Sandbox.create(TEMPLATE, metadata={"suite": "domain", "role": "meta"}, envs={"GREETING": "hello over TLS"})
    try:
        assert s.commands.run('echo "$GREETING"').stdout == "hello over TLS\n"
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id
        assert info.metadata == {"suite": "domain", "role": "meta"}
    finally:
        s.kill()


def test_commands_background_list_kill(sbx):
    h = sbx.commands.run("sleep 600", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid)
    try:
        h.wait()
    except Exception:
        pass
    assert h.pid not in [p.pid for p in sbx.commands.list()]


def test_files_watch_dir(sbx):
    sbx.files.make_dir("/tmp/watched")
    w = sbx.files.watch_dir("/tmp/watched")
    sbx.files.write("/tmp/watched/new.txt", "x")
    names = []
    for _ in range(100):
        names += [e.name for e in w.get_new_events()]
        if "new.txt" in names:
            break
        time.sleep(0.05)
    w.stop()
    assert "new.txt" in names, names


def test_pause_then_connect_resumes(sbx):
    # pause() in newer releases, beta_pause() in 2.0; is_running() is not
    # asked: the route answers a paused sandbox's envd 409 (Notes).
    pause = getattr(sbx, "pause", None) or getattr(sbx, "beta_pause", None)
    if pause is None:
        pytest.skip("this SDK version has no pause")
    sbx.files.write("/tmp/kept.txt", "kept")
    pause()
    assert str(Sandbox.get_info(sbx.sandbox_id).state).lower().endswith("paused")
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/tmp/kept.txt") == "kept"


def test_wrong_api_key_is_401():
    with pytest.raises((AuthenticationException, SandboxException)) as e:
        Sandbox.create(TEMPLATE, api_key="e2b_0000000000000000000000000000000000000000")
    assert isinstance(e.value, AuthenticationException) or "401" in str(e.value)
