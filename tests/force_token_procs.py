"""A custom logits processor for the tests that load one: ``Outer.ForceToken`` forces
``extra_args["force_token"]`` for the requests that set it (``vllm_xargs`` over HTTP).

Nested in ``Outer`` so that loading it by name exercises a dotted qualname
(``force_token_procs:Outer.ForceToken``, seed 001 ch. 11's FQCN form).
"""

from __future__ import annotations

from tinyvllm.sample.logits_processors.interface import LogitsProcessor
from tinyvllm.sample.logits_processors.state import process_dict_updates


class Outer:
    class ForceToken(LogitsProcessor):
        """Forces ``extra_args["force_token"]`` for the requests that set it."""

        @classmethod
        def validate_params(cls, params):
            token = (params.extra_args or {}).get("force_token")
            if token is not None and (not isinstance(token, int) or token < 0):
                raise ValueError(f"extra_args['force_token'] must be a token id >= 0, got {token!r}")

        def __init__(self, config, device, is_pin_memory):
            self.rows = {}

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            process_dict_updates(self.rows, batch_update, lambda params, _p, _o: (params.extra_args or {}).get("force_token"))

        def apply(self, logits):
            for row, token in self.rows.items():
                logits[row] = float("-inf")
                logits[row, token] = 0.0
            return logits


def force_plan(value) -> dict[int, int]:
    """``extra_args["force_at"]``, ``"position:token,..."`` (a string: ``vllm_xargs`` holds no
    lists), as ``{output position: token id}``."""
    if not isinstance(value, str):
        raise ValueError(f"extra_args['force_at'] must be a string 'position:token,...', got {value!r}")
    plan = {}
    for item in value.split(","):
        position, _, token = item.partition(":")
        if not (position.isdigit() and token.isdigit()):
            raise ValueError(f"extra_args['force_at']: {item!r} is not 'position:token'")
        plan[int(position)] = int(token)
    return plan


class ForceAt(LogitsProcessor):
    """Forces, for the requests that set ``extra_args["force_at"]``, each listed token at its
    output position (0: the first generated token); the model chooses the others. The tests
    of reasoning outputs write think sections with it."""

    @classmethod
    def validate_params(cls, params):
        value = (params.extra_args or {}).get("force_at")
        if value is not None:
            force_plan(value)

    def __init__(self, config, device, is_pin_memory):
        self.rows = {}  # row -> (plan, the request's live output list)

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        def new_state(params, _prompt, output):
            value = (params.extra_args or {}).get("force_at")
            return None if value is None else (force_plan(value), output)

        process_dict_updates(self.rows, batch_update, new_state)

    def apply(self, logits):
        for row, (plan, output) in self.rows.items():
            token = plan.get(len(output))
            if token is not None:
                logits[row] = float("-inf")
                logits[row, token] = 0.0
        return logits
