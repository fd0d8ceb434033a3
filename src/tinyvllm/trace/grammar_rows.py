"""The allowed-token count of each structured row of a step, read from the step's bitmask.

Concept: a step's ``SchedulerOutput`` carries the grammar bitmask of its constrained requests
(``structured_output/manager.py``): ``structured_output_request_ids`` gives each one's first
row of ``grammar_bitmask`` (int32 ``[G, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32`` set
when token ``t`` is allowed), and a request verifying k drafts owns k + 1 rows. A trace keeps,
per scheduled request, the number of tokens each of its rows allows: the set bits below the
vocabulary size. An unconstrained request has none (``None`` in ``ScheduledRequest``).

Follows: issue 40 ("a trace workload that shows the allowed-token count of each structured
row at each step"). Mirrors: nothing in vLLM.

Invariants: a pure function of the step's output: it reads the mask and changes nothing;
``0 <= count <= vocab_size`` for every row.

NOTE 1 (no numpy, no torch): the rows are counted with ``int.bit_count`` over the words as
Python ints, so the trace package keeps importing without torch (``tests/test_trace_recorder.py``);
a step with no mask costs one attribute read.
"""

from __future__ import annotations

from collections.abc import Mapping


def popcount_row(words, vocab_size: int) -> int:
    """Tokens ``0 .. vocab_size - 1`` one mask row allows (its set bits below ``vocab_size``)."""
    count = 0
    for index, word in enumerate(words):
        first = 32 * index
        if first >= vocab_size:
            break
        bits = int(word) & 0xFFFFFFFF  # an int32 word as its 32 bits
        if vocab_size - first < 32:
            bits &= (1 << (vocab_size - first)) - 1
        count += bits.bit_count()
    return count


def allowed_token_counts(scheduler_output, vocab_size: int) -> Mapping[str, tuple[int, ...]]:
    """Each constrained request's allowed-token count per row: ``(sampled position,)``, or one
    per draft position and the bonus position under speculation; {} when the step has no mask."""
    mask = getattr(scheduler_output, "grammar_bitmask", None)
    if mask is None:
        return {}
    drafts = scheduler_output.scheduled_spec_decode_tokens
    counts = {}
    for rid, first in scheduler_output.structured_output_request_ids.items():
        rows = range(first, first + 1 + len(drafts.get(rid, ())))
        counts[rid] = tuple(popcount_row(mask[row].tolist(), vocab_size) for row in rows)
    return counts
