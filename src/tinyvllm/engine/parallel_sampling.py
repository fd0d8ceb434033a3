"""ParentRequest: ``SamplingParams.n`` completions of one prompt, as n child requests.

Concept: the engine serves one sequence per request. A request for n completions becomes
n child requests, ``"{i}_{request_id}"`` for i in 0 .. n-1, each with ``n=1`` (and, for a
seeded parent, the seed ``seed + i``), added together. The first child admitted computes the
prompt; its full blocks enter the prefix cache at allocation, so the other children, admitted
in the same step or later, hit them and compute only the prompt's last, partial block: the
prompt is computed once. The parent gathers its children's outputs back into one
``RequestOutput`` whose ``outputs`` hold the n completions, ordered by ``index``.

Mirrors: ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``: ``get_child_info``,
``_get_child_sampling_params``, ``get_outputs``), the child ids and seeds included.

Invariants: ``unfinished`` holds the indices of the children not yet finished; a child's
completion keeps its ``index``; the parent's output is finished exactly when every child is.

NOTE 1 (what each output kind reports): FINAL_ONLY, one output when the last child
finishes, with all n completions. DELTA, an output per child that has news, holding only
that child's new completion part (its ``index`` says which). CUMULATIVE, every completion
so far, each time a child has news.
NOTE 2 (one fails, all fail): a failed step aborts the children it scheduled; their siblings
are aborted with them (``LLMEngine``), so the parent ends with the error instead of
waiting for outputs that will never come.
NOTE 3 (child seeds): ``seed + i``, as vLLM, wrapped into the int64 range that
``SamplingParams.seed`` accepts (``child_seed``), so every accepted seed works with any n:
``2**63 - 1`` gives its second child ``-2**63``.
Left out: ``best_of`` (gone from vLLM V1); beam search is ``beam_search.py``'s.
"""

from __future__ import annotations

import dataclasses

from tinyvllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams
from tinyvllm.validation import INT64_MIN


def child_seed(seed: int, index: int) -> int:
    """``seed + index`` wrapped into int64 (NOTE 3): ``child_seed(2**63 - 1, 1) == -2**63``."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


# --8<-- [start:parent]
class ParentRequest:
    """Fans one request with ``n`` > 1 out into children and gathers their outputs back."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.unfinished: set[int] = set(range(params.n))
        self.completions: dict[int, CompletionOutput] = {}  # index -> the child's latest (CUMULATIVE, FINAL)
        self.first_token_time: float | None = None  # the earliest child's
        self.scheduled_time: float | None = None  # the earliest child's
        self.prompt_logprobs = None  # the first child's, once it has them

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """One completion each; a seeded parent's child ``i`` draws from ``seed + i`` (NOTE 3)."""
        seed = None if self.params.seed is None else child_seed(self.params.seed, index)
        return dataclasses.replace(self.params, n=1, seed=seed)

    def add(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """Child ``index``'s output of this step -> the parent's (NOTE 1), or None."""
        completion = dataclasses.replace(out.outputs[0], index=index)
        if out.finished:
            self.unfinished.discard(index)
        self.completions[index] = completion
        self.first_token_time = _earliest(self.first_token_time, out.metrics.first_token_time)
        self.scheduled_time = _earliest(self.scheduled_time, out.metrics.scheduled_time)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        finished = not self.unfinished
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outputs = [completion] if kind == RequestOutputKind.DELTA else [self.completions[i] for i in sorted(self.completions)]
        metrics = RequestMetrics(
            out.metrics.arrival_time, self.first_token_time, out.metrics.finished_time if finished else None,
            self.scheduled_time,
        )
        return dataclasses.replace(
            out, request_id=self.request_id, outputs=outputs, finished=finished, metrics=metrics,
            prompt_logprobs=out.prompt_logprobs if kind == RequestOutputKind.DELTA else self.prompt_logprobs,
        )  # fmt: skip
# --8<-- [end:parent]
