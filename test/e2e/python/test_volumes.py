# Volumes through the unmodified E2B Python SDK (Volume.create/list/
# get_info/destroy, Sandbox.create(volume_mounts=...)): a file written in
# one sandbox is read in the next, a volume's size is its limit, one
# sandbox holds a volume at a time, a volume in use is not deleted, and
# another team sees none of it. Run by run.sh under the system harness,
# which sets CUBE_E2E_TEAM_A_KEY and CUBE_E2E_TEAM_B_KEY.
import os

import httpx
import pytest
from e2b import (
    CommandExitException,
    Sandbox,
    SandboxException,
    Volume,
    VolumeNotFoundException,
)

from conftest import TAG, TEMPLATE

A = {"api_key": os.environ.get("CUBE_E2E_TEAM_A_KEY", "")}
B = {"api_key": os.environ.get("CUBE_E2E_TEAM_B_KEY", "")}

sandboxes = []
volumes = []


def make(*args, **kw):
    s = Sandbox.create(*args, **kw)
    sandboxes.append((s.sandbox_id, kw.get("api_key")))
    return s


@pytest.fixture(scope="module", autouse=True)
def cleanup():
    if not (A["api_key"] and B["api_key"]):
        pytest.skip("the system harness gives no team keys")
    yield
    for sid, key in sandboxes:
        try:
            Sandbox.kill(sid, api_key=key)
        except Exception:
            pass
    for vid in volumes:
        try:
            Volume.destroy(vid, **A)
        except Exception:
            pass


def new_volume(name, size_mib=None):
    if size_mib is None:
        v = Volume.create(name, **A)
        volumes.append(v.volume_id)
        return v
    # sizeMiB is cube's extension of NewVolume: the SDK sends only the name.
    r = httpx.post(
        os.environ["E2B_API_URL"] + "/volumes",
        headers={"X-API-Key": A["api_key"]},
        json={"name": name, "sizeMiB": size_mib},
    )
    assert r.status_code == 201, r.text
    body = r.json()
    volumes.append(body["volumeID"])
    return Volume.connect(body["volumeID"], **A)


def test_volume_persists_across_sandboxes():
    vol = new_volume(f"{TAG}-data")
    assert vol.token, "the create hands out a token"
    assert any(v.volume_id == vol.volume_id and v.name == vol.name for v in Volume.list(**A))
    assert Volume.get_info(vol.volume_id, **A).name == vol.name

    a = make(TEMPLATE, volume_mounts={"/mnt/data": vol}, **A)
    a.files.write("/mnt/data/hello.txt", "written by A")
    a.commands.run("mkdir -p /mnt/data/dir && echo nested > /mnt/data/dir/n.txt")
    assert a.files.read("/mnt/data/hello.txt") == "written by A"

    # One sandbox at a time: a second one mounting the volume is refused,
    # and so is deleting the volume while A has it.
    with pytest.raises(SandboxException, match="mounted by sandbox"):
        make(TEMPLATE, volume_mounts={"/mnt/data": vol.name}, **A)
    with pytest.raises(Exception, match="mounted by sandbox"):
        Volume.destroy(vol.volume_id, **A)

    Sandbox.kill(a.sandbox_id, **A)

    # By name, at another path: B reads what A wrote.
    b = make(TEMPLATE, volume_mounts={"/data": vol.name}, **A)
    assert Sandbox.get_info(b.sandbox_id, **A).volume_mounts == [{"name": vol.name, "path": "/data"}]
    assert b.files.read("/data/hello.txt") == "written by A"
    assert b.commands.run("cat /data/dir/n.txt").stdout.strip() == "nested"
    Sandbox.kill(b.sandbox_id, **A)

    assert Volume.destroy(vol.volume_id, **A) is True
    volumes.remove(vol.volume_id)
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id, **A)
    assert not any(v.volume_id == vol.volume_id for v in Volume.list(**A))
    assert Volume.destroy(vol.volume_id, **A) is False


def test_volume_size_is_its_limit():
    vol = new_volume(f"{TAG}-small", size_mib=8)
    s = make(TEMPLATE, volume_mounts={"/small": vol}, **A)
    # Control: the same write to the sandbox's own disk succeeds, so what
    # stops it below is the volume's size.
    s.commands.run("dd if=/dev/zero of=/tmp/big bs=1M count=16")
    s.commands.run("dd if=/dev/zero of=/small/fits bs=1M count=2")
    with pytest.raises(CommandExitException) as e:
        s.commands.run("dd if=/dev/zero of=/small/big bs=1M count=16")
    print("write past the volume's capacity:", e.value.stderr.strip())
    assert "No space left" in e.value.stderr
    Sandbox.kill(s.sandbox_id, **A)


def test_team_b_cannot_see_or_use_team_a_volume():
    vol = new_volume(f"{TAG}-owned")
    assert not any(v.volume_id == vol.volume_id for v in Volume.list(**B))
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id, **B)
    assert Volume.destroy(vol.volume_id, **B) is False
    # The SDK raises a create's 404 as SandboxException.
    with pytest.raises(SandboxException, match="404: volume .* not found"):
        make(TEMPLATE, volume_mounts={"/v": vol.name}, **B)
    # Controls: team A sees and mounts it.
    assert Volume.get_info(vol.volume_id, **A).name == vol.name
    s = make(TEMPLATE, volume_mounts={"/v": vol.name}, **A)
    s.files.write("/v/ok", "ok")
    Sandbox.kill(s.sandbox_id, **A)
    assert Volume.destroy(vol.volume_id, **A) is True
    volumes.remove(vol.volume_id)
