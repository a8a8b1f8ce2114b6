# The unmodified E2B Python SDK (sync API; the version pinned in
# requirements.txt) against a whole single-node cube: the behaviour cases
# of the JS suites (test/e2e/node/sdk.test.mjs and controlplane.test.mjs)
# through cubemaster's E2B API and sandbox route. Run by run.sh under the
# system harness:
#
#   go run ./test/e2e/node/system -- bash test/e2e/python/run.sh
import hashlib
import os
import re
import threading
import time
from datetime import datetime, timezone

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FileType,
    FilesystemEventType,
    NotEnoughSpaceException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
)
from e2b.api.client.models.sandbox_state import SandboxState

from conftest import TAG, TEMPLATE, until

created = []


def make(*args, **kw):
    s = Sandbox.create(*args, **kw)
    created.append(s.sandbox_id)
    return s


@pytest.fixture(scope="module", autouse=True)
def cleanup():
    yield
    for sid in created:
        try:
            Sandbox.kill(sid)
        except Exception:
            pass


@pytest.fixture(scope="module")
def sbx():
    return make(TEMPLATE, metadata={"tag": TAG, "role": "envd"})


@pytest.fixture(scope="module")
def d(sbx):
    path = f"/home/user/e2e-{int(time.time() * 1000)}"
    sbx.files.make_dir(path)
    return path


# ---- control plane ----


def test_create_default_template_then_run():
    s = make()  # the SDK asks for "base", the master's alias of the default
    assert s.commands.run("echo hi").stdout == "hi\n"
    info = s.get_info()
    assert info.sandbox_id == s.sandbox_id
    assert info.state == SandboxState.RUNNING


def test_create_named_template_metadata_envs():
    s = make(TEMPLATE, timeout=120, metadata={"tag": TAG, "role": "named"}, envs={"GREETING": "hello from envs"})
    assert s.commands.run('echo "$GREETING"').stdout == "hello from envs\n"
    info = s.get_info()
    assert info.template_id == TEMPLATE
    assert info.metadata == {"tag": TAG, "role": "named"}
    left = (info.end_at - datetime.now(timezone.utc)).total_seconds()
    assert 100 < left <= 121, f"end_at {info.end_at} is {left}s away"


def test_list_filters_and_paging():
    for i in (1, 2, 3):
        make(TEMPLATE, metadata={"tag": TAG, "role": "list", "i": str(i)})
    q = SandboxQuery(metadata={"tag": TAG, "role": "list"})
    by_meta = Sandbox.list(query=q).next_items()
    assert len(by_meta) == 3
    assert all(s.state == SandboxState.RUNNING and s.metadata["role"] == "list" for s in by_meta)
    pager = Sandbox.list(query=q, limit=2)
    first = pager.next_items()
    assert len(first) == 2 and pager.has_next
    second = pager.next_items()
    assert len(second) == 1 and not pager.has_next
    assert len({s.sandbox_id for s in first + second}) == 3
    paused = Sandbox.list(query=SandboxQuery(metadata={"tag": TAG}, state=[SandboxState.PAUSED])).next_items()
    assert paused == []


def test_set_timeout():
    s = make(TEMPLATE, metadata={"tag": TAG})
    s.set_timeout(600)
    left = (s.get_info().end_at - datetime.now(timezone.utc)).total_seconds()
    assert left > 590, f"after set_timeout(600): {left}s"
    s.set_timeout(30)
    left = (s.get_info().end_at - datetime.now(timezone.utc)).total_seconds()
    assert left <= 31, f"after set_timeout(30): {left}s"


def test_pause_then_connect_resumes():
    s = make(TEMPLATE, metadata={"tag": TAG, "role": "pause"})
    s.commands.run("echo kept > /tmp/state")
    bg = s.commands.run("sleep 600", background=True)
    assert s.pause() is True
    assert s.get_info().state == SandboxState.PAUSED
    assert Sandbox.pause(s.sandbox_id) is False, "pausing a paused sandbox reports False (409)"
    q = SandboxQuery(metadata={"tag": TAG, "role": "pause"}, state=[SandboxState.PAUSED])
    assert [x.sandbox_id for x in Sandbox.list(query=q).next_items()] == [s.sandbox_id]
    again = Sandbox.connect(s.sandbox_id)
    assert again.get_info().state == SandboxState.RUNNING
    assert again.commands.run("cat /tmp/state").stdout == "kept\n"
    assert any(p.pid == bg.pid for p in again.commands.list()), "the background process survived the pause"
    Sandbox.connect(s.sandbox_id)  # connecting to a running sandbox is fine too


def test_kill():
    s = make(TEMPLATE, metadata={"tag": TAG})
    assert s.kill() is True
    assert Sandbox.kill(s.sandbox_id) is False, "killing twice reports False (404)"
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(s.sandbox_id)


def test_wrong_api_key_is_401():
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="e2b_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_" + "1" * 40).next_items()


def test_unknown_sandbox_is_404():
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("nosuchsandbox")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info("nosuchsandbox")
    assert Sandbox.kill("nosuchsandbox") is False


def test_unknown_template_404_malformed_400():
    with pytest.raises(SandboxException, match=r"404"):
        Sandbox.create("no-such-template")
    with pytest.raises(SandboxException, match=r"400"):
        Sandbox.create("Not a template!")


def envd(sid, path, token=None):
    h = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
    if token:
        h["X-Access-Token"] = token
    return httpx.get(os.environ["E2B_SANDBOX_URL"] + path, headers=h).status_code


def test_snapshot_create_from_snapshot_and_fork():
    s = make(TEMPLATE, metadata={"tag": TAG})
    token = s._envd_access_token
    assert token, "an SDK sandbox is secure (has an envd access token)"
    assert envd(s.sandbox_id, "/envs") == 401
    assert envd(s.sandbox_id, "/envs", token) == 200
    s.commands.run("echo snap > /tmp/mark")
    try:
        snap = s.create_snapshot()
    except SandboxException as e:
        if "501" in str(e):
            pytest.skip(f"node cannot snapshot: {e}")
        raise
    child = make(snap.snapshot_id)
    assert child._envd_access_token and child._envd_access_token != token
    assert child.commands.run("cat /tmp/mark").stdout == "snap\n"
    assert envd(child.sandbox_id, "/envs", token) == 401, "the clone refuses its source's token"
    forks = s.fork(count=2)
    for f in forks:
        if isinstance(f, Exception):
            raise f
        created.append(f.sandbox_id)
        assert f.commands.run("cat /tmp/mark").stdout == "snap\n"
        assert envd(f.sandbox_id, "/envs", token) == 401, "a fork refuses its source's token"
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True


# ---- envd: commands, PTY, files ----


def test_commands_stdout_stderr_exit(sbx):
    r = sbx.commands.run("echo hello; echo oops >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hello\n", "oops\n")
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo partial; exit 3")
    assert ei.value.exit_code == 3
    assert ei.value.stdout == "partial\n"
    assert "exit status 3" in ei.value.error


def test_commands_envs_cwd_user(sbx):
    r = sbx.commands.run('echo "$FOO|$PWD|$(id -un)"', envs={"FOO": "bar baz"}, cwd="/tmp")
    assert r.stdout == "bar baz|/tmp|user\n"
    assert sbx.commands.run("id -u; pwd", user="root").stdout == "0\n/root\n"
    assert sbx.commands.run("pwd").stdout == "/home/user\n"


def test_commands_streaming_callbacks(sbx):
    out, err = [], []
    r = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done; echo e >&2", on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "1\n2\n3\n"
    assert len(out) >= 2, f"output arrived in {len(out)} chunk(s), want streaming"
    assert "".join(err) == "e\n"
    assert r.stdout == "1\n2\n3\n"


def test_commands_background_list_connect_kill(sbx):
    h = sbx.commands.run("echo started; sleep 60", background=True)
    assert h.pid > 0
    p = next((x for x in sbx.commands.list() if x.pid == h.pid), None)
    assert p is not None, "background command listed"
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    assert again.pid == h.pid
    assert again.kill() is True
    with pytest.raises(CommandExitException) as ei:
        again.wait()
    assert ei.value.exit_code == -1
    assert "signal: killed" in ei.value.error
    assert sbx.commands.kill(h.pid) is False, "killing a gone command reports False"
    assert not any(x.pid == h.pid for x in sbx.commands.list())


def test_commands_stdin(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello ")
    h.send_stdin("stdin")
    h.close_stdin()
    assert h.wait().stdout == "hello stdin"


def test_pty_create_input_resize_kill(sbx):
    out = []
    term = sbx.pty.create(PtySize(rows=24, cols=80))

    def pump():
        try:
            term.wait(on_pty=lambda d: out.append(bytes(d).decode(errors="replace")))
        except Exception:
            pass

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    sbx.pty.send_stdin(term.pid, b"/bin/busybox stty size; echo pty-$((40+2))\n")
    until("pty output", lambda: "pty-42" in "".join(out))
    assert "24 80" in "".join(out)
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(term.pid, b"/bin/busybox stty size; echo resized-$((1+1))\n")
    until("pty resize", lambda: "resized-2" in "".join(out))
    assert "40 120" in "".join(out)
    assert sbx.pty.kill(term.pid) is True
    t.join(10)
    assert not t.is_alive()


def test_files_crud(sbx, d):
    info = sbx.files.write(f"{d}/a/b/hello.txt", "hello world")
    assert info.path == f"{d}/a/b/hello.txt"
    assert sbx.files.read(f"{d}/a/b/hello.txt") == "hello world"
    sbx.files.write(f"{d}/a/b/hello.txt", "v2")
    assert sbx.files.read(f"{d}/a/b/hello.txt") == "v2"
    st = sbx.files.get_info(f"{d}/a/b/hello.txt")
    assert st.type == FileType.FILE and st.size == 2 and st.owner == "user"
    assert st.permissions == "-rw-r--r--"
    assert isinstance(st.modified_time, datetime)
    assert sbx.files.exists(f"{d}/a/b/hello.txt") is True
    assert sbx.files.exists(f"{d}/nope") is False
    assert sbx.files.make_dir(f"{d}/new") is True
    assert sbx.files.make_dir(f"{d}/new") is False
    assert sorted(e.name for e in sbx.files.list(d)) == ["a", "new"]
    deep = sorted(e.path[len(d) + 1:] for e in sbx.files.list(d, depth=3))
    assert deep == ["a", "a/b", "a/b/hello.txt", "new"]
    moved = sbx.files.rename(f"{d}/a/b/hello.txt", f"{d}/new/moved.txt")
    assert moved.path == f"{d}/new/moved.txt"
    assert sbx.files.exists(f"{d}/a/b/hello.txt") is False
    sbx.files.remove(f"{d}/new")
    assert sbx.files.exists(f"{d}/new/moved.txt") is False
    many = sbx.files.write_files([{"path": f"{d}/m/one.txt", "data": "1"}, {"path": f"{d}/m/two.txt", "data": "22"}])
    assert len(many) == 2
    assert sbx.files.read(f"{d}/m/two.txt") == "22"


def test_files_large_binary(sbx, d):
    data = os.urandom(6 << 20)
    sbx.files.write(f"{d}/big.bin", data)
    back = sbx.files.read(f"{d}/big.bin", format="bytes")
    assert len(back) == len(data)
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    stream = sbx.files.read(f"{d}/big.bin", format="stream")
    assert hashlib.sha256(b"".join(stream)).digest() == hashlib.sha256(data).digest()
    assert sbx.commands.run(f"wc -c < {d}/big.bin").stdout.strip() == str(len(data))


def test_files_watch_dir_recursive(sbx, d):
    w = f"{d}/watched"
    sbx.files.make_dir(f"{w}/sub")
    h = sbx.files.watch_dir(w, recursive=True)
    events = []
    try:
        sbx.files.write(f"{w}/top.txt", "x")
        sbx.files.write(f"{w}/sub/deep.txt", "y")
        sbx.files.remove(f"{w}/top.txt")

        def has_all():
            events.extend(h.get_new_events())
            has = lambda n, t: any(e.name == n and e.type == t for e in events)  # noqa: E731
            return (has("top.txt", FilesystemEventType.WRITE) and has("sub/deep.txt", FilesystemEventType.CREATE)
                    and has("top.txt", FilesystemEventType.REMOVE))

        until("watch events", has_all)
    finally:
        h.stop()


def test_files_signed_urls(sbx, d):
    sbx.files.write(f"{d}/signed.txt", "signed content")
    url = sbx.download_url(f"{d}/signed.txt")
    assert "signature=v1_" in url
    # With E2B_SANDBOX_URL the SDK's file URLs are <E2B_SANDBOX_URL>/files
    # and name no sandbox: the request names it by Host, as in domain mode
    # (docs/compatibility.md).
    host = {"Host": sbx.get_host(49983)}
    r = httpx.get(url, headers=host)
    assert r.status_code == 200 and r.text == "signed content"
    assert httpx.get(re.sub(r"signature=[^&]+", "signature=v1_forged", url), headers=host).status_code == 401
    up = sbx.upload_url(f"{d}/via-url.txt")
    r = httpx.post(up, files={"file": ("via-url.txt", b"uploaded")}, headers=host)
    assert r.status_code == 200
    assert sbx.files.read(f"{d}/via-url.txt") == "uploaded"


def test_bad_input(sbx, d):
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{d}/missing.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(f"{d}/missing.txt")
    with pytest.raises(SandboxException):
        sbx.files.read("/root/.profile", user="user")
    with pytest.raises(SandboxException):
        sbx.files.write("/root/planted.txt", "x")
    with pytest.raises(SandboxException):
        sbx.files.list("/root")
    assert sbx.files.exists("/root/planted.txt", user="root") is False
    with pytest.raises(NotEnoughSpaceException):
        sbx.files.write(f"{d}/huge/huge.bin", bytes(128 << 20))
    assert sbx.files.exists(f"{d}/huge") is False
    assert sbx.commands.run("echo still here").stdout == "still here\n"
