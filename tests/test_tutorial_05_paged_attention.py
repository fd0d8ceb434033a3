"""Tutorial 05 prints the block tables, slot mappings and backend checks the docs describe.

``tests/test_tutorial_pages.py`` compares the whole output with
``docs/generated/05_paged_attention.txt``; this test pins the facts the page relies on.
The script runs once per session: the output is shared with that test.
"""

import pytest
from tutorial_runner import tutorial_output


@pytest.mark.seed("003:memory")
def test_tutorial_05_paged_attention():
    out = tutorial_output("05_paged_attention.py")
    assert "kv_cache shape (2, 8, 16, 2, 64)" in out
    # step 1: A's 20 tokens fill block 5 (slots 80..95) then block 2 (32..35); B's go to block 7
    assert "slot_mapping    [80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 32, 33, 34, 35, 112, 113, 114, -1, -1]" in out
    # step 2: A's position 20 is block 2 offset 4 (36); B's 14 tokens run on into block 3 (48)
    assert "slot_mapping    [36, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127, 48, -1, -1]" in out
    assert "logits_indices  [0, 14]" in out
    assert out.count("triton == torch: True") == 2
    assert out.count("max |reference - triton| < 1e-04: True") == 2
    assert out.count("padding rows are zero: True") == 2
