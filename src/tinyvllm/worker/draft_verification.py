"""Verifying a step's drafts in two halves: queued on the device at launch, decided on the host.

Concept: a request that verifies k drafts owns k + 1 logits rows (``model_runner.py`` NOTE 9).
``launch_verification`` queues everything the device does for them: the rows' logits, the
grammar mask, the sampler's draw on each row (``SamplingMetadata.expand``), and the logprobs
of every row of a request that asks (row i's drawn token and its top k); with ``read_later``
the ids and the logprobs start up to the host at once (``async_output.py`` NOTE 1).
``finish_verification`` runs when the step is read back: the one wait, then the rejection
sampler on host lists (``sample/rejection_sampler.py``) and, per request that asks, the
logprobs of the tokens it kept.

Mirrors: the speculative branch of ``vllm/v1/worker/gpu_model_runner.py`` (``_sample`` with
``spec_decode_metadata``, the ``RejectionSampler`` call) and vLLM's async-scheduling split, in
which the host learns how many drafts were kept only when the step is read back.

Invariants: request r's rows are ``firsts[r] .. firsts[r + 1] - 1``; kept token i of a request
is the token its row i drew, and its logprobs are that row's (vLLM's PR #26060); a request
that kept n tokens gets exactly its first n rows' logprobs.

NOTE 1 (why two halves): deciding which drafts were kept needs the drawn ids on the host.
Waiting for them inside the launch would put a wait between a step's sampling and the next
``schedule()``; under async scheduling the wait belongs to the read-back, one step later
(``core/async_scheduler.py`` NOTE 6). The synchronous runner reads back at once: the same two
halves, back to back.
NOTE 2 (logprobs of every row, not of the kept ones): which rows are kept is known only after
the wait; work queued after it would run behind the next step's forward. So every row of a
request that asks gets its logprobs at launch (at most k + 1 rows where it keeps n), and the
read-back keeps the first n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tinyvllm.arith import spec_row_starts
from tinyvllm.device_syncs import upload
from tinyvllm.outputs import LogprobEntry
from tinyvllm.sample import logprobs as logprob_ops
from tinyvllm.sample.logprobs import LogprobsTensors
from tinyvllm.sample.rejection_sampler import rejection_sample
from tinyvllm.structured_output.bitmask import apply_grammar_bitmask
from tinyvllm.worker.async_output import HostIds, logprobs_to_host_early


@dataclass(frozen=True)
class PendingVerification:
    """What the launch left for the read-back: the drawn ids on their way up, and the logprobs
    of each asking request's rows (``asking``: (request row, k), in row order)."""

    host_ids: HostIds  # [sum(k_r + 1)] drawn ids and no-token verdicts
    drafts: tuple[tuple[int, ...], ...]
    logprobs: LogprobsTensors | None  # [sum over asking of k_r + 1] rows (NOTE 2)
    asking: tuple[tuple[int, int], ...]


# --8<-- [start:launch]
def launch_verification(
    model, sampler, hidden: torch.Tensor, num_sched: Sequence[int], drafts: Sequence[tuple[int, ...]], metadata,
    req_ids: Sequence[str], scheduler_output, read_later: bool,
) -> PendingVerification:  # fmt: skip
    """The device's half (NOTE 1): the logits of each request's last ``len(drafts) + 1``
    positions, masked, drawn from row by row; the asking rows' logprobs (NOTE 2)."""
    rows: list[int] = []
    end = 0
    for n, d in zip(num_sched, drafts):
        end += n
        rows.extend(range(end - len(d) - 1, end))  # the last real token's position, then each draft's
    logits = model.compute_logits(hidden[upload(rows, torch.int64, hidden.device)])  # [sum(k_r + 1), V]
    firsts = spec_row_starts(drafts)  # where each request's rows begin in ``logits``
    apply_grammar_bitmask(scheduler_output, req_ids, logits, dict(zip(req_ids, firsts)))
    sampler_output = sampler(logits, metadata.expand(drafts))  # a plain step's steps, row by row; on a copy
    asking = tuple(sorted(metadata.num_logprobs.items()))
    logprobs = None
    if asking:  # NOTE 2: every row of each asking request, with the token the row drew
        lp_rows = upload([i for row, _ in asking for i in range(firsts[row], firsts[row + 1])], torch.int64, logits.device)
        raw = logprob_ops.compute_logprobs(logits[lp_rows])  # [M, V], one pass
        logprobs = logprob_ops.gather_logprobs(raw, sampler_output.sampled_token_ids[lp_rows], max(k for _, k in asking))
        if read_later:
            logprobs = logprobs_to_host_early(logprobs)
    host_ids = HostIds(sampler_output.sampled_token_ids, sampler_output.no_token, read_later, sampler_output.host_ids)
    return PendingVerification(host_ids, tuple(map(tuple, drafts)), logprobs, asking)
# --8<-- [end:launch]


# --8<-- [start:finish]
def finish_verification(
    pending: PendingVerification, req_ids: Sequence[str], complete: Sequence[bool]
) -> tuple[list[list[int] | None], dict[str, list[LogprobEntry]]]:
    """The host's half, at read-back: the tokens each request keeps (None: nothing to sample,
    ``sample/sampler.py`` NOTE 7), and the logprobs of the kept tokens of the requests that ask."""
    ids, no_token = pending.host_ids.get()  # the wait
    tokens = rejection_sample(ids, no_token, pending.drafts)  # the drafts each request keeps, then its own token
    if pending.logprobs is None:
        return tokens, {}
    sizes = [len(pending.drafts[row]) + 1 for row, _ in pending.asking]
    entries = iter(logprob_ops.row_entries(pending.logprobs, [k for (_, k), n in zip(pending.asking, sizes) for _ in range(n)]))
    logprobs: dict[str, list[LogprobEntry]] = {}
    for (row, _), n in zip(pending.asking, sizes):
        mine = [next(entries) for _ in range(n)]
        kept = tokens[row] if complete[row] and tokens[row] is not None else []
        if kept:
            logprobs[req_ids[row]] = mine[: len(kept)]
    return tokens, logprobs
# --8<-- [end:finish]
