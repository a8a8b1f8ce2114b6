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


def test_wrong_api_key_is_401():
    with pytest.raises((AuthenticationException, SandboxException)) as e:
        Sandbox.create(TEMPLATE, api_key="e2b_0000000000000000000000000000000000000000")
    assert isinstance(e.value, AuthenticationException) or "401" in str(e.value)
