"""OpenAIServing: one completions or chat request, from a checked body to its answer.

Concept: the steps every generation request takes, in order:

1. checks that need no model: the model name (404), the refused fields (``protocol.py``),
   the one output constraint (``constraints.py``: ``response_format``, ``structured_outputs``,
   ``tools``), which the engine parses in step 4 (a bad one is a 400 naming its field);
2. the prompts: tokenized, or rendered from messages by the chat template
   (``chat.py``), on the tokenizer's thread (``engine/prompt_tokenizer.py``), each refused
   there if longer than the context, so no request stalls another's stream;
3. the params: the fields the request set, laid over the model's sampling defaults
   (``sampling_defaults.merge_defaults``), ``max_tokens`` from the prompt's length
   (NOTE 2); every request runs as DELTA, streamed or not (NOTE 3);
4. the engine: one ``AsyncLLM.generate`` per prompt, each first output awaited before
   the answer starts (NOTE 1);
5. the answer: ``choices.py`` turns the outputs into server-sent events or one JSON body;
   with ``--reasoning-parser``, each chat choice split by ``reasoning.py``.

Mirrors: ``vllm/entrypoints/openai/serving_completion.py``, ``serving_chat.py``,
``serving_engine.py`` (``_validate_input``: the context check).

Invariants: every refusal is an ``APIError`` in OpenAI's shape with the request field
in ``param`` (``param_of`` names it for the messages that ``SamplingParams`` and the
engine write); every engine request this module starts is finished, or aborted when the
answer stops early (an error, a client that left).

NOTE 1 (the first outputs before the headers): a streamed response sends its 200 status
with the first chunk, so every prompt's first output is awaited before answering: a
request the engine refuses still gets its 400 or 503, and the others of its list are
aborted.
NOTE 2 (max_tokens and the context): a ``max_tokens`` that the prompt leaves no room for
is a 400 naming it, as vLLM's (``prompt + max_tokens > max_model_len``). A default
(completions' 16, the model's ``max_new_tokens``) is cut to what the context leaves.
NOTE 3 (DELTA for everything): the server sees each new piece as the engine makes it,
which gives the streamed chunks and the per-token latencies alike; a non-streamed answer
joins the pieces.
NOTE 4 (disconnects): a streamed response whose client goes away is cancelled by the
ASGI server, which closes the ``generate`` iterators and aborts the requests
(``async_llm.py`` NOTE 2). A non-streamed request is watched: the server polls
``Request.is_disconnected()`` every 0.2 s and cancels it when the client is gone.
NOTE 5 (the engine's messages in the request's words): ``SamplingParams`` and the engine
name their own fields (``sampling_params.logprobs``); the client sent another (chat's
``top_logprobs``, ``max_completion_tokens``). ``in_request_words`` drops the label and
renames each field the request filled under another name; offline callers keep the
engine's wording.
NOTE 6 (the waiting bound): a request's prompts x ``n`` sequences wait as that many
requests (``async_llm.py`` NOTE 3). A request of more than ``max_waiting_requests`` could
never be queued, so it is a 400 naming ``prompt`` or ``n`` before anything is tokenized;
one that could fit later is the 503 "try again later".
NOTE 7 (shutting down): ``abort_all`` aborts every engine request, so each open answer
ends with ``finish_reason: "abort"`` (and ``[DONE]`` when streamed), and turns new ones
away with 503; ``openai_server.run_server`` calls it when ``shutdown_timeout`` has passed.
NOTE 8 (beam search, ``protocol.py`` NOTE 6): each prompt runs ``AsyncLLM.beam_search``
instead of ``generate``, its one output the ``n`` beams, best first; the same steps and
answer serve it, so the whole search runs before the status (a stream's chunks all come
at the end) and a client that leaves cancels it. A ``max_tokens`` left to the context is
what each prompt leaves.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tinyvllm.beam_search import BeamSearchParams
from tinyvllm.engine.async_llm import AsyncLLM, EngineDeadError, TooManyWaitingRequestsError
from tinyvllm.engine.chat_template import check_template
from tinyvllm.engine.detokenizer import decode_text
from tinyvllm.engine.input_processor import check_priority
from tinyvllm.entrypoints.chat import echo_text, messages_as_dicts, render
from tinyvllm.entrypoints.choices import ChoiceBuilder, PromptState
from tinyvllm.entrypoints.constraints import constraint, tool_choice
from tinyvllm.entrypoints.metrics import RequestTracker, ServerMetrics
from tinyvllm.entrypoints.streams import MergedOutputs, first_outputs
from tinyvllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, RequestError, error_body
from tinyvllm.entrypoints.reasoning import ReasoningSplit, build_reasoning_parser, request_thinks
from tinyvllm.sampling_defaults import merge_defaults
from tinyvllm.sampling_params import RequestOutputKind, SamplingParams

COMPLETION_MAX_TOKENS = 16  # protocol.py NOTE 2
PROMPT_WORDS = ("prompt", "prompt_token_ids")  # the engine's words for a request's prompt (param_of)
DISCONNECT_POLL_S = 0.2
BEAM_WORDS = {"beam_width": "n"}  # BeamSearchParams' word for a request field, in its messages (NOTE 8)


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.kind, self.param), status_code=self.status)


class Disconnected(Exception):
    """The client went away before the answer was ready (NOTE 4)."""


def param_of(message: str, names: dict[str, str]) -> str | None:
    """The request field behind an error message: of ``names`` (``{word in messages: request
    field}``), the one the message names first, as a whole word."""
    best: tuple[int, str] | None = None
    for word, param in names.items():
        found = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", message)
        if found and (best is None or found.start() < best[0]):
            best = (found.start(), param)
    return best[1] if best else None


def in_request_words(message: str, renamed: dict[str, str]) -> str:
    """An engine message as the client should read it (NOTE 5): the ``sampling_params``
    label dropped, and each word of ``renamed`` (``{SamplingParams field: request field}``)
    written as the request's field, in one pass."""
    message = re.sub(r"(?<!\w)sampling_params(\[\d+\])?(\.|: )", "", message)
    if not renamed:
        return message
    words = "|".join(re.escape(word) for word in sorted(renamed, key=len, reverse=True))
    return re.sub(rf"(?<!\w)({words})(?!\w)", lambda m: renamed[m.group(1)], message)


class OpenAIServing:
    """What the endpoints share: the engine, the served name, the metrics, the chat template."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str, chat_template: str | None = None,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> None:  # fmt: skip
        self.async_llm = async_llm
        self.tool_call_parser = tool_call_parser  # --tool-call-parser (constraints.py NOTE 4)
        self.reasoning_parser = (None if reasoning_parser is None  # --reasoning-parser (reasoning.py NOTE 4)
                                 else build_reasoning_parser(reasoning_parser, async_llm.engine.reasoning_config))
        self.served_model_name = served_model_name
        self.max_model_len = async_llm.max_model_len
        self.vocab_size: int = async_llm.input_processor.vocab_size
        self.metrics = ServerMetrics(async_llm, served_model_name)
        self.chat_template = chat_template  # --chat-template; else the tokenizer's (chat.py)
        self.default_params: SamplingParams = async_llm.get_default_sampling_params()  # the model's (step 3)
        self.default_max_tokens: int | None = async_llm.input_processor.generation_defaults.get("max_tokens")
        self._loop_tokenizer = copy.deepcopy(async_llm.tokenizer)  # used on the event loop alone
        self.closing = False  # abort_all was called: no new engine request (NOTE 7)

    async def abort_all(self) -> set[str]:
        """Shutting down (NOTE 7): abort every engine request (each answer ends with
        ``finish_reason: "abort"``) and refuse new ones with 503. Returns the ids aborted."""
        self.closing = True
        try:
            ids = await self.async_llm.run_in_engine_thread(self.async_llm.engine.unfinished_request_ids)
            for request_id in ids:
                await self.async_llm.abort(request_id)
        except EngineDeadError:
            return set()
        return ids

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def check_generates(self, api: str) -> None:
        """A pooling server (``--runner pooling``) embeds: completions and chat are a 400 (``embeddings.py`` NOTE 2)."""
        if self.async_llm.input_processor.pooling_model is not None:
            raise APIError(400, f"The model does not support {api} API: this server embeds (started with --runner "
                           "pooling); send POST /v1/embeddings, or serve with --runner generate to generate text",
                           "BadRequestError", "model")  # fmt: skip

    def _check_fits(self, num_prompts: int, n: int | None) -> None:
        """A request whose sequences (prompts x n) could never wait together is a 400 (NOTE 6)."""
        n = self.default_params.n if n is None else n
        bound = self.async_llm.max_waiting_requests
        if num_prompts * n <= bound:
            return
        if num_prompts > bound:
            asked, param = f"{num_prompts} prompts", "prompt"
        elif num_prompts == 1:
            asked, param = f"n={n} sequences", "n"
        else:
            asked, param = f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences", "n"
        raise RequestError(f"{asked} can never wait together: this server queues at most {bound} "
                           f"(max_waiting_requests {bound}); send at most {bound} in one request", param)  # fmt: skip

    # -- step 2: prompts, on the tokenizer's thread -----------------------------------------

    def _truncate(self, body) -> int | None:
        k = body.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens {k} is more than max_model_len {self.max_model_len}",
                               "truncate_prompt_tokens")  # fmt: skip
        return self.max_model_len if k == -1 else k

    def _checked_ids(self, ids: list[int], index: int, truncate: int | None, field: str) -> list[int]:
        """In the tokenizer thread: truncated, not empty, in the context and the vocabulary."""
        if truncate is not None:
            ids = ids[-truncate:]
        if not ids:
            raise RequestError(f"prompt {index} is empty", field)
        try:
            self.async_llm.prompt_tokenizer.check_length(len(ids), index)
        except ValueError as error:
            raise RequestError(str(error), field) from None
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt {index} has token id {bad}, outside the vocabulary [0, {self.vocab_size})", field)
        return ids

    def _completion_prompts(self, prompts: list, add_special: bool, truncate: int | None, echo: bool) -> list[PromptState]:
        tokenizer = self.async_llm.prompt_tokenizer
        states = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                try:
                    ids = tokenizer.encode(prompt, add_special, i, limit=truncate is None)
                except ValueError as error:
                    raise RequestError(str(error), "prompt") from None
            else:
                ids = list(prompt)
            kept = self._checked_ids(ids, i, truncate, "prompt")
            echoed = ""
            if echo:  # the prompt's text as sent, or the text of its (kept) ids
                echoed = prompt if isinstance(prompt, str) and len(kept) == len(ids) else tokenizer.tokenizer.decode(kept)
            states.append(PromptState(kept, echo=echoed))
        return states

    def _chat_prompt(self, template: str, messages: list[dict], body, add_special: bool, truncate: int | None) -> PromptState:
        tokenizer = self.async_llm.prompt_tokenizer
        text = render(tokenizer.tokenizer, template, messages, body)
        try:
            ids = tokenizer.encode(text, add_special, 0, limit=truncate is None)
        except ValueError as error:
            raise RequestError(str(error), "messages") from None
        return PromptState(self._checked_ids(ids, 0, truncate, "messages"))

    def template(self, body) -> str:
        if body.chat_template is not None:
            try:
                check_template(body.chat_template, "chat_template")
            except ValueError as error:
                raise RequestError(str(error), "chat_template") from None
            return body.chat_template
        template = self.chat_template or getattr(self.async_llm.tokenizer, "chat_template", None)
        if not template:
            raise RequestError(
                f"the model {self.served_model_name!r} has no chat template: start the server with --chat-template, "
                "send `chat_template`, or use /v1/completions", "messages",
            )  # fmt: skip
        return template

    # -- step 3: params ------------------------------------------------------------------------

    # --8<-- [start:max_tokens]
    def _max_tokens(self, body, prompt_lens: list[int], chat: bool) -> tuple[str, int | None, bool]:
        """``(request field, max_tokens, drop_output)`` (NOTE 2; ``choices.py`` NOTE 1 for the drop)."""
        name, given = "max_tokens", body.max_tokens
        if chat and body.max_completion_tokens is not None:
            name, given = "max_completion_tokens", body.max_completion_tokens
        if given is None:
            explicit_null = not chat and "max_tokens" in body.model_fields_set
            defaults = [v for v in (None if chat or explicit_null else COMPLETION_MAX_TOKENS, self.default_max_tokens)
                        if v is not None]  # fmt: skip
            room = max(1, self.max_model_len - max(prompt_lens))
            return name, (min(*defaults, room) if defaults else None), False
        drop = not chat and given == 0 and bool(body.echo)  # the prompt alone
        max_tokens = 1 if drop else given
        for i, n in enumerate(prompt_lens):
            if max_tokens >= 1 and n + max_tokens > self.max_model_len:
                raise RequestError(
                    f"`{name}` is too large: {given}. This model's maximum context length is {self.max_model_len} "
                    f"tokens and prompt {i} has {n} tokens ({given} > {self.max_model_len} - {n})", name,
                )  # fmt: skip
        return name, max_tokens, drop
    # --8<-- [end:max_tokens]

    def _params(self, fields: dict[str, tuple[str, Any]], names: dict[str, str]) -> SamplingParams:
        explicit = {name: value for name, (_, value) in fields.items()}
        explicit["output_kind"] = RequestOutputKind.DELTA  # NOTE 3
        try:
            return merge_defaults(self.default_params, explicit)
        except (TypeError, ValueError) as error:
            raise self._bad_request(error, names) from None

    def _beam_params(self, body, fields: dict[str, tuple[str, Any]], states: list[PromptState],
                     names: dict[str, str]) -> list[BeamSearchParams] | None:  # fmt: skip
        """Each prompt's ``BeamSearchParams`` under ``use_beam_search`` (NOTE 8), else None."""
        if not body.use_beam_search:
            return None
        given = fields["max_tokens"][1]
        rooms = [max(1, self.max_model_len - len(state.token_ids)) for state in states]
        try:
            return [body.to_beam_search_params(room if given is None else given, self.default_params.temperature)
                    for room in rooms]  # fmt: skip
        except (TypeError, ValueError) as error:
            raise self._bad_request(error, {**names, **BEAM_WORDS}) from None

    def _priority(self, body) -> int:
        """vLLM's ``priority`` field (lower runs sooner): a 400 unless the engine schedules by
        priority, or it is 0 (``engine/input_processor.py`` NOTE 7)."""
        policy = self.async_llm.input_processor.scheduling_policy
        try:
            return check_priority("the request", 0 if body.priority is None else body.priority, policy)
        except (TypeError, ValueError) as error:
            raise RequestError(str(error), "priority") from None

    @staticmethod
    def _bad_request(error: Exception, names: dict[str, str]) -> RequestError:
        """A ``SamplingParams`` or engine refusal as a 400 in the request's words (NOTE 5)."""
        renamed = {word: param for word, param in names.items() if word != param and word not in PROMPT_WORDS}
        return RequestError(in_request_words(str(error), renamed), param_of(str(error), names))

    @staticmethod
    def _names(fields: dict[str, tuple[str, Any]], prompt_field: str) -> dict[str, str]:
        """``param_of``'s words: each ``SamplingParams`` field set, and the prompt."""
        return {**{name: param for name, (param, _) in fields.items()}, **dict.fromkeys(PROMPT_WORDS, prompt_field)}

    def _with_constraint(self, body, fields: dict[str, tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
        """``fields`` with the request's output constraint, under the request field that asked for it."""
        found = constraint(body, self.tool_call_parser)
        return fields if found is None else {**fields, "structured_outputs": found}

    # -- the two endpoints ---------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw_request: Request, request_id: str, arrival: float):
        self.check_model(body.model)
        self.check_generates("Completions")
        body.check_refused()
        fields = self._with_constraint(body, body.sampling_fields())
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise RequestError("`prompt` must not be an empty list", "prompt")
        self._check_fits(len(prompts), body.n)
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        truncate = self._truncate(body)
        states = await self.async_llm.run_in_tokenizer_thread(
            self._completion_prompts, prompts, add_special, truncate, bool(body.echo)
        )
        name, max_tokens, drop = self._max_tokens(body, [len(s.token_ids) for s in states], chat=False)
        fields["max_tokens"] = (name, max_tokens)
        params = self._params(fields, names := self._names(fields, "prompt"))
        beams = self._beam_params(body, fields, states, names)  # NOTE 8
        return await self._run(body, raw_request, f"cmpl-{request_id}", arrival, states, params, fields, drop,
                               chat=False, beams=beams)  # fmt: skip

    async def chat(self, body: ChatCompletionRequest, raw_request: Request, request_id: str, arrival: float):
        self.check_model(body.model)
        self.check_generates("Chat Completions")
        body.check_refused()
        if body.include_reasoning is False and self.reasoning_parser is None:
            raise RequestError("`include_reasoning: false` needs a reasoning parser (start the server with "
                               "--reasoning-parser): without one the reasoning is part of `content`",
                               "include_reasoning")  # fmt: skip
        fields = self._with_constraint(body, body.sampling_fields())
        self._check_fits(1, body.n)
        messages = messages_as_dicts(body)
        template = self.template(body)
        add_special = bool(body.add_special_tokens)  # the template writes the special tokens
        truncate = self._truncate(body)
        state = await self.async_llm.run_in_tokenizer_thread(
            self._chat_prompt, template, messages, body, add_special, truncate
        )
        state.echo = echo_text(body, messages)
        name, max_tokens, _ = self._max_tokens(body, [len(state.token_ids)], chat=True)
        fields["max_tokens"] = (name, max_tokens)
        params = self._params(fields, names := self._names(fields, "messages"))
        beams = self._beam_params(body, fields, [state], names)  # NOTE 8
        return await self._run(body, raw_request, f"chatcmpl-{request_id}", arrival, [state], params, fields, False,
                               chat=True, beams=beams)  # fmt: skip

    # -- steps 4 and 5: run and answer ---------------------------------------------------------

    # --8<-- [start:run]
    async def _run(self, body, raw_request, response_id, arrival, states, params, fields, drop, chat: bool,
                   beams: list[BeamSearchParams] | None = None):  # fmt: skip
        if self.closing:  # NOTE 7
            raise APIError(503, "the server is shutting down", "ServiceUnavailableError")
        names = self._names(fields, "messages" if chat else "prompt")
        if beams is not None:
            names.update(BEAM_WORDS)
        priority = self._priority(body)
        streams = []
        for i, state in enumerate(states):
            prompt: dict[str, Any] = {"prompt_token_ids": state.token_ids}
            if body.cache_salt is not None:
                prompt["cache_salt"] = body.cache_salt
            request_id = f"{response_id}-{i}-{uuid.uuid4().hex[:8]}"
            if beams is not None:  # NOTE 8
                streams.append(self.async_llm.beam_search(prompt, request_id, beams[i]))
            else:
                streams.append(self.async_llm.generate(prompt, params, request_id, priority=priority))
        trackers = [RequestTracker(self.metrics, params.n, arrival) for _ in states]
        try:
            firsts = await self.until_disconnect(first_outputs(streams), raw_request)  # NOTE 1
        except Disconnected:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        except (ValueError, TypeError) as error:  # SamplingParams, the input processor, add_request
            raise self._bad_request(error, names) from None
        except TooManyWaitingRequestsError as error:
            raise APIError(503, str(error), "ServiceUnavailableError") from None
        except EngineDeadError as error:
            raise APIError(500, str(error), "InternalServerError") from None
        builder = ChoiceBuilder(
            states, params.n, chat, self._decode, logprobs=params.logprobs, echo=bool(body.echo),
            as_token_id=bool(body.return_tokens_as_token_ids), drop_output=drop,
            want_prompt_logprobs=params.prompt_logprobs is not None,
            tool=tool_choice(body, self.tool_call_parser) if chat else None,
            reasoning=self._reasoning(body, states[0], params, "structured_outputs" in fields) if chat else None,
            include_reasoning=not chat or body.include_reasoning is not False,
        )  # fmt: skip
        head = {"id": response_id, "created": int(time.time()), "model": self.served_model_name}
        outputs = MergedOutputs(firsts, streams, trackers)
        if body.stream:
            options = body.stream_options
            usage = (bool(options and options.include_usage), bool(options and options.continuous_usage_stats))
            return StreamingResponse(self._events(outputs, builder, head, chat, *usage), media_type="text/event-stream")
        try:
            await self.until_disconnect(_drain(outputs, builder), raw_request)
        except Disconnected:
            return Response(status_code=499)
        except Exception as error:  # a step failed (its requests are aborted) or the engine stopped
            raise APIError(500, str(error), "InternalServerError") from None
        finally:
            outputs.close()
        answer = {**head, "object": "chat.completion" if chat else "text_completion", "choices": builder.choices(),
                  "usage": builder.usage()}  # fmt: skip
        if chat and builder.want_prompt_logprobs:
            answer["prompt_logprobs"] = builder.prompt_logprobs()
        return JSONResponse(answer)
    # --8<-- [end:run]

    async def _events(self, outputs: MergedOutputs, builder: ChoiceBuilder, head: dict, chat: bool, include_usage: bool, continuous: bool):
        """Server-sent events: the choices' chunks, then the usage (if asked for), then ``[DONE]``."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        try:
            async for prompt_index, out in outputs:
                for choice in builder.update(prompt_index, out):
                    chunk = {**head, "choices": [choice]}
                    if continuous:
                        chunk["usage"] = builder.usage()
                    yield _sse(chunk)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": builder.usage()})
        except Exception as error:  # the engine failed mid-stream: the status is sent already, say so in the stream
            yield _sse(error_body(500, str(error), "InternalServerError"))
        finally:
            outputs.close()  # aborts what is unfinished when the client left (NOTE 4)
        yield _sse("[DONE]")

    def _reasoning(self, body: ChatCompletionRequest, state: PromptState, params: SamplingParams,
                   constrained: bool) -> Callable[[], ReasoningSplit] | None:  # fmt: skip
        """Each chat choice's ``ReasoningSplit`` maker, with a reasoning parser (``reasoning.py``)."""
        parser = self.reasoning_parser
        if parser is None:
            return None
        in_reasoning = self.async_llm.engine.structured_output_manager.config.enable_in_reasoning
        thinks = request_thinks(parser, body.chat_template_kwargs, state.token_ids, constrained, in_reasoning)
        tokenizer, skip = self._loop_tokenizer, params.skip_special_tokens
        return lambda: ReasoningSplit(parser, thinks, lambda ids: decode_text(tokenizer, ids, skip))

    def _decode(self, token_id: int) -> str:
        """A logprob's token text when the engine gave none (``logprobs_format.py`` NOTE 1)."""
        return self._loop_tokenizer.decode([token_id])

    async def until_disconnect(self, awaitable, raw_request: Request):
        """Await ``awaitable``, unless the client disconnects first: then cancel it (NOTE 4)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await raw_request.is_disconnected():
                    raise Disconnected()
        finally:
            if not task.done():
                task.cancel()  # the cancellation reaches AsyncLLM.generate, whose finally aborts the request
                await asyncio.gather(task, return_exceptions=True)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _drain(outputs: MergedOutputs, builder: ChoiceBuilder) -> None:
    async for prompt_index, out in outputs:
        builder.update(prompt_index, out)
