# The domain-mode suite of the Python SDK: run by the system harness in
# domain mode (go run ./test/e2e/node/system -domain -- bash
# test/e2e/compat/run-py.sh e2b==VERSION test/e2e/compat/py), which sets
# E2B_DOMAIN, E2B_API_KEY, SSL_CERT_FILE and CUBE_E2E_TEMPLATE and no URL.
# One line per test goes to $CUBE_E2E_RESULTS, as test/e2e/python's do.
import os
from importlib.metadata import version

import pytest


def pytest_configure(config):
    if not (os.environ.get("CUBE_E2E_DOMAIN_MODE") and os.environ.get("E2B_DOMAIN")) or os.environ.get("E2B_API_URL"):
        raise pytest.UsageError(
            "run through the system harness in domain mode: go run ./test/e2e/node/system -domain -- "
            "bash test/e2e/compat/run-py.sh e2b==VERSION test/e2e/compat/py"
        )


def pytest_runtest_logreport(report):
    out = os.environ.get("CUBE_E2E_RESULTS")
    if not out:
        return
    if report.when != "call" and not (report.when == "setup" and (report.skipped or report.failed)):
        return
    name = report.nodeid.partition("::")[2]
    result = "pass" if report.passed else "skip" if report.skipped else "fail"
    runtime = os.environ.get("CUBE_E2E_RUNTIME", "runc")
    with open(out, "a") as f:
        f.write("\t".join(["e2b (Python)", version("e2b"), "domain (E2B_DOMAIN only)", runtime, name, result]) + "\n")
