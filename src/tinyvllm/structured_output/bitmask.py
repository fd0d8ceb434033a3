"""The worker's half of structured outputs: the step's grammar bitmask applied to the logits.

Concept: ``apply_grammar_bitmask`` unpacks the mask the engine built (``manager.py``; 32 tokens
per int32 word, xgrammar's layout) and sets every token it does not allow to ``-inf`` in the
constrained rows of the logits, in place, before the sampler runs. Rows of unconstrained
requests are not touched, and a step without a mask does nothing.

Mirrors: ``apply_grammar_bitmask`` in ``vllm/v1/structured_output/utils.py`` (which calls
xgrammar's kernel; the unpacking is plain torch here, so the worker needs no xgrammar).

Invariants: after the call, token ``t`` of a constrained row is ``-inf`` unless bit ``t % 32``
of word ``t // 32`` of its mask row is set; a token past the mask's width (the model's padded
vocabulary beyond the tokenizer's) is never allowed.

NOTE 1 (before the sampler, so before logprobs): as in vLLM's runner, the mask edits the logits
the sampler receives. Everything the sampler does after (logprobs from these logits, allowed ids,
bad words, penalties, temperature, top-k/p, seeds) composes with it, and the logprobs of a
constrained row give its disallowed tokens ``-inf`` (``sample/sampler.py``'s order, step 0).
NOTE 2 (rows): the runner says which logits row each mask row belongs to: row ``r`` of a plain
step, rows ``r .. r + k`` of a request verifying k drafts.
NOTE 3 (in place): the constrained rows of the logits are most often one run of rows (every
request constrained, or the constrained ones side by side), and the mask's rows are in their
order: then the mask is applied to that slice in place, with no copy of the mask's rows nor a
gather and scatter of the logits' (the bench of ``bench/structured_outputs.py`` measures it).
Other layouts take the gather and scatter; both give the same logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from tinyvllm.core.sched_output import SchedulerOutput
from tinyvllm.device_syncs import upload


# --8<-- [start:apply]
def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[G, W]`` int32 words -> ``[G, vocab_size]`` bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # [G, 32 W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)  # tokens past the mask: never allowed


def grammar_rows(
    scheduler_output: SchedulerOutput, req_ids: Sequence[str], first_logits_row: Mapping[str, int] | None = None
) -> tuple[list[int], list[int]]:
    """NOTE 2: (mask rows, logits rows) of the step's constrained requests. ``first_logits_row``
    gives each request's first logits row (drafts); by default row ``i`` is ``req_ids[i]``."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    mask_rows: list[int] = []
    logits_rows: list[int] = []
    for index, rid in enumerate(req_ids):
        first = scheduler_output.structured_output_request_ids.get(rid)
        if first is None:
            continue
        n = 1 + len(spec.get(rid, ()))
        start = index if first_logits_row is None else first_logits_row[rid]
        mask_rows.extend(range(first, first + n))
        logits_rows.extend(range(start, start + n))
    return mask_rows, logits_rows


def apply_grammar_bitmask(
    scheduler_output: SchedulerOutput, req_ids: Sequence[str], logits: torch.Tensor,
    first_logits_row: Mapping[str, int] | None = None,
) -> None:  # fmt: skip
    """Mask ``logits`` ``[R, V]`` in place with the step's grammar bitmask (NOTE 1)."""
    if scheduler_output.grammar_bitmask is None:
        return
    mask_rows, logits_rows = grammar_rows(scheduler_output, req_ids, first_logits_row)
    if not logits_rows:
        return
    words = scheduler_output.grammar_bitmask  # [G, W]
    if mask_rows != list(range(words.shape[0])):
        words = np.ascontiguousarray(words[mask_rows])  # NOTE 3: only when not every row in the mask's order
    allowed = unpack_bitmask(upload(torch.from_numpy(words), torch.int32, logits.device), logits.shape[1])  # [G, V]
    refused = ~allowed
    start, num_rows = logits_rows[0], len(logits_rows)
    if logits_rows == list(range(start, start + num_rows)):  # NOTE 3: one slice, written in place
        logits[start : start + num_rows].masked_fill_(refused, float("-inf"))
    else:
        at = upload(logits_rows, torch.int64, logits.device)  # [G]
        logits[at] = logits[at].masked_fill(refused, float("-inf"))
# --8<-- [end:apply]
