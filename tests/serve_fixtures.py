"""Start a real ``tinyvllm`` OpenAI server on 127.0.0.1 (a free port) in a thread of the test
process, and stop it: what the serving tests and tutorial 08 share.

``require_serve_extra()`` guards what needs the serve extra (fastapi, uvicorn,
prometheus_client, and the tests' clients openai and httpx). Called at the top of a test
module, before the module's own imports of them, it skips the module at collection when one
is missing, as on the GPU machine, where ``pytest -m gpu`` must still collect; with
``TINYVLLM_REQUIRE_SERVE=1`` (``.ci/run``'s main run) a missing one is a collection error
instead, so a broken CI venv cannot hide the serving tests as skips.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx")
INSTALL_SERVE = "pip install -e '.[serve]'"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def require_serve_extra() -> None:
    """Skip the calling test module (or test) unless every package of ``SERVE_PACKAGES`` imports;
    fail instead when ``TINYVLLM_REQUIRE_SERVE=1``."""
    __tracebackhide__ = True  # pytest reports the skip or failure at the caller's line, not here
    required = os.environ.get("TINYVLLM_REQUIRE_SERVE") == "1"
    for name in SERVE_PACKAGES:
        reason = f"needs {name} (the serve extra: {INSTALL_SERVE})"
        if not required:
            pytest.importorskip(name, reason=reason)
            continue
        try:
            importlib.import_module(name)
        except ImportError as error:
            problem = str(error)
        else:
            continue
        pytest.fail(f"TINYVLLM_REQUIRE_SERVE=1 but {name} does not import ({problem}); {INSTALL_SERVE}", pytrace=False)


def imports_serve_packages(script: Path) -> bool:
    """Whether ``script`` imports, anywhere in it, a package of the serve extra or ``tinyvllm.entrypoints``."""
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"), str(script))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            if module.partition(".")[0] in SERVE_PACKAGES or module.startswith("tinyvllm.entrypoints"):
                return True
    return False


def slow_steps(monkeypatch, llm, seconds: float) -> None:
    """Make every engine step last at least ``seconds``, so a request is still running when the test looks."""
    runner = llm.engine.model_runner
    execute = runner.execute_model

    def slow(scheduler_output):
        time.sleep(seconds)
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", slow)


def aborts_when_the_client_leaves(monkeypatch, url: str, llm, body: dict, step_s: float = 0.6) -> list:
    """POST ``body`` to ``url`` with steps of ``step_s`` and a client that leaves after half a
    step; wait until the engine is empty. Returns the ids the server aborted, call by call."""
    import httpx  # the serve extra's (this module is imported without it too)

    slow_steps(monkeypatch, llm, step_s)
    aborted = []
    abort = llm.engine.abort_request
    monkeypatch.setattr(llm.engine, "abort_request", lambda ids: (aborted.append(ids), abort(ids))[1])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=step_s / 2)
    deadline = time.monotonic() + 10
    while (llm.engine.has_unfinished_requests() or not aborted) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()
    return aborted


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, alive, seconds: float, why_not=lambda: "") -> None:
    """Poll ``url + "/health"`` until it answers 200; fail when ``alive()`` turns False (the
    server's process or thread ended: ``why_not()`` says why) or after ``seconds``."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert alive(), why_not()
        assert time.monotonic() < deadline, f"the server did not start in {seconds:g} s"
        time.sleep(0.1)


@contextlib.contextmanager
def running_server(llm, served_model_name: str, max_waiting_requests: int = 256, **app_options):
    """Serve ``llm`` with uvicorn in a daemon thread; yield the base URL (``http://127.0.0.1:PORT``)
    and the app. ``app_options`` go to ``build_app`` (``chat_template``, ``api_key``, ...)."""
    import uvicorn

    from tinyvllm.engine.async_llm import AsyncLLM
    from tinyvllm.entrypoints.openai_server import build_app

    async_llm = AsyncLLM(llm.engine, max_waiting_requests=max_waiting_requests)
    app = build_app(async_llm, served_model_name, **app_options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
