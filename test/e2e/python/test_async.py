# The unmodified E2B Python SDK (async API, AsyncSandbox; the version pinned
# in requirements.txt) against a whole single-node cube: the behaviour cases
# of the JS suites (test/e2e/node/sdk.test.mjs and controlplane.test.mjs)
# through cubemaster's E2B API and sandbox route. Run by run.sh under the
# system harness:
#
#   go run ./test/e2e/node/system -- bash test/e2e/python/run.sh
import hashlib
import asyncio
import os
import re
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
    AsyncSandbox as Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
)
from e2b.api.client.models.sandbox_state import SandboxState

from conftest import TAG, TEMPLATE

# One loop for the module: its sandboxes' clients live on it.
loop = asyncio.new_event_loop()
run = loop.run_until_complete


async def until(what, cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.025)

created = []


async def make(*args, **kw):
    s = await Sandbox.create(*args, **kw)
    created.append(s.sandbox_id)
    return s


@pytest.fixture(scope="module", autouse=True)
def cleanup():
    yield
    for sid in created:
        try:
            run(Sandbox.kill(sid))
        except Exception:
            pass
    loop.close()


@pytest.fixture(scope="module")
def sbx():
    return run(make(TEMPLATE, metadata={"tag": TAG, "role": "envd"}))


@pytest.fixture(scope="module")
def d(sbx):
    path = f"/home/user/e2e-{int(time.time() * 1000)}"
    run(sbx.files.make_dir(path))
    return path


# ---- control plane ----


async def _test_create_default_template_then_run():
    s = await make()  # the SDK asks for "base", the master's alias of the default
    assert (await s.commands.run("echo hi")).stdout == "hi\n"
    info = await s.get_info()
    assert info.sandbox_id == s.sandbox_id
    assert info.state == SandboxState.RUNNING


async def _test_create_named_template_metadata_envs():
    s = await make(TEMPLATE, timeout=120, metadata={"tag": TAG, "role": "named"}, envs={"GREETING": "hello from envs"})
    assert (await s.commands.run('echo "$GREETING"')).stdout == "hello from envs\n"
    info = await s.get_info()
    assert info.template_id == TEMPLATE
    assert info.metadata == {"tag": TAG, "role": "named"}
    left = (info.end_at - datetime.now(timezone.utc)).total_seconds()
    assert 100 < left <= 121, f"end_at {info.end_at} is {left}s away"


async def _test_list_filters_and_paging():
    for i in (1, 2, 3):
        await make(TEMPLATE, metadata={"tag": TAG, "role": "list", "i": str(i)})
    q = SandboxQuery(metadata={"tag": TAG, "role": "list"})
    by_meta = await Sandbox.list(query=q).next_items()
    assert len(by_meta) == 3
    assert all(s.state == SandboxState.RUNNING and s.metadata["role"] == "list" for s in by_meta)
    pager = Sandbox.list(query=q, limit=2)
    first = await pager.next_items()
    assert len(first) == 2 and pager.has_next
    second = await pager.next_items()
    assert len(second) == 1 and not pager.has_next
    assert len({s.sandbox_id for s in first + second}) == 3
    paused = await Sandbox.list(query=SandboxQuery(metadata={"tag": TAG}, state=[SandboxState.PAUSED])).next_items()
    assert paused == []


async def _test_set_timeout():
    s = await make(TEMPLATE, metadata={"tag": TAG})
    await s.set_timeout(600)
    left = ((await s.get_info()).end_at - datetime.now(timezone.utc)).total_seconds()
    assert left > 590, f"after set_timeout(600): {left}s"
    await s.set_timeout(30)
    left = ((await s.get_info()).end_at - datetime.now(timezone.utc)).total_seconds()
    assert left <= 31, f"after set_timeout(30): {left}s"


async def _test_pause_then_connect_resumes():
    s = await make(TEMPLATE, metadata={"tag": TAG, "role": "pause"})
    await s.commands.run("echo kept > /tmp/state")
    bg = await s.commands.run("sleep 600", background=True)
    assert await s.pause() is True
    assert (await s.get_info()).state == SandboxState.PAUSED
    assert await Sandbox.pause(s.sandbox_id) is False, "pausing a paused sandbox reports False (409)"
    q = SandboxQuery(metadata={"tag": TAG, "role": "pause"}, state=[SandboxState.PAUSED])
    assert [x.sandbox_id for x in await Sandbox.list(query=q).next_items()] == [s.sandbox_id]
    again = await Sandbox.connect(s.sandbox_id)
    assert (await again.get_info()).state == SandboxState.RUNNING
    assert (await again.commands.run("cat /tmp/state")).stdout == "kept\n"
    assert any(p.pid == bg.pid for p in await again.commands.list()), "the background process survived the pause"
    await Sandbox.connect(s.sandbox_id)  # connecting to a running sandbox is fine too


async def _test_kill():
    s = await make(TEMPLATE, metadata={"tag": TAG})
    assert await s.kill() is True
    assert await Sandbox.kill(s.sandbox_id) is False, "killing twice reports False (404)"
    with pytest.raises(SandboxNotFoundException):
        await Sandbox.get_info(s.sandbox_id)


async def _test_wrong_api_key_is_401():
    with pytest.raises(AuthenticationException):
        await Sandbox.create(TEMPLATE, api_key="e2b_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        await Sandbox.list(api_key="e2b_" + "1" * 40).next_items()


async def _test_unknown_sandbox_is_404():
    with pytest.raises(SandboxNotFoundException):
        await Sandbox.connect("nosuchsandbox")
    with pytest.raises(SandboxNotFoundException):
        await Sandbox.get_info("nosuchsandbox")
    assert await Sandbox.kill("nosuchsandbox") is False


async def _test_unknown_template_404_malformed_400():
    with pytest.raises(SandboxException, match=r"404"):
        await Sandbox.create("no-such-template")
    with pytest.raises(SandboxException, match=r"400"):
        await Sandbox.create("Not a template!")


def envd(sid, path, token=None):
    h = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
    if token:
        h["X-Access-Token"] = token
    return httpx.get(os.environ["E2B_SANDBOX_URL"] + path, headers=h).status_code


async def _test_snapshot_create_from_snapshot_and_fork():
    s = await make(TEMPLATE, metadata={"tag": TAG})
    token = s._envd_access_token
    assert token, "an SDK sandbox is secure (has an envd access token)"
    assert envd(s.sandbox_id, "/envs") == 401
    assert envd(s.sandbox_id, "/envs", token) == 200
    await s.commands.run("echo snap > /tmp/mark")
    try:
        snap = await s.create_snapshot()
    except SandboxException as e:
        if "501" in str(e):
            pytest.skip(f"node cannot snapshot: {e}")
        raise
    child = await make(snap.snapshot_id)
    assert child._envd_access_token and child._envd_access_token != token
    assert (await child.commands.run("cat /tmp/mark")).stdout == "snap\n"
    assert envd(child.sandbox_id, "/envs", token) == 401, "the clone refuses its source's token"
    forks = await s.fork(count=2)
    for f in forks:
        if isinstance(f, Exception):
            raise f
        created.append(f.sandbox_id)
        assert (await f.commands.run("cat /tmp/mark")).stdout == "snap\n"
        assert envd(f.sandbox_id, "/envs", token) == 401, "a fork refuses its source's token"
    assert await Sandbox.delete_snapshot(snap.snapshot_id) is True


# ---- envd: commands, PTY, files ----


async def _test_commands_stdout_stderr_exit(sbx):
    r = await sbx.commands.run("echo hello; echo oops >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hello\n", "oops\n")
    with pytest.raises(CommandExitException) as ei:
        await sbx.commands.run("echo partial; exit 3")
    assert ei.value.exit_code == 3
    assert ei.value.stdout == "partial\n"
    assert "exit status 3" in ei.value.error


async def _test_commands_envs_cwd_user(sbx):
    r = await sbx.commands.run('echo "$FOO|$PWD|$(id -un)"', envs={"FOO": "bar baz"}, cwd="/tmp")
    assert r.stdout == "bar baz|/tmp|user\n"
    assert (await sbx.commands.run("id -u; pwd", user="root")).stdout == "0\n/root\n"
    assert (await sbx.commands.run("pwd")).stdout == "/home/user\n"


async def _test_commands_streaming_callbacks(sbx):
    out, err = [], []
    r = await sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done; echo e >&2", on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "1\n2\n3\n"
    assert len(out) >= 2, f"output arrived in {len(out)} chunk(s), want streaming"
    assert "".join(err) == "e\n"
    assert r.stdout == "1\n2\n3\n"


async def _test_commands_background_list_connect_kill(sbx):
    h = await sbx.commands.run("echo started; sleep 60", background=True)
    assert h.pid > 0
    p = next((x for x in await sbx.commands.list() if x.pid == h.pid), None)
    assert p is not None, "background command listed"
    await h.disconnect()
    again = await sbx.commands.connect(h.pid)
    assert again.pid == h.pid
    assert await again.kill() is True
    with pytest.raises(CommandExitException) as ei:
        await again.wait()
    assert ei.value.exit_code == -1
    assert "signal: killed" in ei.value.error
    assert await sbx.commands.kill(h.pid) is False, "killing a gone command reports False"
    assert not any(x.pid == h.pid for x in await sbx.commands.list())


async def _test_commands_stdin(sbx):
    h = await sbx.commands.run("cat", background=True, stdin=True)
    await sbx.commands.send_stdin(h.pid, "hello ")
    await h.send_stdin("stdin")
    await h.close_stdin()
    assert (await h.wait()).stdout == "hello stdin"


async def _test_pty_create_input_resize_kill(sbx):
    out = []
    term = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=lambda d: out.append(bytes(d).decode(errors="replace")))
    await sbx.pty.send_stdin(term.pid, b"/bin/busybox stty size; echo pty-$((40+2))\n")
    await until("pty output", lambda: "pty-42" in "".join(out))
    assert "24 80" in "".join(out)
    await sbx.pty.resize(term.pid, PtySize(rows=40, cols=120))
    await sbx.pty.send_stdin(term.pid, b"/bin/busybox stty size; echo resized-$((1+1))\n")
    await until("pty resize", lambda: "resized-2" in "".join(out))
    assert "40 120" in "".join(out)
    assert await sbx.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):
        await asyncio.wait_for(term.wait(), 10)


async def _test_files_crud(sbx, d):
    info = await sbx.files.write(f"{d}/a/b/hello.txt", "hello world")
    assert info.path == f"{d}/a/b/hello.txt"
    assert await sbx.files.read(f"{d}/a/b/hello.txt") == "hello world"
    await sbx.files.write(f"{d}/a/b/hello.txt", "v2")
    assert await sbx.files.read(f"{d}/a/b/hello.txt") == "v2"
    st = await sbx.files.get_info(f"{d}/a/b/hello.txt")
    assert st.type == FileType.FILE and st.size == 2 and st.owner == "user"
    assert st.permissions == "-rw-r--r--"
    assert isinstance(st.modified_time, datetime)
    assert await sbx.files.exists(f"{d}/a/b/hello.txt") is True
    assert await sbx.files.exists(f"{d}/nope") is False
    assert await sbx.files.make_dir(f"{d}/new") is True
    assert await sbx.files.make_dir(f"{d}/new") is False
    assert sorted(e.name for e in await sbx.files.list(d)) == ["a", "new"]
    deep = sorted(e.path[len(d) + 1:] for e in await sbx.files.list(d, depth=3))
    assert deep == ["a", "a/b", "a/b/hello.txt", "new"]
    moved = await sbx.files.rename(f"{d}/a/b/hello.txt", f"{d}/new/moved.txt")
    assert moved.path == f"{d}/new/moved.txt"
    assert await sbx.files.exists(f"{d}/a/b/hello.txt") is False
    await sbx.files.remove(f"{d}/new")
    assert await sbx.files.exists(f"{d}/new/moved.txt") is False
    many = await sbx.files.write_files([{"path": f"{d}/m/one.txt", "data": "1"}, {"path": f"{d}/m/two.txt", "data": "22"}])
    assert len(many) == 2
    assert await sbx.files.read(f"{d}/m/two.txt") == "22"


async def _test_files_large_binary(sbx, d):
    data = os.urandom(6 << 20)
    await sbx.files.write(f"{d}/big.bin", data)
    back = await sbx.files.read(f"{d}/big.bin", format="bytes")
    assert len(back) == len(data)
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    stream = await sbx.files.read(f"{d}/big.bin", format="stream")
    assert hashlib.sha256(b"".join([c async for c in stream])).digest() == hashlib.sha256(data).digest()
    assert (await sbx.commands.run(f"wc -c < {d}/big.bin")).stdout.strip() == str(len(data))


async def _test_files_watch_dir_recursive(sbx, d):
    w = f"{d}/watched"
    await sbx.files.make_dir(f"{w}/sub")
    events = []
    h = await sbx.files.watch_dir(w, events.append, recursive=True)
    try:
        await sbx.files.write(f"{w}/top.txt", "x")
        await sbx.files.write(f"{w}/sub/deep.txt", "y")
        await sbx.files.remove(f"{w}/top.txt")

        def has_all():
            has = lambda n, t: any(e.name == n and e.type == t for e in events)  # noqa: E731
            return (has("top.txt", FilesystemEventType.WRITE) and has("sub/deep.txt", FilesystemEventType.CREATE)
                    and has("top.txt", FilesystemEventType.REMOVE))

        await until("watch events", has_all)
    finally:
        await h.stop()


async def _test_files_signed_urls(sbx, d):
    await sbx.files.write(f"{d}/signed.txt", "signed content")
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
    assert await sbx.files.read(f"{d}/via-url.txt") == "uploaded"


async def _test_bad_input(sbx, d):
    with pytest.raises(FileNotFoundException):
        await sbx.files.read(f"{d}/missing.txt")
    with pytest.raises(FileNotFoundException):
        await sbx.files.get_info(f"{d}/missing.txt")
    with pytest.raises(SandboxException):
        await sbx.files.read("/root/.profile", user="user")
    with pytest.raises(SandboxException):
        await sbx.files.write("/root/planted.txt", "x")
    with pytest.raises(SandboxException):
        await sbx.files.list("/root")
    assert await sbx.files.exists("/root/planted.txt", user="root") is False
    with pytest.raises(NotEnoughSpaceException):
        await sbx.files.write(f"{d}/huge/huge.bin", bytes(128 << 20))
    assert await sbx.files.exists(f"{d}/huge") is False
    assert (await sbx.commands.run("echo still here")).stdout == "still here\n"


def test_create_default_template_then_run():
    run(_test_create_default_template_then_run())


def test_create_named_template_metadata_envs():
    run(_test_create_named_template_metadata_envs())


def test_list_filters_and_paging():
    run(_test_list_filters_and_paging())


def test_set_timeout():
    run(_test_set_timeout())


def test_pause_then_connect_resumes():
    run(_test_pause_then_connect_resumes())


def test_kill():
    run(_test_kill())


def test_wrong_api_key_is_401():
    run(_test_wrong_api_key_is_401())


def test_unknown_sandbox_is_404():
    run(_test_unknown_sandbox_is_404())


def test_unknown_template_404_malformed_400():
    run(_test_unknown_template_404_malformed_400())


def test_snapshot_create_from_snapshot_and_fork():
    run(_test_snapshot_create_from_snapshot_and_fork())


def test_commands_stdout_stderr_exit(sbx):
    run(_test_commands_stdout_stderr_exit(sbx))


def test_commands_envs_cwd_user(sbx):
    run(_test_commands_envs_cwd_user(sbx))


def test_commands_streaming_callbacks(sbx):
    run(_test_commands_streaming_callbacks(sbx))


def test_commands_background_list_connect_kill(sbx):
    run(_test_commands_background_list_connect_kill(sbx))


def test_commands_stdin(sbx):
    run(_test_commands_stdin(sbx))


def test_pty_create_input_resize_kill(sbx):
    run(_test_pty_create_input_resize_kill(sbx))


def test_files_crud(sbx, d):
    run(_test_files_crud(sbx, d))


def test_files_large_binary(sbx, d):
    run(_test_files_large_binary(sbx, d))


def test_files_watch_dir_recursive(sbx, d):
    run(_test_files_watch_dir_recursive(sbx, d))


def test_files_signed_urls(sbx, d):
    run(_test_files_signed_urls(sbx, d))


def test_bad_input(sbx, d):
    run(_test_bad_input(sbx, d))
