"""Tutorial 06 says its weights are random, round-trips text through the tokenizer,
reuses the shared prefix in whole blocks, and matches transformers.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/06_generate.txt``; this test pins the facts the page relies on. The
script prints no token ids and no text (the tiny tokenizer's BPE training is not
bit-reproducible across ``tokenizers`` builds), so its output is the same everywhere.
The script runs once per session: the output is shared with that test.
"""

from tutorial_runner import tutorial_output

BLOCK_SIZE = 4


def _table(out: str) -> dict[int, dict[str, str]]:
    """The request table as ``{request id: {column: cell}}``."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("request |"))
    columns = [c.strip() for c in lines[header].split("|")]
    rows = {}
    for line in lines[header + 1 :]:
        if "|" not in line:
            break
        cells = dict(zip(columns, (c.strip() for c in line.split("|"))))
        rows[int(cells["request"])] = cells
    return rows


def test_tutorial_06_generate():
    out = tutorial_output("06_generate.py")
    assert "RANDOM weights" in out
    assert "prompt_token_ids are the tokenizer's encoding of the prompt: yes" in out
    assert "text is the tokenizer's decoding of token_ids: yes" in out
    rows = _table(out)
    assert sorted(rows) == [1, 2, 3, 4, 5], rows
    cached = {r: int(row["num_cached_tokens"]) for r, row in rows.items()}
    assert cached[1] == 0 and cached[2] == 0, f"requests 1 and 2 share no earlier prefix, got {cached}"
    for r in (3, 4, 5):
        shared, prompt = int(rows[r]["shared with request 2"]), int(rows[r]["prompt tokens"])
        # a hit is whole blocks of the shared prefix, and never the prompt's last token
        assert cached[r] == min(shared, prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0, (r, rows[r])
    assert rows[5]["prompt tokens"] == rows[2]["prompt tokens"] == rows[5]["shared with request 2"]
    assert all(row["new tokens"] == "12" and row["finish_reason"] == "length" for row in rows.values())
    assert "token ids equal transformers' greedy generate for all 6 requests: yes" in out
