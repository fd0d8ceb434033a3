"""Pooler: a prompt's hidden states into one vector, across the chunks of its prefill.

Concept: a pooling engine (``runner="pooling"``) runs the model as a generating one does,
paged KV cache, chunked prefill and all, but reads the final hidden states (after the last
norm) instead of turning them into logits. The pooling type, one per engine, says which
positions make the vector: ``LAST`` the last prompt token's (in a causal model the one
position that has read the whole prompt), ``MEAN`` the mean of all, ``CLS`` the first
token's. Then each request's ``PoolingParams`` finish it by its task: ``embed``, the first
``dimensions`` values, L2-normalised or not (``pooling_params.py`` NOTE 2); ``classify`` and
``score``, a classifier's ``score`` head (``models/classifier.py``) and, unless
``use_activation=False``, the model's activation (NOTE 3).

Mirrors: ``vllm/model_executor/layers/pooler.py`` (``LastPool``, ``MeanPool``, ``CLSPool``,
the embedding head's truncation and normalisation, ``ClassifierPooler``) and vLLM's
per-request pooling states for chunked prefill (``vllm/v1/pool/metadata.py``).

Invariants: a request's vector is made exactly once, in the step whose chunk reaches the end
of its prompt; ``PoolingState`` holds only what its pooling type needs of the chunks before
(MEAN: the running float32 sum; CLS: position 0's state; LAST: nothing), and a chunk that
starts at position 0 (a first admission, or a recompute after preemption) starts it afresh.

NOTE 1 (why a state at all): with chunked prefill a prompt's positions arrive over several
steps, and a step's hidden states are gone after it. MEAN and CLS keep what they need of
each chunk; LAST needs only the final chunk. vLLM keeps each chunk's hidden states and
pools at the end; a running sum is the same mean in O(hidden) memory.
NOTE 2 (precision): the MEAN sum and the embedding head run in float32 whatever the model's
dtype, so a bfloat16 model's MEAN over thousands of positions keeps its low bits.
NOTE 3 (the classifier's finish): the pooled row goes through ``score`` in the model's dtype
(transformers applies it to the last hidden state before anything is cast), then to float32;
softmax, sigmoid or identity as the folder says (``pooling_spec.py`` NOTE 1). ``score`` is the
cross-encoder's task: the same head on a prompt holding both texts, with its own activation.
NOTE 4 (copies, never views of the step's hidden states): under CUDA graphs ``hidden`` is a
graph's output buffer, rewritten by its next replay (``cuda_graph.py`` NOTE 5), so a state
kept across steps (CLS's first row) or a vector handed back (an embedding not normalised
is the row itself) is copied out: ``.float()`` of a float32 row would be the row.
NOTE 5 (token tasks): ``token_embed`` and ``token_classify`` pool nothing (vLLM's ``ALL``),
whatever the engine's pooling type: the state keeps a copy of each chunk's rows and the
step that ends the prompt finishes all of them at once, ``[T, dims]`` or ``[T, num_labels]``
(the activation per row: softmax over a row's labels).
NOTE 6 (step tags, ``pooling_params.py`` NOTE 6): with ``step_tag_id`` a token task keeps, of
each chunk, only the rows of the positions whose prompt token is the tag (``tagged_rows``), so
its state holds those rows alone and the finish sees ``[K, hidden]``, K the tags in the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tinyvllm.config import PoolerConfig
from tinyvllm.pooling_params import TOKEN_TASKS, PoolingModel, PoolingParams


@dataclass
class PoolingState:
    """NOTE 1: what the chunks computed so far left for the vector."""

    total: torch.Tensor | None = None  # MEAN: [hidden] float32, the sum of the positions so far
    first: torch.Tensor | None = None  # CLS: [hidden] float32, position 0's hidden state
    rows: list[torch.Tensor] | None = None  # a token task's: each chunk's [n, hidden], copies (NOTE 5, 6)


# --8<-- [start:head]
def embedding_head(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """The request's finish (``pooling_params.py`` NOTE 2): its first ``dimensions`` values,
    then L2-normalised if it asks. [..., hidden] float32 -> [..., dimensions or hidden] float32
    (a token task's [T, hidden]: each row alike)."""
    if params.dimensions is not None:
        vector = vector[..., : params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
    return vector
# --8<-- [end:head]

# --8<-- [start:tagged_rows]
def tagged_rows(prompt_token_ids: Sequence[int], start: int, num_tokens: int, step_tag_id: int) -> list[int]:
    """NOTE 6: the rows of a chunk of positions ``start .. start + num_tokens - 1`` whose prompt
    token is ``step_tag_id``, counted from the chunk's first."""
    return [i for i, t in enumerate(prompt_token_ids[start : start + num_tokens]) if t == step_tag_id]
# --8<-- [end:tagged_rows]


# NOTE 3: the activations a classifier's folder may ask for, over [num_labels] float32 logits
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda logits: torch.softmax(logits, dim=-1),
    "sigmoid": torch.sigmoid,
    "identity": lambda logits: logits,
}


class Pooler:
    """One engine's pooling type, applied chunk by chunk (module header)."""

    def __init__(
        self,
        config: PoolerConfig,
        classifier: Callable[[torch.Tensor], torch.Tensor] | None = None,  # [R, hidden] -> [R, num_labels] float32
        activations: Mapping[str, str] | None = None,  # task -> ACTIVATIONS key (NOTE 3)
    ) -> None:
        if config.pooling_type is None or config.normalize is None:
            raise ValueError(f"the worker's pooler config must be resolved (engine_args.py NOTE 12), got {config!r}")
        activations = dict(activations or {})
        if not (set(activations) <= {"classify", "score"} and set(activations.values()) <= set(ACTIVATIONS)):
            raise ValueError(f"activations must map classify/score to one of {sorted(ACTIVATIONS)}, got {activations!r}")
        self.pooling_type = config.pooling_type
        self.classifier, self.activations = classifier, activations

    # --8<-- [start:finish]
    def finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """The pooled row ([hidden], the model's dtype or float32; a token task's rows [T, hidden])
        as the request's task wants it (module header): an embedding, or a classifier's label
        scores [num_labels] float32 (a token task's: one per row)."""
        if params.task in ("embed", "token_embed"):
            return embedding_head(vector.to(torch.float32, copy=True), params)  # NOTE 4
        if self.classifier is None:
            raise ValueError(f"task={params.task!r} needs a classifier's score head; this model embeds")
        logits = self.classifier(vector.reshape(-1, vector.shape[-1]))  # NOTE 3: [R, num_labels]
        logits = logits.reshape(*vector.shape[:-1], logits.shape[-1])  # (a [0, hidden] step-tag result: [0, num_labels])
        activation = self.activations["classify" if params.task == "token_classify" else params.task]
        return ACTIVATIONS[activation](logits) if params.use_activation else logits
    # --8<-- [end:finish]

    # --8<-- [start:pool]
    def pool(
        self,
        hidden: torch.Tensor,  # [N_pad, hidden]: the step's final hidden states, rows in order
        params: Sequence[PoolingParams],
        states: Sequence[PoolingState],
        computed: Sequence[int],  # each row's first position this step
        num_scheduled: Sequence[int],
        complete: Sequence[bool],  # the step reaches the end of the row's prompt
        prompts: Sequence[Sequence[int]] = (),  # each row's prompt token ids (read for step tags, NOTE 6)
    ) -> list[torch.Tensor | None]:
        """Fold each row's chunk into its state; a finished row's vector ([dims] float32)."""
        out: list[torch.Tensor | None] = []
        start = 0
        for i, (p, state, c, n, done) in enumerate(zip(params, states, computed, num_scheduled, complete)):
            chunk = hidden[start : start + n]  # [n, hidden]: positions c .. c + n - 1
            start += n
            if p.task in TOKEN_TASKS:  # NOTE 5: every position (NOTE 6: or its step tags')
                keep = None if p.step_tag_id is None else tagged_rows(prompts[i], c, n, p.step_tag_id)
                part = chunk.clone() if keep is None else chunk[torch.tensor(keep, dtype=torch.long, device=chunk.device)]  # a copy
                rows = [part] if c == 0 or state.rows is None else [*state.rows, part]
                state.rows = rows
                out.append(self.finish(torch.cat(rows), p) if done else None)
                continue
            if self.pooling_type == "MEAN":
                part = chunk.float().sum(dim=0)
                state.total = part if c == 0 or state.total is None else state.total + part
            elif self.pooling_type == "CLS" and c == 0:
                state.first = chunk[0].to(torch.float32, copy=True)  # NOTE 4: a copy, never a view of hidden
            if not done:
                out.append(None)
                continue
            if self.pooling_type == "LAST":
                vector = chunk[-1]
            elif self.pooling_type == "MEAN":
                vector = state.total / (c + n)  # every prompt position: no prefix hit (pooling_params.py NOTE 4)
            else:
                vector = state.first
            out.append(self.finish(vector, p))
        return out
    # --8<-- [end:pool]


def make_pooler(model: torch.nn.Module, config: PoolerConfig, pooling_model: PoolingModel) -> Pooler:
    """The worker's pooler for ``model``: a classifier's (``pooling_model.labels`` set) holds its
    ``score`` head (``compute_logits``) and the folder's activations (NOTE 3)."""
    if pooling_model.labels is None:
        return Pooler(config)
    activations = {"classify": pooling_model.classify_activation, "score": pooling_model.score_activation}
    return Pooler(config, model.compute_logits, activations)
