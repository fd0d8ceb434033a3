"""Scores of text pairs: which texts pair up; from embeddings, each text once and the cosine.

Concept: an embedding model scores a pair of texts ``(a, b)`` by the cosine of their two
vectors, so scoring is embedding plus arithmetic (a cross-encoder reads the pair together
instead, NOTE 5). ``score_plan`` turns the two sides into pairs by the rule (NOTE 1) and
lists each distinct text once (NOTE 2); the caller embeds that list (``LLM.encode``, or one
``AsyncLLM.encode`` per text on the server) and ``ScorePlan.outputs`` or ``cosine`` turns
the vectors into one score per pair (NOTE 3).
``LLM.score`` and the server's ``/score`` and ``/rerank`` (``entrypoints/scoring.py``) share it.

Mirrors: ``vllm/entrypoints/llm.py`` (``LLM.score``, ``_embedding_score``,
``_cross_encoding_score``) and ``vllm/entrypoints/score_utils.py`` (``_cosine_similarity``,
``_validate_score_input_lens``).

Invariants: pure functions of their arguments, nothing here reads or queues anything; a
plan's ``pairs`` are in the caller's order (pair ``j`` is ``data_2[j]``'s), every index in
them points into ``prompts``, and no prompt appears there twice.

NOTE 1 (the pairing rule, vLLM's): one item (a str, a prompt dict, or a list of one) and
one item is one pair; one item and a list of N is N pairs, the one item in each (a query
against N documents); two lists of N pair up in order. Anything else (N and M, N and one,
an empty side) is a ValueError naming both sides' lengths, before anything is embedded.
NOTE 2 (each text once): the query of a 1-to-N call, or a text that appears twice, is
embedded once: the plan keeps the first place each distinct prompt appears (``data_1``'s
items first) and the pairs point at it. vLLM embeds a 1-to-N query once too, but a text
repeated in a list as often as it appears; the scores are the same either way, since one
prompt's vector does not depend on its batch. Messages about prompt ``k`` of the list name
where it came from (``data_2[3]``, NOTE 4).
NOTE 3 (the cosine in float32): each vector is L2-normalised in float32, then the dot
product is taken, so the score does not depend on the engine's ``normalize`` and lies in
[-1, 1] up to rounding. vLLM computes it with ``torch.nn.CosineSimilarity`` on the two
vectors, the same value within float32 rounding.
NOTE 4 (messages in the caller's words): the input processor names the prompts of the
list it is given by index (``prompt 2 is empty``); ``ScorePlan.outputs`` rewrites that index
into the place the prompt came from (``data_2[1] is empty``).
NOTE 5 (a cross-encoder): a classifier with one label scores a pair read as one prompt, its
two texts joined by the tokenizer (``cross_pairs``, ``pair_token_ids``); the score is its
logit through the model's activation. Nothing is shared between pairs, so each pair is one
request, and both sides must be text (the pair's ids are the tokenizer's, not the caller's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tinyvllm.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput


def side_items(data: Any, name: str) -> tuple[list[Any], list[str]]:
    """One side of the pairs as a list, and each item's name in messages: ``name`` for one
    item given alone (a str or a prompt dict), ``name[i]`` in a list."""
    if isinstance(data, (str, Mapping)):
        return [data], [name]
    if isinstance(data, (bytes, bytearray)) or not isinstance(data, Iterable):
        raise TypeError(f"{name} must be a str, a prompt dict or a list of them, got {data!r}")
    items = list(data)
    return items, [f"{name}[{i}]" for i in range(len(items))]


def _key(prompt: Any) -> Any:
    """What makes two prompts the same text (NOTE 2): the str, or the dict's contents; a dict
    that is not plain JSON is its own (the input processor will name what is wrong with it)."""
    if isinstance(prompt, str):
        return prompt
    try:
        return ("dict", json.dumps(prompt, sort_keys=True))
    except (TypeError, ValueError):
        return ("object", id(prompt))


# --8<-- [start:cosine]
def cosine(u: torch.Tensor, v: torch.Tensor) -> float:
    """The cosine of two vectors (NOTE 3): each L2-normalised in float32, then their dot product."""
    u = torch.nn.functional.normalize(u.to(torch.float32), dim=0)
    v = torch.nn.functional.normalize(v.to(torch.float32), dim=0)
    return float(torch.dot(u, v))
# --8<-- [end:cosine]


@dataclass(frozen=True)
class ScorePlan:
    """What to embed and how to pair it: ``prompts``, each distinct prompt once in order of
    first appearance; ``names``, where each first appears; ``pairs``, each pair's two indices
    into ``prompts``, in the caller's order."""

    prompts: list[Any]
    names: list[str]
    pairs: list[tuple[int, int]]

    def outputs(self, encode: Callable[[list[Any]], list[PoolingRequestOutput]]) -> list[ScoringRequestOutput]:
        """Embed ``prompts`` with ``encode`` (one output per prompt, in order), then score each
        pair: ``LLM.score``'s answer. An error naming prompt ``k`` names its place (NOTE 4)."""
        try:
            vectors = encode(self.prompts)
        except (TypeError, ValueError) as error:
            raise in_names(error, self.names) from None
        return [scored(vectors[i], vectors[j]) for i, j in self.pairs]


def _sides(data_1: Any, data_2: Any, names: Sequence[str]) -> tuple[tuple[list, list], tuple[list, list]]:
    """Both sides' items and names, their lengths checked by the pairing rule (NOTE 1)."""
    (items_1, names_1), (items_2, names_2) = side_items(data_1, names[0]), side_items(data_2, names[1])
    n_1, n_2 = len(items_1), len(items_2)
    if n_1 == 0 or n_2 == 0 or n_1 not in (1, n_2):
        raise ValueError(f"{names[0]} has {n_1} items and {names[1]} has {n_2}: pairs are one item and one, one "
                         "and N (1-to-N), or N and N (N-to-N)")  # fmt: skip
    return (items_1, names_1), (items_2, names_2)


# --8<-- [start:cross_pairs]
def cross_pairs(data_1: Any, data_2: Any, names: Sequence[str] = ("data_1", "data_2")) -> list[tuple[str, str, str, str]]:
    """A cross-encoder's pairs by the same rule (NOTE 1): ``(text_1, text_2, name_1, name_2)``
    in pair order, each text a str (NOTE 5), each name its place in messages (``data_2[3]``)."""
    (items_1, names_1), (items_2, names_2) = _sides(data_1, data_2, names)
    for item, name in zip(items_1 + items_2, names_1 + names_2):
        if not isinstance(item, str):
            raise ValueError(f"{name}: a cross-encoder reads the two texts of a pair as one prompt, so each must be a "
                             f"str, got {item!r}"[:300])  # fmt: skip
    first = (lambda j: 0) if len(items_1) == 1 else (lambda j: j)
    return [(items_1[first(j)], items_2[j], names_1[first(j)], names_2[j]) for j in range(len(items_2))]


def pair_token_ids(tokenizer: Any, text_1: str, text_2: str, use_pad_token: bool) -> list[int]:
    """One prompt of a pair (``pooling_spec.py`` NOTE 2): the tokenizer's pair encoding, or
    the two texts concatenated for a model whose config says ``use_pad_token: false``."""
    if use_pad_token:
        return list(tokenizer(text=text_1, text_pair=text_2).input_ids)
    return list(tokenizer(text_1 + text_2).input_ids)
# --8<-- [end:cross_pairs]


# --8<-- [start:score_plan]
def score_plan(data_1: Any, data_2: Any, names: Sequence[str] = ("data_1", "data_2"), pools: bool = True) -> ScorePlan:
    """The pairs of ``data_1`` and ``data_2`` by the rule (NOTE 1), each distinct prompt listed
    once (NOTE 2). ``pools``: whether the engine embeds (a generating one cannot score)."""
    if not pools:
        raise ValueError("scoring needs a pooling engine, LLM(model, runner='pooling'): a score is the cosine of "
                         "two embeddings")  # fmt: skip
    (items_1, names_1), (items_2, names_2) = _sides(data_1, data_2, names)
    n_1, n_2 = len(items_1), len(items_2)
    prompts, where, index = [], [], {}
    slots = []
    for item, name in zip(items_1 + items_2, names_1 + names_2):
        key = _key(item)
        if key not in index:
            index[key] = len(prompts)
            prompts.append(item)
            where.append(name)
        slots.append(index[key])
    firsts, seconds = slots[:n_1], slots[n_1:]
    return ScorePlan(prompts, where, [(firsts[0 if n_1 == 1 else j], seconds[j]) for j in range(n_2)])
# --8<-- [end:score_plan]


def scored(first: PoolingRequestOutput, second: PoolingRequestOutput) -> ScoringRequestOutput:
    """One pair's output, vLLM's shape: the two request ids joined by ``_``, both prompts' ids."""
    score = ScoringOutput(cosine(first.outputs.data, second.outputs.data))
    ids = list(first.prompt_token_ids) + list(second.prompt_token_ids)
    return ScoringRequestOutput(f"{first.request_id}_{second.request_id}", score, ids)


def in_names(error: Exception, names: Sequence[str]) -> Exception:
    """``error`` with a leading ``prompt k`` replaced by ``names[k]`` (NOTE 4); as it is otherwise."""
    message = str(error)
    match = re.match(r"prompt (\d+)\b", message)
    if match is None or int(match[1]) >= len(names):
        return error
    return type(error)(names[int(match[1])] + message[match.end() :])
