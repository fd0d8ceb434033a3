"""Tutorial 07 (CUDA graphs) runs, shows both runtime modes and the padding, and matches the docs.

``docs/cuda_graphs.md`` embeds ``docs/generated/07_cuda_graphs.txt``; this test keeps that
file equal to what ``tutorials/07_cuda_graphs.py`` prints today. The printout depends only on
the schedule (token ids are given, EOS is ignored), not on the random weights. Regenerate
after a deliberate change with

    PYTHONPATH=src python tutorials/07_cuda_graphs.py > docs/generated/07_cuda_graphs.txt
"""

from pathlib import Path

import pytest
from tutorial_runner import run_tutorial

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "docs" / "generated" / "07_cuda_graphs.txt"


@pytest.fixture(scope="module")
def tutorial_output() -> str:
    return run_tutorial("07_cuda_graphs.py")


def test_cudagraph_tutorial_output_matches_docs(tutorial_output):
    assert tutorial_output == GOLDEN.read_text(encoding="utf-8"), (
        "tutorials/07_cuda_graphs.py prints something other than docs/generated/07_cuda_graphs.txt; "
        "if the change is intended, regenerate the file (see this module's docstring)"
    )


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
