"""``--model`` takes a Hugging Face model id (issue 24): ``models/hub.py``, ``LLM(model, revision=...)``,
``tinyvllm generate|serve --model ID [--revision R]``.

No test touches the network. Each builds a Hugging Face hub cache in ``tmp_path`` the way
``huggingface_hub`` lays one out (``models--{org}--{name}/refs/{ref}`` holding a commit
hash, ``snapshots/{hash}/{file}`` a relative symlink to ``blobs/{sha256}``) from a tiny
model folder, points ``HF_HUB_CACHE`` and ``HF_HOME`` at it and sets ``HF_HUB_OFFLINE=1``,
so that the real ``huggingface_hub.snapshot_download`` resolves ids from the cache alone.
The online failures (an id or a revision the hub does not know, a gated repository, no
network) are the hub's own error classes, raised by a stand-in for
``huggingface_hub.snapshot_download``.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.errors as hub_errors
import pytest
from huggingface_hub.utils import filter_repo_objects
from test_cli import ENV, assert_one_line_error

from tinyvllm import LLM, SamplingParams, cli
from tinyvllm.models import hub
from tinyvllm.models.hub import ALLOW_PATTERNS, IGNORE_PATTERNS, resolve_model

ENGINE = dict(device="cpu", max_model_len=64, block_size=4)
REPO = "org/tiny-qwen3"
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [40, 41, 42]}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def commit_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # 40 hex digits, like a git commit


class HubCache:
    """A hub cache under ``root``, filled the way ``huggingface_hub`` fills one."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def repo_dir(self, repo_id: str) -> Path:
        return self.root / ("models--" + repo_id.replace("/", "--"))

    def add(self, repo_id: str, folder: Path, ref: str = "main", files: list[str] | None = None) -> Path:
        """Cache ``folder``'s files (or just ``files``) as the snapshot ``ref`` points at; its path."""
        commit = commit_hash(f"{repo_id}@{ref}")
        repo = self.repo_dir(repo_id)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (repo / "blobs").mkdir(exist_ok=True)
        for source in sorted(folder.iterdir()):
            if files is not None and source.name not in files:
                continue
            data = source.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / source.name).symlink_to(Path("..", "..", "blobs", blob.name))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline: the hub reads the file as it is
        return snapshot.resolve()  # as snapshot_download returns it (its cache_dir resolved)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> Path:
    """A second tiny Qwen3, same shapes and tokenizer, other random weights."""
    from tinyvllm.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("seed1") / "qwen3", "qwen3", seed=1)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> HubCache:
    """An empty hub cache in ``tmp_path``, found through the environment; the hub is offline."""
    home = tmp_path / "hf_home"
    (home / "hub").mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return HubCache(home / "hub")


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def hub_env(cache: HubCache) -> dict[str, str]:
    """The CLI subprocess's environment: test_cli's, plus the cache and offline mode."""
    home = cache.root.parent
    return {**ENV, "HF_HOME": str(home), "HF_HUB_CACHE": str(cache.root), "HF_HUB_OFFLINE": "1"}


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tinyvllm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


# -- a local folder --------------------------------------------------------------------------------


def test_a_local_folder_is_returned_as_it_is_without_asking_the_hub(tiny_model_dirs, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("a local folder must not reach huggingface_hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    folder = tiny_model_dirs["qwen3"]
    assert resolve_model(folder) == folder
    assert resolve_model(str(folder)) == folder


def test_a_local_folder_wins_over_a_hub_id_of_the_same_spelling(
    cache, tiny_model_dirs, other_weights, tmp_path, monkeypatch
):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    workdir = tmp_path / "work"
    shutil.copytree(other_weights, workdir / REPO)
    monkeypatch.chdir(workdir)
    assert resolve_model(REPO) == Path(REPO)  # the folder ./org/tiny-qwen3, not the cached snapshot
    assert resolve_model(REPO).resolve() == (workdir / REPO).resolve()


def test_a_revision_with_a_local_folder_is_refused(tiny_model_dirs):
    folder = tiny_model_dirs["qwen3"]
    with pytest.raises(ValueError) as info:
        resolve_model(folder, revision="v2")
    message = str(info.value)
    assert "revision 'v2'" in message and str(folder) in message and "local folder" in message


@pytest.mark.parametrize(
    ("model", "words"),
    [("/no/such/folder", ["'/no/such/folder'", "does not exist", "not a Hugging Face model id"]),
     ("a/b/c", ["'a/b/c'", "does not exist", "not a Hugging Face model id"]),
     ("./nope", ["'./nope'", "does not exist"]),
     ("", ["''", "does not exist"])],
)  # fmt: skip
def test_neither_a_folder_nor_a_hub_id_is_one_error_without_the_hub(model, words, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ValueError) as info:
        resolve_model(model)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_path_object_is_never_taken_for_a_hub_id(cache, tiny_model_dirs):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    with pytest.raises(ValueError, match="'org/tiny-qwen3' does not exist"):
        resolve_model(Path(REPO))  # a Path means a folder; only a str may be a hub id


@pytest.mark.parametrize(("revision", "exc", "words"),
                         [(5, TypeError, ["revision", "5", "int"]), ("", ValueError, ["revision", "''"]),
                          (b"main", TypeError, ["revision", "b'main'"])])  # fmt: skip
def test_a_bad_revision_is_refused_first(revision, exc, words):
    with pytest.raises(exc) as info:
        resolve_model("org/not-looked-up", revision=revision)
    assert type(info.value) is exc
    for word in words:
        assert word in str(info.value)


# -- an id in the cache, offline -------------------------------------------------------------------


def test_an_id_resolves_to_its_cached_snapshot(cache, tiny_model_dirs):
    snapshot = cache.add(REPO, tiny_model_dirs["qwen3"])
    assert resolve_model(REPO) == snapshot
    assert resolve_model(REPO, revision="main") == snapshot
    assert (snapshot / "model.safetensors").is_symlink()  # the hub's layout: into ../../blobs/


def test_a_one_part_id_resolves_too(cache, tiny_model_dirs):
    snapshot = cache.add("tiny-qwen3", tiny_model_dirs["qwen3"])
    assert cache.repo_dir("tiny-qwen3").name == "models--tiny-qwen3"
    assert resolve_model("tiny-qwen3") == snapshot


def test_llm_from_an_id_generates_what_the_folder_generates(cache, tiny_model_dirs):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    from_hub = LLM(REPO, **ENGINE)
    from_folder = LLM(str(tiny_model_dirs["qwen3"]), **ENGINE)
    tokens = greedy_tokens(from_hub)
    assert tokens == greedy_tokens(from_folder)
    assert [len(t) for t in tokens] == [6, 6]


def test_a_revision_selects_its_snapshot(cache, tiny_model_dirs, other_weights):
    main = cache.add(REPO, tiny_model_dirs["qwen3"])
    v2 = cache.add(REPO, other_weights, ref="v2")
    assert resolve_model(REPO) == main
    assert resolve_model(REPO, revision="v2") == v2
    assert resolve_model(REPO, revision=v2.name) == v2  # a commit hash names its snapshot directly
    tokens_v2 = greedy_tokens(LLM(REPO, revision="v2", **ENGINE))
    assert tokens_v2 == greedy_tokens(LLM(str(other_weights), **ENGINE))
    assert tokens_v2 != greedy_tokens(LLM(str(tiny_model_dirs["qwen3"]), **ENGINE))  # the revision mattered


def test_an_unknown_id_offline_is_one_clear_error(cache):
    with pytest.raises(ValueError) as info:
        resolve_model("org/nope")
    message = str(info.value)
    assert "\n" not in message
    for word in ("'org/nope'", "revision 'main'", "neither a local folder nor in the Hugging Face cache",
                 str(cache.root), "HF_HUB_OFFLINE=1", "hf download org/nope"):  # fmt: skip
        assert word in message, (word, message)


def test_an_unknown_revision_offline_names_the_revision(cache, tiny_model_dirs):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    with pytest.raises(ValueError) as info:
        resolve_model(REPO, revision="v9")
    message = str(info.value)
    for word in (f"'{REPO}'", "revision 'v9'", "HF_HUB_OFFLINE=1", f"hf download {REPO} --revision v9"):
        assert word in message, (word, message)


# -- the cache's own files: refs/<revision> and the tree listing (issue 36 item 10) -----------------


def _unlinked(path: Path) -> Path:
    path.unlink(missing_ok=True)
    return path


BROKEN_REFS = {  # each leaves refs/main unusable; the hub would read it as it is
    "binary": lambda ref: ref.write_bytes(b"\xff\xfe\x00binary"),
    "not-a-hash": lambda ref: ref.write_text("../.."),  # the hub would join it to snapshots/
    "dev-zero": lambda ref: _unlinked(ref).symlink_to("/dev/zero"),
    "too-long": lambda ref: ref.write_text("a" * 5000),
    "directory": lambda ref: _unlinked(ref).mkdir(),
}


@pytest.mark.parametrize("case", sorted(BROKEN_REFS))
def test_a_broken_ref_in_the_cache_is_one_error_naming_the_model_and_the_file(cache, tiny_model_dirs, case):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    ref = cache.repo_dir(REPO) / "refs" / "main"
    BROKEN_REFS[case](ref)
    with pytest.raises(ValueError) as info:
        resolve_model(REPO)
    message = str(info.value)
    assert "\n" not in message
    for word in (f"model {REPO!r} (revision 'main')", str(ref), "delete"):
        assert word in message, (word, message)


def test_a_fifo_for_a_ref_or_a_tree_listing_is_refused_unopened(cache, tiny_model_dirs):
    from test_model_files import FifoGuard

    snapshot = cache.add(REPO, tiny_model_dirs["qwen3"])
    repo = cache.repo_dir(REPO)
    (repo / "trees").mkdir()
    for fifo_path in (repo / "refs" / "main", repo / "trees" / f"{snapshot.name}.json"):
        saved = fifo_path.read_bytes() if fifo_path.exists() else None
        with FifoGuard(fifo_path) as fifo:
            with pytest.raises(ValueError, match=rf"{REPO!r}.*{fifo_path} cannot be read: .* a named pipe \(FIFO\)"):
                resolve_model(REPO)
        assert not fifo.opened
        fifo_path.unlink()
        if saved is not None:
            fifo_path.write_bytes(saved)
    assert resolve_model(REPO) == snapshot  # a sound cache still resolves


def test_cli_a_binary_ref_is_one_line(cache, tiny_model_dirs, capsys):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    ref = cache.repo_dir(REPO) / "refs" / "main"
    ref.write_bytes(b"\xff\xfe\x00binary")
    assert cli.main(["generate", "--model", REPO, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinyvllm: error: ") and "Traceback" not in err
    assert f"model {REPO!r}" in err and str(ref) in err


def test_llm_refuses_an_unknown_id_before_anything_else(cache):
    with pytest.raises(ValueError, match="'org/nope'.*HF_HUB_OFFLINE=1"):
        LLM("org/nope", **ENGINE)
    with pytest.raises(TypeError, match="revision must be"):  # the arguments first, the hub after
        LLM("org/nope", revision=3, **ENGINE)
    with pytest.raises(ValueError, match="block_size"):
        LLM("org/nope", **{**ENGINE, "block_size": 0})


def test_transformers_offline_means_offline_too(cache, tiny_model_dirs, monkeypatch):
    snapshot = cache.add(REPO, tiny_model_dirs["qwen3"])
    monkeypatch.delenv("HF_HUB_OFFLINE")  # unset: TRANSFORMERS_OFFLINE decides, as in huggingface_hub
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    calls = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    assert resolve_model(REPO) == snapshot
    assert calls[0]["local_files_only"] is True
    with pytest.raises(ValueError, match="TRANSFORMERS_OFFLINE=1"):
        resolve_model("org/nope")


def test_pickled_weights_only_are_refused(cache, tiny_model_dirs, tmp_path):
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dirs["qwen3"], pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    cache.add(REPO, pickled)
    with pytest.raises(ValueError) as info:
        resolve_model(REPO)
    message = str(info.value)
    for word in (f"'{REPO}'", "revision 'main'", "no *.safetensors weights", "pytorch_model.bin", "never"):
        assert word in message, (word, message)


# -- what is downloaded ---------------------------------------------------------------------------

QWEN3_REPO_FILES = [
    ".gitattributes", "LICENSE", "README.md", "config.json", "generation_config.json", "merges.txt",
    "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json",
]  # fmt: skip
SHARDED_REPO_FILES = [
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    "special_tokens_map.json", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
]  # fmt: skip
NEVER = [
    "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json", "model.pt",
    "consolidated.00.pth", "tf_model.h5", "flax_model.msgpack", "model.onnx", "model-q4_k_m.gguf",
    "original/consolidated.00.pth", "original/tokenizer.model", "onnx/model.safetensors", "training_args.bin",
]  # fmt: skip


def test_only_config_tokenizer_and_safetensors_files_are_fetched():
    wanted = set(QWEN3_REPO_FILES[3:]) | set(SHARDED_REPO_FILES)
    every = QWEN3_REPO_FILES + SHARDED_REPO_FILES + NEVER
    kept = set(filter_repo_objects(every, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)))
    assert kept == wanted


def test_online_the_hub_is_asked_for_those_files_at_the_revision(cache, tiny_model_dirs, monkeypatch):
    snapshot = cache.add(REPO, tiny_model_dirs["qwen3"], ref="v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online, whatever the hub read at import
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model(REPO, revision="v2") == snapshot
    [(repo_id, kwargs)] = calls
    assert repo_id == REPO
    assert kwargs["revision"] == "v2" and kwargs["local_files_only"] is False
    assert kwargs["allow_patterns"] == list(ALLOW_PATTERNS) and kwargs["ignore_patterns"] == list(IGNORE_PATTERNS)
    assert Path(kwargs["cache_dir"]) == cache.root


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.hub_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hub.hub_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub.hub_cache_dir() == tmp_path / "elsewhere"


# -- the hub's errors, online ---------------------------------------------------------------------


def _http_library():
    """The HTTP library the installed huggingface_hub builds its errors on (httpx2, or httpx before 2.x)."""
    return importlib.import_module(hub_errors.Response.__module__.split(".")[0])


def _http_error(cls: type[Exception], status: int, message: str) -> Exception:
    """One of the hub's HTTP errors, with a response as its HTTP library (httpx or httpx2) builds one."""
    http = _http_library()
    url = f"https://huggingface.co/api/models/{REPO}"
    return cls(message, response=http.Response(status, request=http.Request("GET", url)))


def _connect_error() -> Exception:
    return _http_library().ConnectError("[Errno -3] Temporary failure in name resolution")


def _unreachable() -> Exception:
    error = hub_errors.LocalEntryNotFoundError(
        "An error happened while trying to locate the files on the Hub, and we cannot find the appropriate"
        " snapshot folder for the specified revision on the local disk. Please check your internet connection"
    )
    error.__cause__ = _connect_error()
    return error


ONLINE_ERRORS = {
    "repository-not-found": (lambda: _http_error(hub_errors.RepositoryNotFoundError, 404, "404\n\nRepository Not Found"),
                             ["'org/tiny-qwen3'", "neither a local folder nor a model on the Hugging Face hub",
                              "hf auth login"]),
    "gated": (lambda: _http_error(hub_errors.GatedRepoError, 403, "403 Client Error.\n\nCannot access gated repo"),
              ["'org/tiny-qwen3'", "gated", "https://huggingface.co/org/tiny-qwen3", "hf auth login"]),
    "revision-not-found": (lambda: _http_error(hub_errors.RevisionNotFoundError, 404, "404\n\nRevision Not Found"),
                           ["'org/tiny-qwen3'", "no revision 'v9'", "branch, tag or commit hash"]),
    "server-error": (lambda: _http_error(hub_errors.HfHubHTTPError, 503, "503 Server Error: Service Unavailable"),
                     ["'org/tiny-qwen3'", "revision 'v9'", "503 Server Error"]),
    "unreachable-and-not-cached": (_unreachable, ["'org/tiny-qwen3'", "revision 'v9'",
                                                  "neither a local folder nor in the Hugging Face cache",
                                                  "could not be reached", "ConnectError", "name resolution"]),
    "connection-error-escaping-the-hub": (_connect_error, ["'org/tiny-qwen3'", "could not be reached", "ConnectError"]),
    "cache-not-writable": (lambda: PermissionError(13, "Permission denied", "/ro/hub/models--org--tiny-qwen3"),
                           ["'org/tiny-qwen3'", "Permission denied"]),
}  # fmt: skip
if hasattr(hub_errors, "IncompleteSnapshotError"):  # huggingface_hub 2.x
    ONLINE_ERRORS["incomplete-snapshot"] = (
        lambda: hub_errors.IncompleteSnapshotError(
            "The cached snapshot for 'org/tiny-qwen3' is incomplete: 1 file(s) are missing (model.safetensors).",
            snapshot_path="/x",
        ),
        ["'org/tiny-qwen3'", "revision 'v9'", "incomplete", "model.safetensors"],
    )


@pytest.mark.parametrize("case", sorted(ONLINE_ERRORS))
def test_the_hubs_errors_become_one_value_error_line(cache, monkeypatch, case):
    make_error, words = ONLINE_ERRORS[case]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online, whatever the hub read at import
    error = make_error()

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ValueError) as info:
        resolve_model(REPO, revision="v9")
    assert type(info.value) is ValueError and info.value.__cause__ is error
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_a_bug_inside_the_hub_keeps_its_traceback(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online, whatever the hub read at import

    def buggy(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'sha'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", buggy)
    with pytest.raises(AttributeError):
        resolve_model(REPO)


# -- the command line ------------------------------------------------------------------------------


def test_cli_generate_takes_a_hub_id(cache, tiny_model_dirs):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    prompt = "def add(a, b):"
    out = run_cli(hub_env(cache), "generate", "--model", REPO, "--prompt", prompt, "--device", "cpu",
                  "--max-model-len", "64", "--max-tokens", "4")  # fmt: skip
    assert out.returncode == 0 and out.stderr == "", out.stderr
    [expected] = LLM(str(tiny_model_dirs["qwen3"]), **ENGINE).generate(
        prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    text, figures = out.stdout.rsplit("\n[tinyvllm] ", 1)
    assert text == expected.outputs[0].text
    assert f"generated {len(expected.outputs[0].token_ids)} tokens" in figures


def test_cli_unknown_id_offline_is_one_line(cache):
    out = run_cli(hub_env(cache), "generate", "--model", "org/nope", "--prompt", "x", "--device", "cpu")
    assert_one_line_error(out, "'org/nope'", "HF_HUB_OFFLINE=1", "hf download org/nope")


def test_cli_generate_revision_selects_the_snapshot(cache, tiny_model_dirs, other_weights, capsys):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    cache.add(REPO, other_weights, ref="v2")
    prompt = "import os"
    argv = ["generate", "--model", REPO, "--revision", "v2", "--prompt", prompt, "--device", "cpu",
            "--max-model-len", "64", "--max-tokens", "5"]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out.rsplit("\n[tinyvllm] ", 1)[0]
    params = SamplingParams(temperature=0, max_tokens=5)
    [expected] = LLM(str(other_weights), **ENGINE).generate(prompt, params, use_tqdm=False)
    assert text == expected.outputs[0].text


def test_cli_revision_with_a_local_folder_is_one_line(tiny_model_dirs, capsys):
    argv = ["generate", "--model", str(tiny_model_dirs["qwen3"]), "--revision", "v2", "--prompt", "x"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinyvllm: error: ") and "revision 'v2'" in err


def test_cli_serve_names_the_model_by_its_id(cache, tiny_model_dirs, monkeypatch):
    from serve_fixtures import require_serve_extra

    require_serve_extra()  # skips without the serve extra (fails under CI's TINYVLLM_REQUIRE_SERVE=1)
    from tinyvllm.entrypoints import openai_server

    snapshot = cache.add(REPO, tiny_model_dirs["qwen3"])
    served = []
    monkeypatch.setattr(openai_server, "run_server", lambda llm, name, *rest, **options: served.append((llm, name)))
    argv = ["serve", "--model", REPO, "--device", "cpu", "--max-model-len", "64", "--num-gpu-blocks-override", "64"]
    assert cli.main(argv) == 0
    [(llm, name)] = served
    assert name == REPO  # vLLM's default: the --model string as given
    assert Path(llm.tokenizer.name_or_path) == snapshot


def test_resolving_imports_neither_torch_nor_the_server(cache, tiny_model_dirs):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    code = (
        "import sys\n"
        "from tinyvllm.models.hub import resolve_model\n"
        "from tinyvllm.models.loader import check_model_folder\n"
        f"check_model_folder(resolve_model({REPO!r}))\n"
        "bad = [m for m in ('torch', 'fastapi', 'uvicorn', 'prometheus_client', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=hub_env(cache), timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_environment_is_left_as_it_was(cache, tiny_model_dirs):
    cache.add(REPO, tiny_model_dirs["qwen3"])
    before = dict(os.environ)
    resolve_model(REPO)
    with pytest.raises(ValueError):
        resolve_model("org/nope")
    assert dict(os.environ) == before
