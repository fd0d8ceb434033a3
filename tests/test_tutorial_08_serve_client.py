"""Tutorial 08 serves a tiny model over HTTP and checks what the ``openai`` client gets:
the offline engine's text, a stream that joins to the whole answer, the shared prefix in
``cached_tokens``, an OpenAI-shaped 400, and an idle server at the end.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/08_serve_client.txt``; this test pins the facts the page relies on.
"""

import pytest
from serve_fixtures import require_serve_extra
from tutorial_runner import tutorial_output

require_serve_extra()  # without the serve extra (the GPU machine) this module skips at collection

BLOCK_SIZE = 4


@pytest.mark.slow
def test_tutorial_08_serve_client():
    out = tutorial_output("08_serve_client.py")
    assert "GET /v1/models: ['tiny-qwen3']" in out
    assert "text equals LLM.generate's: yes" in out
    assert "the pieces join to the non-streamed answer: yes" in out
    assert "first chunk: role 'assistant'" in out
    assert "last chunk: 0 choices, usage.completion_tokens 8" in out
    cached = [line for line in out.splitlines() if "cached_tokens" in line]
    assert [line.split("cached_tokens ")[1] for line in cached] == ["0", str(30 // BLOCK_SIZE * BLOCK_SIZE)]
    assert "HTTP 400, type BadRequestError: max_tokens must be an int >= 1, got -1" in out
    assert "the next request is served: yes" in out
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{model_name="tiny-qwen3"}} 0.0' in out
    assert "NO" not in out.replace("NOTE", "")
