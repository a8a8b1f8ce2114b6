"""The code-interpreter template's service: stateful code execution on
Jupyter kernels, served on port 49999 with the HTTP API the E2B
code-interpreter SDKs (@e2b/code-interpreter, e2b-code-interpreter) call.

  GET    /health                  200 once the default context's kernel runs
  POST   /execute                 {code, context_id?, language?, env_vars?}
                                  -> NDJSON stream: stdout, stderr, result,
                                     error, number_of_executions,
                                     end_of_execution
  POST   /contexts                {language?, cwd?} -> {id, language, cwd}
  GET    /contexts                -> [{id, language, cwd}]
  DELETE /contexts/{id}
  POST   /contexts/{id}/restart

Each context is one kernel (jupyter_client's KernelManager): variables,
imports and the working directory persist between executions in it, and
executions in one context run one at a time. A client that goes away in
the middle of an execution interrupts it. Standard library plus
jupyter_client and ipykernel (Debian's python3-jupyter-client and
python3-ipykernel); no web framework.
"""

import json
import os
import queue
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("CUBE_CODE_INTERPRETER_PORT", "49999"))
HOME = os.path.expanduser("~")
LANGUAGES = {"python": "python3"}  # language -> kernel spec name
MIME = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def now():
    return datetime.now(timezone.utc).isoformat()


class Context:
    def __init__(self, language, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.lock = threading.Lock()
        self.km = KernelManager(kernel_name=LANGUAGES[language])
        self.km.start_kernel(cwd=cwd)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self._warm()

    def _warm(self):
        # What most code imports first, loaded before the context counts
        # as ready (E2B's template imports them at kernel start too).
        if self.language == "python":
            self._run_silent("import matplotlib.pyplot, pandas")

    def info(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self):
        with self.lock:
            self._restart_locked()

    def _restart_locked(self):
        self.kc.stop_channels()
        self.km.restart_kernel(now=True)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self._warm()

    def shutdown(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def _run_silent(self, code):
        msg_id = self.kc.execute(code, silent=True, store_history=False)
        self._drain(msg_id, lambda _m: None)

    def _drain(self, msg_id, emit):
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                if not self.km.is_alive():
                    raise KernelDied()
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                return
            emit(msg)

    def execute(self, code, env_vars, emit):
        """Runs code and calls emit with each output message (a dict); emit
        raising (the client went away) interrupts the kernel."""
        with self.lock:
            if env_vars:
                self._run_silent(
                    "import os as _cube_os\n"
                    f"_cube_saved_env = {{k: _cube_os.environ.get(k) for k in {list(env_vars)!r}}}\n"
                    f"_cube_os.environ.update({dict(env_vars)!r})\n"
                )
            msg_id = self.kc.execute(code, store_history=True, allow_stdin=False)
            gone = False

            def out(msg):
                nonlocal gone
                if gone:
                    return
                ev = translate(msg)
                if ev is None:
                    return
                try:
                    emit(ev)
                except OSError:
                    gone = True
                    self.km.interrupt_kernel()

            try:
                self._drain(msg_id, out)
            except KernelDied:
                # The code ended the kernel (os._exit, a crash): say so,
                # and give the context a fresh kernel for the next run.
                out_err = {"type": "error", "name": "KernelDied", "traceback": "",
                           "value": "the kernel exited while running this code; it was restarted and its state is lost"}
                if not gone:
                    try:
                        emit(out_err)
                    except OSError:
                        gone = True
                self._restart_locked()
                env_vars = None
            finally:
                if env_vars:
                    self._run_silent(
                        "for _k, _v in _cube_saved_env.items():\n"
                        "    _cube_os.environ.pop(_k, None) if _v is None else _cube_os.environ.__setitem__(_k, _v)\n"
                        "del _cube_saved_env\n"
                    )
            if not gone:
                emit({"type": "end_of_execution"})


def translate(msg):
    t, c = msg["msg_type"], msg["content"]
    if t == "stream":
        return {"type": "stdout" if c.get("name") == "stdout" else "stderr", "text": c.get("text", ""), "timestamp": now()}
    if t in ("execute_result", "display_data"):
        res = {"type": "result", "is_main_result": t == "execute_result"}
        extra = {}
        for mime, value in c.get("data", {}).items():
            if mime in MIME:
                res[MIME[mime]] = value
            else:
                extra[mime] = value
        if extra:
            res["extra"] = extra
        return res
    if t == "error":
        return {"type": "error", "name": c.get("ename", ""), "value": c.get("evalue", ""), "traceback": "\n".join(c.get("traceback", []))}
    if t == "execute_input":
        return {"type": "number_of_executions", "execution_count": c.get("execution_count", 0)}
    return None


class Contexts:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_id = {}
        self.default = {}

    def create(self, language, cwd):
        ctx = Context(language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default_for(self, language):
        with self.lock:
            ctx = self.default.get(language)
        if ctx is None:
            ctx = self.create(language, HOME)
            with self.lock:
                ctx = self.default.setdefault(language, ctx)
        return ctx

    def get(self, cid):
        with self.lock:
            return self.by_id.get(cid)

    def remove(self, cid):
        with self.lock:
            ctx = self.by_id.pop(cid, None)
            for lang, d in list(self.default.items()):
                if d is ctx:
                    del self.default[lang]
        if ctx:
            ctx.shutdown()
        return ctx is not None

    def all(self):
        with self.lock:
            return list(self.by_id.values())


CONTEXTS = Contexts()
READY = threading.Event()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "cube-code-interpreter"

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n == 0:
            return {}
        try:
            data = json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            raise BadRequest("the body is not JSON")
        if not isinstance(data, dict):
            raise BadRequest("the body is not a JSON object")
        return data

    def _send(self, status, body, ctype="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, message):
        self._send(status, {"error": message, "message": message})

    def _route(self, method):
        try:
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            parts = path.strip("/").split("/")
            if method == "GET" and path == "/health":
                if READY.is_set():
                    return self._send(200, b"OK", "text/plain")
                return self._send(503, b"starting", "text/plain")
            if method == "POST" and path == "/execute":
                return self._execute(self._body())
            if path == "/contexts" and method == "POST":
                body = self._body()
                lang = body.get("language") or "python"
                if lang not in LANGUAGES:
                    return self._error(400, f"language {lang!r} is not supported (this template has: {', '.join(LANGUAGES)})")
                ctx = CONTEXTS.create(lang, body.get("cwd") or HOME)
                return self._send(200, ctx.info())
            if path == "/contexts" and method == "GET":
                return self._send(200, [c.info() for c in CONTEXTS.all()])
            if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
                if not CONTEXTS.remove(parts[1]):
                    return self._error(404, f"context {parts[1]} not found")
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
                ctx = CONTEXTS.get(parts[1])
                if ctx is None:
                    return self._error(404, f"context {parts[1]} not found")
                ctx.restart()
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            return self._error(404, f"{method} {path}: no such endpoint")
        except BadRequest as e:
            return self._error(400, str(e))

    def _execute(self, body):
        code = body.get("code")
        if not isinstance(code, str):
            return self._error(400, "code is required")
        cid, lang = body.get("context_id"), body.get("language")
        if cid and lang:
            return self._error(400, "context_id and language are mutually exclusive")
        if cid:
            ctx = CONTEXTS.get(cid)
            if ctx is None:
                return self._error(404, f"context {cid} not found")
        else:
            lang = lang or "python"
            if lang not in LANGUAGES:
                return self._error(400, f"language {lang!r} is not supported (this template has: {', '.join(LANGUAGES)})")
            ctx = CONTEXTS.default_for(lang)
        env = body.get("env_vars") or {}
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(ev):
            line = json.dumps(ev).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        ctx.execute(code, env, emit)
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_DELETE(self):
        self._route("DELETE")


class BadRequest(Exception):
    pass


class KernelDied(Exception):
    pass


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that went away (the SDK's timeout, a health probe's
        # limit) is not an error worth a traceback.
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        super().handle_error(request, client_address)


def main():
    srv = Server(("0.0.0.0", PORT), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    # The default context's kernel starts before /health says ready: the
    # first execution then pays no kernel start.
    t0 = time.monotonic()
    CONTEXTS.default_for("python")
    READY.set()
    sys.stderr.write(f"code interpreter on :{PORT}, default python kernel up in {time.monotonic() - t0:.2f}s\n")
    threading.Event().wait()


if __name__ == "__main__":
    main()
