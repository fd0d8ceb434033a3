"""Stop checks: whether a request's last token ends it, and with which finished status.

Concept: the one rule ``Scheduler.update_from_output`` applies after each appended token, kept
apart from the scheduler so that it reads on its own and tests call it directly.

Mirrors: ``vllm/v1/core/sched/utils.py`` (``check_stop``).

Invariants: ``check_stop`` only sets ``status`` (and ``stop_reason``) on the request; it never
touches queues or blocks, which the scheduler frees.
"""

from __future__ import annotations

from tinyvllm.request import Request, RequestStatus


# --8<-- [start:check_stop]
def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status on ``request`` if its last token ends it; True if it does.

    Below ``min_tokens`` outputs only ``max_model_len`` ends a request. Then, in order:
    the EOS token (unless ``ignore_eos``), then a stop token, then length
    (``max_tokens`` outputs or ``max_model_len`` tokens), so a last token that is both a
    stop token and the ``max_tokens``-th reports "stop". This is today's vLLM order; the
    v0.8-era ``check_stop`` tested length first and would report "length".
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens < params.min_tokens:
        # EOS and stop tokens do not count yet (MinTokens masks them in the sampler too);
        # the length limits still do, so max_model_len is never passed.
        if request.num_tokens >= max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
    if not params.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    max_tokens = params.max_tokens  # None: up to the context, which max_model_len caps
    if (max_tokens is not None and request.num_output_tokens >= max_tokens) or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
# --8<-- [end:check_stop]
