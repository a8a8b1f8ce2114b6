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
