"""The ``tinyvllm`` command (also ``python -m tinyvllm``).

``tinyvllm serve [--model DIR|ID] [--revision R] [--host 127.0.0.1] [--port 8000]
[--served-model-name NAME]`` serves the model over HTTP with an OpenAI-compatible API
(``entrypoints/openai_server.py``; needs the ``serve`` extra); it takes the same engine flags as
``generate`` (``add_engine_args``); ``--served-model-name`` defaults to ``--model`` as given, as vLLM's. Its own flags:
``--chat-template FILE_OR_STRING``, ``--api-key`` (else ``$VLLM_API_KEY``), ``--allowed-origins``
(CORS), ``--max-request-body-bytes`` (413), ``--max-waiting-requests`` (503), ``--shutdown-timeout``
(seconds running requests may go on after SIGTERM), ``--enable-auto-tool-choice
--tool-call-parser hermes`` (vLLM's pair, for ``tool_choice: "auto"``), ``--reasoning-parser NAME``
(chat's ``reasoning``, ``entrypoints/reasoning.py``), ``--runner pooling [--pooler-config JSON]``
(``/v1/embeddings``, ``/score``, ``/rerank``, ``/pooling``, a classifier's ``/classify``); a bad value is one line, exit status 2.
``tinyvllm generate --prompt TEXT [--model DIR|ID] [--revision R] [...]`` prints the
completion, then one line of figures: prompt and generated tokens, seconds, generated
tokens per second, and prompt tokens served from the prefix cache. With ``--chat`` the
prompt is one user message, rendered by the model's chat template (``LLM.chat``;
``--chat-template-kwargs JSON`` passes variables to it, such as Qwen3's ``enable_thinking``);
``--json-schema FILE|JSON``, ``--regex`` or ``--choice a,b,c`` constrains the completion.
``--cudagraph-mode`` and ``--enforce-eager`` choose how the model runs under CUDA graphs (vLLM's
``--compilation-config`` and ``--enforce-eager``). ``tinyvllm tiny-model DIR`` writes a tiny
random-weight model folder (no download). ``tinyvllm trace`` records every engine step of a
built-in workload or of ``--prompts FILE`` and writes an HTML viewer (``trace/command.py``).

``--model`` is a local folder or a Hugging Face model id (``Qwen/Qwen3-0.6B``), resolved
into the hub cache by ``models/hub.py`` (a local folder of the same spelling wins;
``HF_HUB_OFFLINE=1`` reads the cache only); ``--revision`` picks a branch, tag or commit.

Errors (the contract ``tests/test_cli.py`` holds):
- A flag argparse refuses (an unknown choice, a non-number): argparse's usage and
  message on stderr, exit status 2.
- A user error (``ValueError``, ``TypeError``, ``OSError`` and so ``FileNotFoundError``):
  exactly one line on stderr, ``tinyvllm: error: <message>``, no traceback, exit status 2.
  That covers every broken model folder (``models/loader.py`` names the file and field),
  a model id the hub lacks or, offline, the cache (``models/hub.py``), sampling values
  ``SamplingParams`` refuses (``--max-tokens 0``, ``--top-p 2``), ``--device cuda`` with no
  GPU, a ``--max-model-len`` past the model's or the KV cache's, an unwritable folder.
- Ctrl-C (``KeyboardInterrupt``): one line, ``tinyvllm: error: interrupted``, exit status
  130 (128 + SIGINT, what shells report for a command killed by Ctrl-C).
- The reader of the output went away (``tinyvllm trace --list | head -2``): nothing more is
  printed, exit status 141 (128 + SIGPIPE, as a command the signal ends).
- Anything else is a bug in tinyvllm, not the user's doing: it propagates with its full
  traceback (exit status 1). Set ``TINYVLLM_TRACEBACK=1`` to get the traceback of the
  user errors too (a ``TypeError`` from a bug would otherwise read as one line).

Sampling defaults: ``--generation-config`` (``generate`` and ``serve``) is vLLM's flag:
``auto`` (the default) takes the model's ``generation_config.json`` sampling fields,
``vllm`` ignores them, a folder path reads that folder's file (``sampling_defaults.py``).
``generate``'s sampling flags default to unset: each one given wins, each one left out
takes the model's value (``cli_sampling_params``). What neither sets: ``--max-tokens`` 64;
greedy (``--temperature`` 0) when the model's generation config sets no sampling field,
else ``SamplingParams``' own defaults for the fields it leaves out (temperature 1), as
vLLM's ``LLM.generate`` gives the model's defaults.

Fail fast: ``generate`` checks the numbers, the sampling values and the constraint, an empty
``--prompt``, resolves the model (``resolve_model``) and checks the whole folder
(``check_model_folder``: config, weight headers, tokenizer files, EOS; no torch) before
importing the engine, so a typo costs a fraction of a second; ``serve`` also binds its port
once to see it is free. ``--threads N`` (every engine command) sets torch's CPU threads; left
out, ``cpu_threads.py`` chooses from the model's size (the count is in the start-up line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from tinyvllm.cpu_threads import choose_torch_threads, count_parameters  # torch-free, like everything --help needs
from tinyvllm.engine.engine_args import CLI_NAMES, RUNNERS, EngineArgs, check_counts, check_parallel, resolve_max_model_len
USER_ERRORS = (ValueError, TypeError, OSError)  # FileNotFoundError is an OSError
EXIT_USER_ERROR = 2  # as argparse's
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags that build the engine, shared by ``generate`` and ``serve`` (not ``--model``):
    ``EngineArgs``' own (``engine/engine_args.py``, vLLM's ``EngineArgs.add_cli_args``)."""
    EngineArgs.add_cli_args(p)


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None,
        help="a local Hugging Face model folder or a Hugging Face model id such as Qwen/Qwen3-0.6B "
        "(default: the shipped stdlib_tiny model, trained on Python's standard library)",
    )  # fmt: skip
    p.add_argument(
        "--revision", default=None,
        help="the branch, tag or commit hash of a Hugging Face model id (default: main)",
    )  # fmt: skip


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_arg(p)
    p.add_argument("--prompt", required=True)
    unset = " (default: the model's generation_config.json, else %s)"
    p.add_argument("--max-tokens", type=int, default=None, help="the most tokens to generate" + unset % 64)
    p.add_argument(
        "--temperature", type=float, default=None,
        help="0 = greedy (default: the model's generation_config.json; greedy if it sets no sampling field)",
    )  # fmt: skip
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling" + unset % 1)
    p.add_argument("--top-k", type=int, default=None, help="0 = off" + unset % "off")
    p.add_argument("--min-p", type=float, default=None, help="0 = off" + unset % "off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--chat", action="store_true",
        help="send --prompt as one user message through the model's chat template (LLM.chat)",
    )  # fmt: skip
    p.add_argument(
        "--chat-template-kwargs", default=None, metavar="JSON",
        help="with --chat: extra variables for the template, e.g. '{\"enable_thinking\": false}' for Qwen3",
    )  # fmt: skip
    # --8<-- [start:constraint_flags]
    constraint = p.add_mutually_exclusive_group()  # one constraint: two are argparse's error, exit status 2
    constraint.add_argument(
        "--json-schema", default=None, metavar="FILE|JSON",
        help="the completion is JSON that validates against this schema (a file, or the schema itself)",
    )  # fmt: skip
    constraint.add_argument("--regex", default=None, help="the completion matches this regular expression in full")
    constraint.add_argument("--choice", default=None, metavar="A,B,C", help="the completion is one of these strings")
    # --8<-- [end:constraint_flags]
    add_engine_args(p)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP with an OpenAI-compatible API")
    _add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name", default=None,
        help="the name clients ask for (default: the --model value; stdlib_tiny for the shipped model)",
    )  # fmt: skip
    p.add_argument("--max-waiting-requests", type=int, default=256, help="past this many waiting requests, new ones get HTTP 503")
    # --8<-- [start:serve_args]
    p.add_argument(
        "--chat-template", default=None, metavar="FILE_OR_STRING",
        help="the Jinja chat template (a file, or the template itself); default: the tokenizer's",
    )  # fmt: skip
    p.add_argument(
        "--api-key", default=os.environ.get("VLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY, else none)",
    )  # fmt: skip
    p.add_argument(
        "--allowed-origins", default=None, metavar="ORIGINS",
        help="CORS: origins allowed to call the server, a JSON list or comma-separated (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
        help="a request body larger than this gets HTTP 413 (default: 16 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-timeout", type=float, default=0.0, metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, let running requests go on this long, then abort them (vLLM's; default 0: at once)",
    )  # fmt: skip
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="serve tool_choice auto (with --tool-call-parser)")
    p.add_argument(
        "--tool-call-parser", default=None, choices=["hermes"],
        help="what reads the model's own tool calls: hermes, <tool_call>{...}</tool_call> (Qwen3's format)",
    )  # fmt: skip
    p.add_argument(
        "--reasoning-parser", default=None, metavar="NAME",
        help="split chat answers into reasoning and content at the think end token: qwen3 or deepseek_r1",
    )  # fmt: skip
    p.add_argument("--runner", default="auto", choices=RUNNERS, help="pooling: serve /v1/embeddings, /score and /rerank (default auto: pooling for a *ForSequenceClassification model, /classify too; else generate)")
    p.add_argument("--pooler-config", default=None, metavar="JSON", help='with --runner pooling (or auto on a classifier), e.g. \'{"pooling_type": "MEAN"}\'')
    # --8<-- [end:serve_args]
    add_engine_args(p)


def _check_engine_args(args):
    """The engine flags and the model, without torch: a hub id is resolved into the hub
    cache (``args.model_folder``; ``args.model`` stays as typed, the served name) and the
    folder checked. ValueError naming the flag, the id or the file."""
    from tinyvllm.distributed.utils import check_tensor_parallel_size
    from tinyvllm.models.hub import resolve_model
    from tinyvllm.models.loader import check_model_folder
    from tinyvllm.sampling_defaults import check_generation_config, generation_defaults

    _check_counts(args)
    if args.model is None:  # the small model shipped with the package
        from tinyvllm.stdlib_tiny import STDLIB_TINY

        args.model = STDLIB_TINY
    args.model_folder = resolve_model(args.model, args.revision)
    spec = check_model_folder(args.model_folder)
    args.num_parameters = count_parameters(
        spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers, spec.num_attention_heads,
        spec.num_key_value_heads, spec.head_dim, spec.tie_word_embeddings,
    )  # fmt: skip
    source = check_generation_config(getattr(args, "generation_config", "auto"))
    generation_defaults(source, args.model_folder)  # a malformed field fails here, before torch
    args.speculative = _speculative_config_arg(getattr(args, "speculative_config", None))
    try:  # the engine's rule (engine_args.py NOTE 10), naming the flag
        check_tensor_parallel_size(
            args.tensor_parallel_size, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
        )  # fmt: skip
    except ValueError as error:
        raise ValueError(str(error).replace("tensor_parallel_size", CLI_NAMES["tensor_parallel_size"])) from None
    if args.max_model_len is not None:  # the engine's rule, naming the flag (engine_args.py NOTE 9)
        resolve_max_model_len(args.max_model_len, spec, "--max-model-len", f" (config.json of {args.model})")


def _json_object_arg(flag: str, text: str) -> dict:
    """A flag whose value is a JSON object; ValueError naming the flag otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} must be a JSON object, got {text!r} ({error.msg})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value


def _speculative_config_arg(text: str | None) -> dict | None:
    """``--speculative-config``: a JSON object, checked (``SpeculativeConfig``) before torch."""
    if text is None:
        return None
    from tinyvllm.config import SpeculativeConfig

    config = _json_object_arg("--speculative-config", text)
    SpeculativeConfig.from_dict(config)  # ValueError naming the key or the value
    return config


def _pooler_args(args) -> dict | None:
    """``serve --runner``/``--pooler-config``: the engine's rule (``engine_args.py`` NOTE 12) before torch."""
    from tinyvllm.engine.engine_args import check_runner

    config = None if args.pooler_config is None else _json_object_arg("--pooler-config", args.pooler_config)
    try:
        check_runner(args.runner, config, args.speculative_config, ())  # only whether it is set
    except (TypeError, ValueError) as error:
        raise ValueError(f"{'--runner' if config is None else '--pooler-config'}: {error}") from None
    return config


def _chat_template_kwargs_arg(args) -> dict | None:
    """``generate --chat-template-kwargs``: a JSON object, only with ``--chat``, checked before torch."""
    if args.chat_template_kwargs is None:
        return None
    if not args.chat:
        raise ValueError("--chat-template-kwargs needs --chat")
    from tinyvllm.engine.chat_template import check_template_kwargs

    return check_template_kwargs(_json_object_arg("--chat-template-kwargs", args.chat_template_kwargs))


def _structured_outputs_arg(args):
    """``--json-schema``, ``--regex`` or ``--choice`` as ``StructuredOutputsParams``, parsed by
    xgrammar now (no tokenizer needed); ValueError naming the flag."""
    from tinyvllm.sampling_params import StructuredOutputsParams
    from tinyvllm.structured_output.backend_xgrammar import validate

    flag, given = next(((f, v) for f, v in (("--json-schema", args.json_schema), ("--regex", args.regex),
                                            ("--choice", args.choice)) if v is not None), (None, None))  # fmt: skip
    if flag is None:
        return None
    try:
        if flag == "--json-schema":
            text = given if given.lstrip().startswith("{") else Path(given).read_text(encoding="utf-8")
            params = StructuredOutputsParams(json=_json_object_arg(flag, text))
        elif flag == "--regex":
            params = StructuredOutputsParams(regex=given)
        else:
            params = StructuredOutputsParams(choice=[c.strip() for c in given.split(",")])
        validate(params)
    except OSError as error:
        raise ValueError(f"{flag} {given!r} is neither a JSON object nor a readable file ({error.strerror})") from None
    except (TypeError, ValueError) as error:
        raise ValueError(f"{flag}: {str(error).removeprefix(flag + ' ')}") from None
    return params


def _check_counts(args) -> None:
    """The engine's own rule for the counts (``engine_args.check_counts``), naming the flags."""
    check_counts(args.max_model_len, args.num_gpu_blocks_override, args.threads, CLI_NAMES)
    check_parallel(args.tensor_parallel_size, args.distributed_executor_backend, CLI_NAMES)


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")  # generate's, by field name
CLI_MAX_TOKENS = 64


def _check_args(args) -> dict:
    """What can be checked without torch: the numbers, the sampling values, the folder.
    Returns the sampling fields the user set; raises ValueError naming the flag or the file."""
    from tinyvllm.sampling_params import SamplingParams

    if not args.chat and args.prompt == "":  # the engine refuses it too, but only after loading
        raise ValueError("--prompt must not be empty")
    explicit = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    constraint = _structured_outputs_arg(args)
    if constraint is not None:
        explicit["structured_outputs"] = constraint
    SamplingParams(**explicit)  # each value checked now, before torch is imported
    _check_engine_args(args)
    return explicit


# --8<-- [start:cli_sampling_params]
def cli_sampling_params(model_defaults: dict, explicit: dict):
    """``generate``'s params: each flag the user set wins, then the model's defaults, then
    this command's own: ``--max-tokens`` 64, and greedy when the model sets no sampling
    field (module docstring)."""
    from tinyvllm.sampling_params import SamplingParams

    base = {"max_tokens": CLI_MAX_TOKENS}
    if not set(model_defaults) - {"max_tokens"}:  # no sampling advice from the model: greedy, as always
        base["temperature"] = 0.0
    return SamplingParams(**(base | model_defaults | explicit))
# --8<-- [end:cli_sampling_params]


def _torch_threads(args) -> int | None:
    """``--threads``, else ``cpu_threads.py``'s rule for the model and device (None: torch's own)."""
    if getattr(args, "threads", None) is not None:
        return args.threads
    num_parameters = getattr(args, "num_parameters", None)  # set by _check_engine_args
    if num_parameters is None:
        return None
    import torch

    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    return choose_torch_threads(num_parameters, on_cpu)


def llm_from_args(args):
    """The ``LLM`` the engine flags describe (the folder ``_check_engine_args`` resolved)."""
    from tinyvllm import LLM
    from tinyvllm.worker.startup_report import report_lines

    engine_args = EngineArgs.from_cli_args(args, _torch_threads(args))  # vLLM's from_cli_args
    llm = LLM(**{field.name: getattr(engine_args, field.name) for field in dataclasses.fields(engine_args)})
    if llm.device.type == "cuda":  # what start-up chose, in one block (on the CPU a good run prints nothing here)
        lines = report_lines(llm.engine.startup_reports)  # rank 0's, then each rank's own line
        print("\n".join(f"[tinyvllm] {line}" for line in lines), file=sys.stderr)
    return llm


def _bind_port(host: str, port: int):
    """The server's socket, bound now, before the model loads (vLLM binds first too), and
    handed to uvicorn: no other process can take the port in between. ValueError naming the
    port when it cannot be bound (in use, or not an address of this machine)."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed socket's TIME_WAIT is no conflict
    try:
        sock.bind((host, port))
        sock.listen()  # listening, no one else may bind it even with SO_REUSEADDR; clients queue until it serves
    except OSError as error:
        sock.close()
        why = "is in use" if error.errno == errno.EADDRINUSE else f"cannot be bound ({error.strerror or error})"
        raise ValueError(f"--port {port}: {host}:{port} {why}") from None
    return sock


def _serve(args) -> int:
    _check_counts(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if args.api_key == "":
        raise ValueError("--api-key must not be empty")
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):  # vLLM's rule: both or neither
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: give both or neither")
    if args.reasoning_parser is not None:
        from tinyvllm.entrypoints.reasoning import reasoning_parser_class  # no torch, no serve extra

        reasoning_parser_class(args.reasoning_parser)  # a name it does not know: before the model loads
    origins = _allowed_origins(args.allowed_origins)
    shipped = args.model is None  # the shipped model is served as "stdlib_tiny"
    args.pooler = _pooler_args(args)
    _check_engine_args(args)
    sock = _bind_port(args.host, args.port)  # after every value, before the server's imports and the model
    try:
        return _run_serve(args, sock, origins, shipped)
    finally:
        sock.close()


def _run_serve(args, sock, origins, shipped: bool) -> int:
    try:
        from tinyvllm.engine.chat_template import load_chat_template
        from tinyvllm.entrypoints.openai_server import run_server
    except ImportError as error:
        print(f"tinyvllm: error: serve needs the serve extra (pip install 'tinyvllm[serve]'): {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    llm = llm_from_args(args)
    if llm.device.type != "cuda":  # on a GPU llm_from_args printed the whole report
        print(f"[tinyvllm] {llm.startup_report.lines()[0]}", file=sys.stderr)
    name = args.served_model_name or (Path(args.model).name if shipped else args.model)  # "stdlib_tiny"
    run_server(
        llm, name, args.host, args.port, args.max_waiting_requests, chat_template=template, api_key=args.api_key,
        allowed_origins=origins, max_request_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout, sock=sock, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )  # fmt: skip
    return 0


def _allowed_origins(value: str | None) -> list[str] | None:
    """``--allowed-origins``: a JSON list of strings (vLLM's form) or comma-separated origins."""
    if value is None:
        return None
    if value.lstrip().startswith("["):
        try:
            origins = json.loads(value)
        except ValueError as error:
            raise ValueError(f"--allowed-origins is not a JSON list: {error}") from None
        if not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins must list strings, got {value}")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]


def _generate(args) -> int:
    explicit = _check_args(args)
    chat_kwargs = _chat_template_kwargs_arg(args)
    llm = llm_from_args(args)
    params = cli_sampling_params(llm.generation_defaults, explicit)
    start = time.perf_counter()
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        [out] = llm.chat(messages, params, use_tqdm=False, chat_template_kwargs=chat_kwargs)
    else:
        [out] = llm.generate(args.prompt, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    completion = out.outputs[0]
    print(completion.text)
    n = len(completion.token_ids)
    print(
        f"[tinyvllm] prompt {len(out.prompt_token_ids)} tokens, generated {n} tokens in {seconds:.3f} s "
        f"({n / seconds:.1f} tok/s), cached {out.num_cached_tokens} tokens, finish_reason={completion.finish_reason}, "
        f"torch threads {llm.startup_report.torch_threads}"
    )
    return 0


def _one_line(error: BaseException) -> str:
    """The error's message on one line (a message from transformers may span several)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags (nothing is imported that needs torch)."""
    parser = argparse.ArgumentParser(prog="tinyvllm", description="tinyvllm: a teaching implementation of vLLM V1")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    tiny = sub.add_parser("tiny-model", help="write a tiny random-weight model folder")
    tiny.add_argument("folder")
    tiny.add_argument("--family", default="qwen3", choices=["qwen3", "qwen2", "llama"])
    from tinyvllm.stdlib_tiny.train import DESCRIPTION, add_arguments  # no torch at import

    add_arguments(sub.add_parser("train-tiny", help="train a small model on the standard library's sources", description=DESCRIPTION))
    from tinyvllm.trace import command as trace_command  # no torch at import

    trace_parser = sub.add_parser("trace", help="record every engine step and write an HTML viewer", description=trace_command.DESCRIPTION)
    trace_command.add_arguments(trace_parser, _add_model_arg, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # argparse errors: usage, message, exit status 2
    debug = os.environ.get("TINYVLLM_TRACEBACK", "") not in ("", "0")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "train-tiny":
            from tinyvllm.stdlib_tiny.train import run

            return run(args)
        if args.command == "trace":
            from tinyvllm.trace import command as trace_command  # main's own import: build_parser's is its local

            return trace_command.run(args, _check_engine_args, llm_from_args)
        from tinyvllm.models.tiny import build_tiny_model

        print(build_tiny_model(args.folder, args.family))
        return 0
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as a command killed by SIGPIPE
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's last flush cannot fail again
        return EXIT_BROKEN_PIPE
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"tinyvllm: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        if debug:
            raise
        print("tinyvllm: error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
