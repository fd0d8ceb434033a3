"""PoolingParams: what one pooling request asks of the pooler, validated at construction.

Concept: the pooling twin of ``SamplingParams``. A pooling engine (``LLM(runner="pooling")``)
runs a prompt once and returns one result made from its hidden states, instead of
continuing it; these are the per-request knobs of that result. How the hidden states become
one vector (last token, mean, first token) is the engine's ``PoolerConfig``, one for every
request, as in vLLM; what a request may change is what happens to that vector after.

Mirrors: ``vllm/pooling_params.py`` (``PoolingParams``: ``dimensions``, ``normalize``,
``use_activation``, ``task``) and the heads of ``vllm/model_executor/layers/pooler.py``.

Fields: ``task`` (NOTE 3; None: the entry point's, ``embed`` / ``classify`` / ``score``),
``dimensions`` (embed only; None: the whole hidden size; k: the first k values, vLLM's
matryoshka truncation, NOTE 1), ``use_activation`` (None: on; embed: L2-normalise after
truncation, NOTE 2; classify and score: the model's activation, ``pooling_spec.py`` NOTE 1),
``normalize`` (embed's older name for it, vLLM's), ``truncate_prompt_tokens`` (NOTE 5),
``step_tag_id`` (the token tasks, NOTE 6); ``skip_reading_prefix_cache`` is the engine's,
set when it resolves the params (NOTE 4).

Invariants: an instance is frozen; ``dimensions`` is None or an int >= 1; ``normalize`` and
``use_activation`` are None or bools and do not contradict each other. Whether the task and
``dimensions`` fit the model needs the model: the input processor checks them
(``resolve_pooling_params``), before anything is queued; resolved params have every field set.

NOTE 1 (dimensions): keeping the first k values is only meaningful for a model trained so
that every prefix of its embedding is an embedding (matryoshka representation learning).
As vLLM, the engine takes ``dimensions`` only from a model whose ``config.json`` says so
(``is_matryoshka`` or ``matryoshka_dimensions``), and at most the hidden size; otherwise a
ValueError naming the value.
NOTE 2 (order): truncate, then normalise, as vLLM's embedding head: a truncated matryoshka
embedding has unit length too.
NOTE 3 (tasks, vLLM's names): a causal LM embeds (``embed``: the pooled hidden state); a
``*ForSequenceClassification`` model classifies (``classify``: its ``score`` head's logits
through softmax or sigmoid) and, with one label, scores a pair of texts joined into one
prompt (``score``: a cross-encoder). The token tasks keep every prompt position instead of
pooling (vLLM's ``ALL``): ``token_embed`` one vector per token (late interaction, as ColBERT),
``token_classify`` one label distribution per token (a process reward model's per-step
scores, token tagging).
NOTE 4 (the prefix cache): a cached block's positions are never computed, so their hidden
states never exist. ``LAST`` reads one position, which the scheduler always computes (a
prompt found whole in the cache still recomputes its last token); ``MEAN`` and ``CLS`` read
positions a hit would skip, so such a request takes no hit (vLLM's
``skip_reading_prefix_cache``), as a request with prompt logprobs takes none; nor does a
token task's, which reads every position.
NOTE 5 (truncation, vLLM's ``truncate_prompt_tokens``): k >= 1 keeps a prompt's last k tokens
(left truncation: a causal model's LAST state then reads the end of the text), -1 keeps the
last ``max_model_len``; the input processor cuts before it checks the length, so a document
longer than the context is embedded from its end instead of refused. A k over
``max_model_len`` is a ValueError naming it.
NOTE 6 (step tags, vLLM's ``STEP`` pooling): a process reward model is given a solution whose
steps each end in a tag token, and its score of a step is its row at that tag. With
``step_tag_id`` a token task keeps only the rows of the prompt positions holding that id, in
order (none: a ``[0, C]`` result); the engine's ``PoolerConfig.step_tag_id`` is the default of
a token task's request. Another task given one is a ValueError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.validation import check_bool, check_optional_int

TOKEN_TASKS = ("token_embed", "token_classify")  # NOTE 3: every position, no pooling
POOLING_TASKS = ("embed", "classify", "score", *TOKEN_TASKS)


def pooling_tasks(num_labels: int | None) -> tuple[str, ...]:
    """NOTE 3: the tasks of a causal LM (None) or of a classifier with ``num_labels`` labels,
    the default first."""
    if num_labels is None:
        return ("embed", "token_embed")
    return ("classify", "score", "token_classify") if num_labels == 1 else ("classify", "token_classify")


@dataclass(frozen=True)
class PoolingModel:
    """What a pooling engine's model does, resolved once (``engine_args.py`` NOTE 12): each
    request is checked against it, and the pooler and ``LLM.score`` read it. The activations
    and ``use_pad_token`` are the folder's (``models/pooling_spec.py`` NOTES 1-2)."""

    hidden_size: int
    tasks: tuple[str, ...] = ("embed",)  # pooling_tasks(num_labels)
    pooling_type: str = "LAST"  # the engine's resolved PoolerConfig
    normalize: bool = True
    matryoshka: bool = False
    classify_activation: str = "softmax"
    score_activation: str = "sigmoid"
    use_pad_token: bool = True
    labels: tuple[str, ...] | None = None  # a classifier's label names by id
    step_tag_id: int | None = None  # the engine's PoolerConfig's: a token task's default (NOTE 6)


@dataclass(frozen=True)
class PoolingParams:
    """How a pooling request's result is finished (module header)."""

    dimensions: int | None = None  # NOTE 1
    normalize: bool | None = None  # NOTE 2: embed's name for use_activation
    use_activation: bool | None = None  # None: on (embed: the engine's PoolerConfig.normalize)
    task: str | None = None  # NOTE 3; None: the entry point's
    truncate_prompt_tokens: int | None = None  # NOTE 5: None, -1 or k >= 1
    skip_reading_prefix_cache: bool = False  # NOTE 4: the engine's, from its pooling type
    step_tag_id: int | None = None  # NOTE 6: a token task's rows at this prompt token only

    def __post_init__(self) -> None:
        object.__setattr__(self, "dimensions", check_optional_int("dimensions", self.dimensions, 1))
        object.__setattr__(self, "step_tag_id", check_optional_int("step_tag_id", self.step_tag_id, 0))
        check_bool("skip_reading_prefix_cache", self.skip_reading_prefix_cache)
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise ValueError(f"normalize={self.normalize} and use_activation={self.use_activation} contradict "
                             "each other: for embed they are one switch (give one)")  # fmt: skip
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {k!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS} or None, got {self.task!r}")


def truncated(label: str, ids: list[int], k: int | None, max_model_len: int | None) -> list[int]:
    """NOTE 5: ``ids`` cut to their last ``k`` (-1: ``max_model_len``; None: as they are)."""
    if k is None:
        return ids
    if max_model_len is not None and k > max_model_len:
        raise ValueError(f"{label}: truncate_prompt_tokens={k} is more than max_model_len {max_model_len}")
    keep = max_model_len if k == -1 else k
    return ids if keep is None else ids[-keep:]


def resolve_pooling_params(label: str, params: PoolingParams, model: PoolingModel) -> PoolingParams:
    """``params`` against the model (NOTES 1, 3), every field filled in: the task (the model's
    first if None), ``use_activation`` (embed: the engine's ``normalize``), and the prefix-cache
    rule of its pooling type (NOTE 4); a ValueError naming ``label`` and the value otherwise."""
    if not isinstance(params, PoolingParams):
        raise TypeError(f"{label} must be PoolingParams, got {params!r}")
    task = model.tasks[0] if params.task is None else params.task
    if task not in model.tasks:
        what = "a causal LM embeds" if "embed" in model.tasks else "a *ForSequenceClassification model classifies"
        raise ValueError(f"{label}: task={task!r} is not one of this model's tasks {model.tasks} ({what}; "
                         "score needs a classifier with one label)")  # fmt: skip
    if params.dimensions is not None:
        if task not in ("embed", "token_embed"):
            raise ValueError(f"{label}: dimensions={params.dimensions} is for embeddings, not task={task!r}")
        if not model.matryoshka:
            raise ValueError(
                f"{label}: dimensions={params.dimensions} needs a matryoshka model (config.json's is_matryoshka or "
                "matryoshka_dimensions): keeping the first values of another model's embedding gives no embedding"
            )
        if params.dimensions > model.hidden_size:
            raise ValueError(f"{label}: dimensions={params.dimensions} is more than the model's hidden size {model.hidden_size}")
    dimensions = None if params.dimensions == model.hidden_size else params.dimensions  # the whole vector: nothing to cut
    chosen = params.use_activation if params.use_activation is not None else params.normalize
    embeds = task in ("embed", "token_embed")
    activation = (model.normalize if embeds else True) if chosen is None else chosen
    normalize = activation if embeds else None
    if params.step_tag_id is not None and task not in TOKEN_TASKS:  # NOTE 6
        raise ValueError(f"{label}: step_tag_id={params.step_tag_id} is for the token tasks {TOKEN_TASKS}, not task={task!r}")
    step_tag_id = params.step_tag_id if params.step_tag_id is not None or task not in TOKEN_TASKS else model.step_tag_id
    skip = model.pooling_type != "LAST" or task in TOKEN_TASKS  # NOTE 4
    return PoolingParams(dimensions, normalize, activation, task, params.truncate_prompt_tokens, skip, step_tag_id)
