# The unmodified E2B code-interpreter Python SDK (e2b-code-interpreter,
# pinned in requirements.txt), sync and async, against a whole single-node
# cube with the code-interpreter template (docs/templates.md). Needs the
# system harness's -code-interpreter, which imports the template as
# code-interpreter-v1 (the SDK's default) and sets
# CUBE_E2E_CODE_INTERPRETER; skipped without it.
#
#   go run ./test/e2e/node/system -code-interpreter -- bash test/e2e/python/run.sh test_code_interpreter.py
import asyncio
import base64
import os
import re

import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox

pytestmark = pytest.mark.skipif(
    not os.environ.get("CUBE_E2E_CODE_INTERPRETER"), reason="needs the system harness's -code-interpreter"
)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create()  # the SDK's default template, code-interpreter-v1
    yield s
    s.kill()


def test_stdout_stderr_result(sbx):
    out = []
    r = sbx.run_code('import sys\nprint("hello")\nprint("oops", file=sys.stderr)\n40 + 2', on_stdout=lambda m: out.append(m.line))
    assert r.logs.stdout == ["hello\n"] and r.logs.stderr == ["oops\n"]
    assert out == ["hello\n"]
    assert r.text == "42" and r.error is None


def test_state_persists(sbx):
    sbx.run_code("counter = 41\ndef bump():\n    global counter\n    counter += 1\n    return counter")
    assert sbx.run_code("bump()").text == "42"
    assert sbx.run_code("counter").text == "42"


def test_matplotlib_png(sbx):
    r = sbx.run_code('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("squares")\nplt.show()')
    png = next((x.png for x in r.results if x.png), None)
    assert png, f"a PNG result, got {[list(x.formats()) for x in r.results]}"
    data = base64.b64decode(png)
    assert data[:8] == PNG and len(data) > 5000


def test_dataframe_html(sbx):
    r = sbx.run_code('import pandas as pd\npd.DataFrame({"a": [1, 2], "b": ["x", "y"]})')
    assert 'class="dataframe' in r.results[0].html


def test_exception_traceback(sbx):
    errors = []
    r = sbx.run_code("def f():\n    return 1 / 0\nf()", on_error=errors.append)
    assert (r.error.name, r.error.value) == ("ZeroDivisionError", "division by zero")
    # IPython colours its tracebacks (ANSI escapes), as E2B's do.
    tb = re.sub(r"\x1b\[[0-9;]*m", "", r.error.traceback)
    assert "----> 3 f()" in tb and "ZeroDivisionError: division by zero" in tb
    assert len(errors) == 1
    assert sbx.run_code("counter").text == "42"


def test_contexts_and_envs(sbx):
    ctx = sbx.create_code_context(cwd="/tmp")
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    assert sbx.run_code("counter", context=ctx).error.name == "NameError"
    assert any(c.id == ctx.id for c in sbx.list_code_contexts())
    sbx.remove_code_context(ctx)
    assert not any(c.id == ctx.id for c in sbx.list_code_contexts())
    assert sbx.run_code('import os; os.environ.get("GREETING")', envs={"GREETING": "hi"}).text == "'hi'"


def test_kernel_death(sbx):
    ctx = sbx.create_code_context()
    sbx.run_code("lost = 1", context=ctx)
    assert sbx.run_code("import os; os._exit(1)", context=ctx).error.name == "KernelDied"
    assert sbx.run_code("lost", context=ctx).error.name == "NameError"
    assert sbx.run_code("6 * 7", context=ctx).text == "42"
    sbx.remove_code_context(ctx)


def test_async_sdk():
    async def go():
        s = await AsyncSandbox.create()
        try:
            await s.run_code("import matplotlib.pyplot as plt\nv = 7")
            r = await s.run_code("plt.bar(['a', 'b'], [v, 3]); plt.show(); v * 6")
            assert r.text == "42"
            assert any(x.png and base64.b64decode(x.png)[:8] == PNG for x in r.results)
            e = await s.run_code("raise ValueError('bad value')")
            assert (e.error.name, e.error.value) == ("ValueError", "bad value")
            assert "ValueError" in e.error.traceback
        finally:
            await s.kill()

    asyncio.run(go())
