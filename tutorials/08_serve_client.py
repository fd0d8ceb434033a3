"""Tutorial 08: serve a model over HTTP and talk to it with the ``openai`` client.

Run: ``PYTHONPATH=src python tutorials/08_serve_client.py`` (CPU only; a few seconds).
Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client, openai).

1. Build a tiny Qwen3 with RANDOM weights in a temporary folder, give its tokenizer a
   chat template (the tiny tokenizer has none), and start the OpenAI-compatible server of
   ``tinyvllm serve`` in a thread of this process, on 127.0.0.1 and a free port. The
   command line does the same with ``tinyvllm serve --model DIR``.
2. A completion, greedy, compared with ``LLM.generate`` on a second engine built from the
   same folder.
3. A streamed chat: the pieces arrive one by one and join to the non-streamed answer.
4. Two prompts that share a 30-token prefix: the second reports the shared full blocks in
   ``usage.prompt_tokens_details.cached_tokens``.
5. A bad request: HTTP 400 with OpenAI's error shape, and the server serves on.
6. ``/metrics`` once everything is done: nothing running or waiting, every KV block free.

The output is the same on every machine, so the docs embed it
(``docs/generated/08_serve_client.txt``). Like tutorial 06 it prints no generated text
and no token count of a text prompt (the tiny tokenizer's ids differ between
``tokenizers`` builds): prompts that are counted are given as token ids, every request
asks for a fixed number of tokens (``ignore_eos``), and text is only compared.
Regenerate it with ``python tutorials/regenerate_golden.py 08``.
"""

import os
import socket
import tempfile
import threading
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402

from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.engine.async_llm import AsyncLLM  # noqa: E402
from tinyvllm.entrypoints.openai_server import build_app  # noqa: E402
from tinyvllm.models.tiny import build_tiny_model  # noqa: E402

NAME = "tiny-qwen3"
ENGINE = dict(device="cpu", max_model_len=128, block_size=4)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_TOKENS = 8
SHARED_PREFIX = [(37 * i + 11) % 500 + 5 for i in range(30)]  # 7 full blocks of 4, and 2 tokens
NO_EOS = {"ignore_eos": True}  # vLLM's extra field, through the client's extra_body


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(llm: LLM) -> tuple[uvicorn.Server, str]:
    """What ``tinyvllm serve`` runs, in a thread: AsyncLLM -> FastAPI app -> uvicorn."""
    app = build_app(AsyncLLM(llm.engine), served_model_name=NAME)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(build_tiny_model(os.path.join(tmp, "tiny-qwen3"), "qwen3"))
        llm = LLM(folder, **ENGINE)
        llm.get_tokenizer().chat_template = CHAT_TEMPLATE
        offline = LLM(folder, **ENGINE)  # the reference: same folder, same weights
        server, url = start_server(llm)
        print(f"server up on 127.0.0.1, model tiny Qwen3 with RANDOM weights, served as {NAME!r}")
        client = openai.OpenAI(base_url=url + "/v1", api_key="not-needed")
        print(f"GET /v1/models: {[m.id for m in client.models.list().data]}")

        print("\n1. a completion (greedy), prompt given as text")
        prompt = "def fibonacci(n):"
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body=NO_EOS)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        [ref] = offline.generate(prompt, params, use_tqdm=False)
        print(f"  finish_reason {out.choices[0].finish_reason}, completion_tokens {out.usage.completion_tokens}")
        print(f"  text equals LLM.generate's: {yes(out.choices[0].text == ref.outputs[0].text)}")

        print("\n2. a streamed chat")
        messages = [{"role": "user", "content": "Write a haiku about caches."}]
        stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=NO_EOS)  # fmt: skip
        chunks = list(stream)
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=NO_EOS)  # fmt: skip
        print(f"  first chunk: role {chunks[0].choices[0].delta.role!r}")
        print(f"  the text came in more than one piece: {yes(len(pieces) > 1)}")
        print(f"  the pieces join to the non-streamed answer: {yes(''.join(pieces) == whole.choices[0].message.content)}")
        last = chunks[-1]
        print(f"  last chunk: {len(last.choices)} choices, usage.completion_tokens {last.usage.completion_tokens}")

        print("\n3. two prompts sharing a 30-token prefix (blocks of 4 tokens)")
        for tail in ([300, 301, 302, 303], [77, 78, 79]):
            out = client.completions.create(model=NAME, prompt=SHARED_PREFIX + tail, max_tokens=2, temperature=0,
                                            extra_body=NO_EOS)  # fmt: skip
            print(f"  prompt_tokens {out.usage.prompt_tokens}, cached_tokens {out.usage.prompt_tokens_details.cached_tokens}")

        print("\n4. a bad request")
        try:
            client.completions.create(model=NAME, prompt=prompt, max_tokens=-1)
        except openai.BadRequestError as error:
            body = error.response.json()["error"]
            print(f"  HTTP {error.status_code}, type {body['type']}: {body['message']}")
        again = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=NO_EOS)  # fmt: skip
        print(f"  the next request is served: {yes(again.choices[0].text == ref.outputs[0].text)}")

        print("\n5. GET /metrics (vLLM's names)")
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")):
                print(f"  {line}")
        server.should_exit = True


if __name__ == "__main__":
    main()
