"""Tutorial 07 (CUDA graphs) shows both runtime modes and the padding.

``docs/cuda_graphs_backends.md`` and ``docs/tutorials/07_cuda_graphs.md`` embed
``docs/generated/07_cuda_graphs.txt``; ``tests/test_tutorial_pages.py`` keeps that file
equal to what the script prints (regenerate it with
``python tutorials/regenerate_golden.py 07``). The printout depends only on the schedule
(token ids are given, EOS is ignored), not on the random weights. The script runs once
per session: the output is shared with that test.
"""

import pytest
from tutorial_runner import tutorial_output as run_once


@pytest.fixture(scope="module")
def tutorial_output() -> str:
    return run_once("07_cuda_graphs.py")


@pytest.mark.seed("000:dispatcher", "000:wrapper", "000:motivation")
@pytest.mark.slow
def test_cudagraph_tutorial_shows_piecewise_full_and_padding(tutorial_output):
    rows = [line.split("|") for line in tutorial_output.splitlines() if line[:4].strip().isdigit()]
    cells = [[c.strip() for c in row] for row in rows]
    modes = {c[4] for c in cells}
    assert modes == {"PIECEWISE", "FULL"}, modes
    for step, batch, tokens, uniform, mode, desc, padding in cells:
        assert (mode == "FULL") == (uniform == "yes"), f"step {step}: uniform {uniform} ran {mode}"
        padded = int(desc.strip("()").split(",")[0])
        assert padded - int(tokens) == int(padding) >= 0, f"step {step}: {desc} for {tokens} tokens"
        assert padded in (1, 2, 4, 8, 16)
    assert any(int(c[6]) > 0 for c in cells), "no step shows padding"
    assert "tokens equal eager (NONE) execution: yes" in tutorial_output
