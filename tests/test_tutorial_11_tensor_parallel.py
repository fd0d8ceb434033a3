"""Tutorial 11 splits layer 0 of the shipped model over two gloo ranks: this test pins the
facts its page relies on.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/11_tensor_parallel.txt``; here the lines are checked against the rule
(``distributed/utils.py``): the refused sizes carry the rule's own message, every split
dimension is halved on each rank and the two ranks' slices tile it, each rank reads half of
the tensors' values, and every collective result equals the layer computed whole. The script
runs once per session: the output is shared with that test.
"""

import re

import pytest

from tinyvllm.distributed.utils import check_tensor_parallel_size
from tinyvllm.models.loader import load_model_spec
from tinyvllm.stdlib_tiny import STDLIB_TINY
from tutorial_runner import tutorial_output


@pytest.mark.slow
def test_tutorial_11_tensor_parallel_splits_one_layer_over_two_ranks():
    out = tutorial_output("11_tensor_parallel.py")
    spec = load_model_spec(STDLIB_TINY)
    h, hkv, inter = spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
    for n in (3, 5):  # the refused sizes print the rule's own one-line error
        with pytest.raises(ValueError) as error:
            check_tensor_parallel_size(n, h, hkv, inter)
        assert f"{n:2d} | refused: {error.value}" in out
    assert re.search(rf"^ 4 \| +{h // 4} \| 0 0 1 1 \(replicated\)", out, re.M), "4 ranks replicate the 2 KV heads"
    ranks = re.findall(r"^rank (\d): query heads (\d)-(\d), KV head (\d), intermediate columns (\d+)-(\d+)", out, re.M)
    (r0, a0, a1, k0, i0, i1), (r1, b0, b1, k1, j0, j1) = [tuple(map(int, r)) for r in ranks]
    assert (r0, r1) == (0, 1), ranks
    assert (a0, a1 + 1, b1 + 1) == (0, b0, h), "the two ranks' query heads tile [0, H)"
    assert (i0, i1 + 1, j1 + 1) == (0, j0, inter), "the two ranks' intermediate columns tile [0, I)"
    assert (k0, k1) == (0, 1), "each rank holds one of the two KV heads"
    assert out.count("(0.50)") == 2, "each rank reads half of the values"
    d, hidden = spec.head_dim, spec.hidden_size
    for name, part in [("q_proj", [h // 2 * d, hidden]), ("k_proj", [hkv // 2 * d, hidden]),
                       ("o_proj", [hidden, h // 2 * d]), ("gate_proj", [inter // 2, hidden]),
                       ("down_proj", [hidden, inter // 2]), ("embed_tokens", [spec.vocab_size // 2, hidden])]:  # fmt: skip
        shapes = re.findall(rf"^  {name} +(\[[\d, ]+\]) +of (\[[\d, ]+\])$", out, re.M)
        assert len(shapes) == 2 and {s[0] for s in shapes} == {str(part)}, (name, shapes)
    assert out.count("o_proj's partial sum [5, 256]") == 2 and out.count("down_proj's partial sum [5, 256]") == 2
    embedded = [int(n) for n in re.findall(r"embedding: (\d) of the ids", out)]
    assert sum(embedded) == 5 and len(embedded) == 2, "every id is found on exactly one rank"
    checks = out.split("against the layer computed whole", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(checks) == 5 and all(line.rstrip().endswith(("yes", "yes, exactly")) for line in checks), checks


@pytest.mark.slow
def test_tutorial_11_runs_the_engine_with_two_ranks():
    out = tutorial_output("11_tensor_parallel.py")
    tokens = dict(re.findall(r"^  tensor_parallel_size=(\d): (\[[\d, ]+\])$", out, re.M))
    assert set(tokens) == {"1", "2"} and tokens["1"] == tokens["2"], out.split("LLM, greedy", 1)[-1]
    assert "the same tokens: yes" in out
