"""Start a real ``tinyvllm`` OpenAI server on 127.0.0.1 (a free port) in a thread of the test
process, and stop it: what the serving tests and tutorial 08 share."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(llm, served_model_name: str, max_waiting_requests: int = 256):
    """Serve ``llm`` with uvicorn in a daemon thread; yield the base URL (``http://127.0.0.1:PORT``)."""
    import uvicorn

    from tinyvllm.engine.async_llm import AsyncLLM
    from tinyvllm.entrypoints.openai_server import build_app

    async_llm = AsyncLLM(llm, max_waiting_requests=max_waiting_requests)
    app = build_app(async_llm, served_model_name)
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
