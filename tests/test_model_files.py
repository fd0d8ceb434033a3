"""Model files that never end (issue 36 item 10): every file the loader reads is a regular
file inside the folder, of bounded size, and the weights' bytes are compared with the
memory there is before any tensor is read (``models/model_files.py``).

A FIFO is guarded by ``FifoGuard``: had the loader opened it (the bug), a thread opens
the write end and closes it, so the read ends with nothing instead of hanging the test.
The absurd checkpoint is a sparse file (``truncate``): it takes no disk and no memory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest

from tinyvllm import cli
from tinyvllm.models import model_files
from tinyvllm.models.loader import (
    check_model_folder,
    expected_tensor_shapes,
    find_weight_files,
    iter_safetensors,
    load_model_spec,
    read_tensor_infos,
)
from tinyvllm.models.tokenizer import load_eos_token_ids, load_tokenizer
from tinyvllm.sampling_defaults import load_generation_defaults


@pytest.fixture
def folder(tiny_model_dirs, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dirs["qwen3"], tmp_path / "model"))


class FifoGuard:
    """A FIFO at ``path``; ``opened`` is True if anything opened it for reading."""

    def __init__(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        os.mkfifo(path)
        self.path, self.opened, self._stop = path, False, threading.Event()
        self._thread = threading.Thread(target=self._unblock, daemon=True)

    def _unblock(self) -> None:
        while not self._stop.is_set():
            try:  # succeeds only while a reader has the FIFO open
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
                self.opened = True
            except OSError:
                time.sleep(0.01)

    def __enter__(self) -> FifoGuard:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# -- config, generation config, index, tokenizer: regular files inside, bounded ---------------

READERS = {
    "config.json": [load_model_spec, check_model_folder],
    "generation_config.json": [load_eos_token_ids, load_generation_defaults, check_model_folder],
    "tokenizer.json": [load_tokenizer, check_model_folder],
    "tokenizer_config.json": [load_tokenizer],
    "model.safetensors.index.json": [find_weight_files, check_model_folder],
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_model_file_linked_to_dev_zero_is_refused_unread(folder, name):
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to("/dev/zero")
    for read in READERS[name]:
        with pytest.raises(ValueError, match=rf"{folder / name} resolves to /dev/zero, outside the model folder"):
            read(folder)


@pytest.mark.parametrize("name", [*sorted(READERS), "merges.txt", "tokenizer.model", "chat_template.jinja"])
def test_a_fifo_in_place_of_a_model_file_is_refused_unopened(folder, name):
    """merges.txt, tokenizer.model, chat_template.jinja: transformers would open them."""
    with FifoGuard(folder / name) as fifo:
        for read in READERS.get(name, [load_tokenizer]):
            with pytest.raises(ValueError, match=rf"{folder / name} cannot be read: .* a named pipe \(FIFO\)"):
                read(folder)
    assert not fifo.opened


def test_a_json_file_past_its_cap_is_refused_unread(folder):
    gen = folder / "generation_config.json"
    cap = model_files.MAX_BYTES["config"]
    with gen.open("r+b") as f:  # the real content, then zeros: sparse, no disk
        f.truncate(cap + 1)
    for read in READERS["generation_config.json"]:
        with pytest.raises(ValueError, match=rf"{gen} is {cap + 1} bytes, more than the 16.0 MiB .* a config file"):
            read(folder)


def test_symlinks_inside_the_folder_and_into_a_hub_snapshots_blobs_are_read(tiny_model_dirs, tmp_path):
    repo = tmp_path / "models--org--m"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in tiny_model_dirs["qwen3"].iterdir():
        shutil.copy(f, repo / "blobs" / f"h-{f.name}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"h-{f.name}"))
    assert check_model_folder(snapshot) == load_model_spec(tiny_model_dirs["qwen3"])
    assert load_eos_token_ids(snapshot) == load_eos_token_ids(tiny_model_dirs["qwen3"])
    (repo / "config.json").write_bytes((snapshot / "config.json").read_bytes())
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(Path("..", "..", "config.json"))  # the repository, not blobs/
    with pytest.raises(ValueError, match="outside the model folder"):
        load_model_spec(snapshot)


# -- weights against memory ---------------------------------------------------------------------


def sparse_checkpoint(folder: Path, **config: object) -> int:
    """Set ``config``'s fields in config.json and replace the weights by one safetensors
    file of the shapes they imply, as a sparse file; the bytes its header describes."""
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | config))
    header, offset = {}, 0
    for name, shape in sorted(expected_tensor_shapes(load_model_spec(folder)).items()):
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with (folder / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return offset


def absurd_checkpoint(folder: Path) -> int:
    """vocab_size 2**31 - 1, and a hidden size large enough that the embedding alone is
    more than twice the memory this machine has free (512 GiB at the tiny model's 64)."""
    rows_bytes = 4 * (2**31 - 1) * 64
    scale = max(1, math.ceil(2 * model_files.available_memory_bytes("cpu") / rows_bytes))
    return sparse_checkpoint(folder, vocab_size=2**31 - 1, tie_word_embeddings=True, hidden_size=64 * scale)


def test_an_absurd_but_consistent_checkpoint_is_refused_from_its_headers(folder):
    needed = absurd_checkpoint(folder)
    assert (folder / "model.safetensors").stat().st_blocks * 512 < 2**20  # sparse: no disk
    assert model_files.weights_nbytes(read_tensor_infos(find_weight_files(folder)).values()) == needed
    pattern = rf"the weights of {folder} need .* \({needed} bytes\) of memory to be read, but only .* on cpu"
    with pytest.raises(ValueError, match=pattern):
        check_model_folder(folder)
    with pytest.raises(ValueError, match=pattern):
        next(iter_safetensors(find_weight_files(folder)))


def test_weights_are_compared_with_the_memory_available_on_the_device(folder, monkeypatch):
    needed = model_files.weights_nbytes(read_tensor_infos(find_weight_files(folder)).values())
    assert needed == sum(4 * math.prod(s) for s in expected_tensor_shapes(load_model_spec(folder)).values())
    asked = []

    def available(device):
        asked.append(device)
        return free

    monkeypatch.setattr(model_files, "available_memory_bytes", available)
    free = needed
    check_model_folder(folder)  # exactly enough
    assert len(dict(iter_safetensors(find_weight_files(folder), device="cpu"))) > 0
    free = needed - 1
    sizes = rf"need .*\({needed} bytes\) of memory to be read, but only .*\({needed - 1} bytes\) is available on"
    with pytest.raises(ValueError, match=rf"{sizes} cpu$"):
        check_model_folder(folder)
    with pytest.raises(ValueError, match=rf"{sizes} cuda:0$"):
        next(iter_safetensors(find_weight_files(folder), device="cuda:0"))
    assert asked[-1] == "cuda:0"


def test_available_memory_is_read_from_the_machine():
    free = model_files.available_memory_bytes("cpu")
    assert isinstance(free, int) and 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_available_memory_falls_back_to_the_physical_pages(monkeypatch):
    """No /proc/meminfo and no SC_AVPHYS_PAGES (macOS): all physical memory, an upper bound."""

    def no_file(*args, **kwargs):
        raise FileNotFoundError("/proc/meminfo")

    def sysconf(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError(name)
        return {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}[name]

    monkeypatch.setattr(model_files, "open", no_file, raising=False)
    monkeypatch.setattr(model_files.os, "sysconf", sysconf)
    assert model_files.available_memory_bytes("cpu") == 4096 * 1000


# -- the command line: one line, exit status 2 ----------------------------------------------------


def _cli_error(folder: Path, capsys) -> str:
    assert cli.main(["generate", "--model", str(folder), "--prompt", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("tinyvllm: error: ") and "Traceback" not in captured.err
    return captured.err


def test_cli_config_linked_to_dev_zero_is_one_line(folder, capsys):
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    assert f"{folder / 'config.json'} resolves to /dev/zero" in _cli_error(folder, capsys)


def test_cli_absurd_checkpoint_is_one_line(folder, capsys):
    needed = absurd_checkpoint(folder)
    err = _cli_error(folder, capsys)
    assert f"the weights of {folder} need" in err and f"({needed} bytes)" in err and "available on cpu" in err


def test_cli_generation_config_folder_with_a_fifo_is_named(folder, tmp_path, capsys):
    """--generation-config FOLDER: its generation_config.json is a FIFO, named as such."""
    other = tmp_path / "defaults"
    other.mkdir()
    with FifoGuard(other / "generation_config.json") as fifo:
        argv = ["generate", "--model", str(folder), "--generation-config", str(other), "--prompt", "x"]
        assert cli.main(argv) == 2
    assert not fifo.opened
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "named pipe (FIFO)" in err and str(other / "generation_config.json") in err
