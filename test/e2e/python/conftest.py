# Shared by the sync and async suites: the system harness
# (test/e2e/node/system) sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY,
# CUBE_E2E_TEMPLATE (a template the SDK can drive) and CUBE_E2E_RUNTIME.
import os
import time

import pytest

TEMPLATE = os.environ.get("CUBE_E2E_TEMPLATE", "")
RUNTIME = os.environ.get("CUBE_E2E_RUNTIME", "runc")
TAG = f"py-{int(time.time() * 1000)}"


def pytest_configure(config):
    if not (TEMPLATE and os.environ.get("E2B_API_URL") and os.environ.get("E2B_SANDBOX_URL")):
        raise pytest.UsageError(
            "run through the system harness: go run ./test/e2e/node/system -- bash test/e2e/python/run.sh"
        )


def until(what, cond, seconds=10.0):
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.025)


# One line per test to $CUBE_E2E_RESULTS (sdk, version, suite, runtime,
# case, result), from which test/e2e/compat writes docs/compatibility.md.
_SUITES = {
    "test_sync.py": ("e2b (Python)", "e2b", "sync"),
    "test_async.py": ("e2b (Python)", "e2b", "async"),
    "test_volumes.py": ("e2b (Python)", "e2b", "volumes"),
    "test_code_interpreter.py": ("e2b-code-interpreter (Python)", "e2b-code-interpreter", "code interpreter"),
}


def pytest_runtest_logreport(report):
    out = os.environ.get("CUBE_E2E_RESULTS")
    if not out:
        return
    if report.when != "call" and not (report.when == "setup" and (report.skipped or report.failed)):
        return
    path, _, name = report.nodeid.partition("::")
    suite = _SUITES.get(os.path.basename(path))
    if suite is None:
        return
    if suite[2] == "code interpreter" and not os.environ.get("CUBE_E2E_CODE_INTERPRETER"):
        return  # not run on this system (no such template): not a skip
    from importlib.metadata import version

    result = "pass" if report.passed else "skip" if report.skipped else "fail"
    with open(out, "a") as f:
        f.write("\t".join([suite[0], version(suite[1]), suite[2], RUNTIME, name, result]) + "\n")
