"""The quickstart page (``docs/quickstart.md``) runs as written and shows what it prints.

- its install command is the README's;
- every ``tinyvllm ...`` line of its bash blocks runs through ``cli.main`` and returns 0
  (from a temporary folder, so the trace's ``trace.html`` lands there);
- the ``generate`` line prints the completion in ``docs/generated/quickstart_generate.txt``
  (seeded, so the same tokens on every run; the last line, the timings, is not compared);
- its Python is the body of ``quickstart_llm`` (the page includes it by marker), and
  ``test_quickstart_llm_prints_the_golden_output`` checks that it prints ``docs/generated/quickstart_llm.txt``;
- the ``trace`` line writes the viewer of the seed 002 worked example, seven steps.

The golden files are CPU runs (a GPU computes in another dtype and may pick other
tokens): with CUDA present the two outputs are checked for shape only. After a deliberate
change to what they print, rewrite them with ``python tests/test_docs_quickstart.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart.md"
GENERATE_GOLDEN = ROOT / "docs" / "generated" / "quickstart_generate.txt"
LLM_GOLDEN = ROOT / "docs" / "generated" / "quickstart_llm.txt"
REWRITE = "python tests/test_docs_quickstart.py"


def _bash_lines() -> list[str]:
    """The command lines of the page's ```bash blocks."""
    blocks = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def _tinyvllm_commands() -> list[list[str]]:
    return [shlex.split(line)[1:] for line in _bash_lines() if line.startswith("tinyvllm ")]


@pytest.fixture
def restore_torch_threads(monkeypatch):
    """The engine sets torch's thread count for the process (cpu_threads.py): put it back.
    ``OMP_NUM_THREADS`` unset, so the shipped model runs on one thread, as the golden files did."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _on_cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def _generate_completion(argv: list[str], capsys) -> str:
    from tinyvllm import cli

    assert cli.main(argv) == 0, argv
    completion, figures = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert figures.startswith("[tinyvllm] prompt "), figures
    return completion + "\n"


def test_quickstart_install_command_is_the_readmes():
    installs = [line for line in _bash_lines() if "pip install" in line]
    assert installs, "docs/quickstart.md shows no install command"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for line in installs:
        assert line in readme, f"the README does not show the quickstart's install command: {line}"


def test_quickstart_shows_generate_and_trace_commands():
    assert [argv[0] for argv in _tinyvllm_commands()] == ["generate", "trace"]


def test_quickstart_commands_run_and_generate_prints_the_golden_completion(tmp_path, monkeypatch, capsys, restore_torch_threads):
    from tinyvllm import cli

    monkeypatch.chdir(tmp_path)
    for argv in _tinyvllm_commands():
        if argv[0] == "generate":
            completion = _generate_completion(argv, capsys)
            if _on_cpu_only():
                expected = GENERATE_GOLDEN.read_text(encoding="utf-8")
                assert completion == expected, f"`tinyvllm {shlex.join(argv)}` printed other text; if intended, run {REWRITE}"
            else:
                assert completion.strip()
        else:
            assert cli.main(argv) == 0, argv
            printed = capsys.readouterr().out
            assert printed.startswith("[tinyvllm] 7 steps of "), printed  # steps 0-6 of seed 002 §3.2
            html = (tmp_path / "trace.html").read_text(encoding="utf-8")
            assert html.startswith("<!doctype html>") and html.count("<svg") >= 7


def quickstart_llm() -> None:
    """The page's Python, as the page shows it (it includes the lines between the markers)."""
    # --8<-- [start:llm]
    from tinyvllm import LLM, SamplingParams

    llm = LLM()  # no model named: the shipped stdlib_tiny
    params = SamplingParams(temperature=0.5, top_k=40, repetition_penalty=1.2, max_tokens=24, seed=0)
    for out in llm.generate(["def fibonacci(n):", "import os"], params, use_tqdm=False):
        completion = out.outputs[0]
        print(f"{out.prompt!r} -> {completion.text!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
    # --8<-- [end:llm]


def test_quickstart_llm_prints_the_golden_output(capsys, restore_torch_threads):
    quickstart_llm()
    printed = capsys.readouterr().out
    if _on_cpu_only():
        expected = LLM_GOLDEN.read_text(encoding="utf-8")
        assert printed == expected, f"the quickstart's LLM() call printed other text; if intended, run {REWRITE}"
    else:
        assert len(printed.splitlines()) == 2


def _rewrite() -> None:
    """Rewrite both golden files from a CPU run (``python tests/test_docs_quickstart.py``)."""
    import contextlib
    import io

    import torch

    from tinyvllm import cli

    assert not torch.cuda.is_available(), "the golden files are CPU runs: hide the GPU (CUDA_VISIBLE_DEVICES=)"
    os.environ.pop("OMP_NUM_THREADS", None)  # one thread for the shipped model, as the tests run it
    [argv] = [argv for argv in _tinyvllm_commands() if argv[0] == "generate"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    GENERATE_GOLDEN.write_text(out.getvalue().rstrip("\n").rsplit("\n", 1)[0] + "\n", encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        quickstart_llm()
    LLM_GOLDEN.write_text(out.getvalue(), encoding="utf-8")
    print(f"wrote {GENERATE_GOLDEN.relative_to(ROOT)} and {LLM_GOLDEN.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    _rewrite()
