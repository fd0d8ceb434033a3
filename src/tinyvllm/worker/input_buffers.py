"""Persistent input buffers: a step's inputs go up in one copy, to addresses fixed per shape.

Concept: a CUDA graph reads its inputs from the addresses it was captured with. So the
runner does not build fresh tensors each step: it allocates, once, one device buffer big
enough for the largest step, and each step writes all its inputs there, padding included:
the token ids, the attention metadata, the block table's rows, the positions the last
step's ids are fed to. The layout (``input_layout``) depends only on the step's padded
shape, so two steps with the same padded shape get views with the same address, shape and
stride: exactly what a replay needs. On a GPU the buffer has a pinned host twin; the host
writes the step there and sends it up in **one** non-blocking copy (NOTE 3).

Follows: seed 000, vLLM design doc "CUDA Graphs" (Chinese translation), "完整 CUDA 图捕获 &
热身" (a graph replays on fixed inputs; the runner pads the batch to the captured size).
Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``self.input_ids``, ``self.positions``,
``query_start_loc``, ``seq_lens``: ``CpuGpuBuffer``s filled in ``_prepare_inputs``) and
``vllm/v1/worker/block_table.py`` (``commit_block_table``), in one buffer here.

Invariants: a step's fields lie back to back from the buffer's first byte, each at an
offset that is a multiple of ``ALIGN`` bytes (Triton compiles a kernel for 16-byte aligned
pointers and another for the rest: aligned, every step runs the first); a step writes every
byte it hands out (the rest keeps stale values that nothing reads); the feed's fields come
last, so their length never moves a graph's inputs.

NOTE 1 (padding rows): input id ``PAD_TOKEN_ID`` (any valid id: its output is discarded),
position 0, slot ``PAD_SLOT_ID``; see ``worker/attention_metadata.py`` NOTE 1.
NOTE 2 (no race on the host twin): a ``non_blocking`` copy reads the pinned twin when the
device reaches it, not when it is queued. Synchronously, the next step writes the twin after
this step's sampled ids came back, so after every copy. With async scheduling the host
prepares step N+1 while step N may still be queued, copy included: ``fill`` records an event
behind its copy and waits for the last one before it writes the twin (vLLM's
``prepare_inputs_event``). The device reaches that copy first in its step, so the wait is
almost always already over; without it, a late device would run step N on step N+1's
inputs. The block table's rows are host memory no copy reads: writing them never waits.
NOTE 3 (one copy, not nine): each copy up is a launch the host pays for (a call into the
driver, some microseconds) while the device may already idle. vLLM copies each input and the
block table on its own; here a decode step's whole input, a few kilobytes, goes up at once.

Left out: M-RoPE positions, input embeddings (multimodal), speculative-decoding buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tinyvllm.attention.metadata import AttentionMetadata
from tinyvllm.worker.attention_metadata import StepInputs

PAD_TOKEN_ID = 0  # NOTE 1
ALIGN = 16  # bytes: where each field may start (the invariant)

# --8<-- [start:layout]
# (name, dtype, length): the inputs of a step of N_pad tokens, R_pad requests, B block ids a
# row and F fed positions, in buffer order; the 8-byte fields first, the feed's last.
FIELDS = (
    ("input_ids", torch.int64, "N"), ("positions", torch.int64, "N"), ("slot_mapping", torch.int64, "N"),
    ("logits_indices", torch.int64, "R"), ("query_start_loc", torch.int32, "R+1"), ("seq_lens", torch.int32, "R"),
    ("block_table", torch.int32, "R*B"), ("fed_positions", torch.int64, "F"), ("fed_rows", torch.int64, "F"),
)  # fmt: skip


def input_layout(num_tokens: int, num_reqs: int, blocks_per_req: int, num_fed: int = 0) -> dict[str, tuple[int, int]]:
    """Each field's ``(byte offset, length)`` for a step of this padded shape: back to back,
    each offset rounded up to a multiple of ``ALIGN`` (the invariant)."""
    lengths = {"N": num_tokens, "R": num_reqs, "R+1": num_reqs + 1, "R*B": num_reqs * blocks_per_req, "F": num_fed}
    layout, end = {}, 0
    for name, dtype, length in FIELDS:
        offset = -(-end // ALIGN) * ALIGN
        layout[name] = (offset, lengths[length])
        end = offset + dtype.itemsize * lengths[length]
    return layout


def layout_bytes(layout: dict[str, tuple[int, int]]) -> int:
    """The bytes a step of this layout writes and copies up: to the end of its last field."""
    dtypes = {name: dtype for name, dtype, _ in FIELDS}
    return max(offset + dtypes[name].itemsize * length for name, (offset, length) in layout.items())
# --8<-- [end:layout]


class InputBuffers:
    """The persistent inputs of the model: one device buffer, one pinned host twin off the CPU."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, blocks_per_req: int, device: torch.device | str) -> None:
        if max_num_tokens < 1 or max_num_reqs < 1 or blocks_per_req < 1:
            raise ValueError(
                f"max_num_tokens = {max_num_tokens}, max_num_reqs = {max_num_reqs} and "
                f"blocks_per_req = {blocks_per_req} must be >= 1"
            )
        device = torch.device(device)
        self.max_num_tokens, self.max_num_reqs, self.blocks_per_req = max_num_tokens, max_num_reqs, blocks_per_req
        size = layout_bytes(input_layout(max_num_tokens, max_num_reqs, blocks_per_req, max_num_reqs))
        on_cpu = device.type == "cpu"
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=not on_cpu)  # [bytes]
        self.device = self.host if on_cpu else torch.zeros(size, dtype=torch.uint8, device=device)  # [bytes]
        self._host_np = self.host.numpy()  # writes through to self.host
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # NOTE 2: behind the last fill's copy
        self._views: tuple | None = None  # (shape key, host views, device views, bytes) of the last shape

    def wait_for_copies(self) -> None:
        """NOTE 2: return once the last step's copy up has read the host twin."""
        if self.copied is not None:
            self.copied.synchronize()

    def last_step(self, name: str) -> np.ndarray:
        """The host's copy of field ``name`` as the last ``fill`` wrote it (a view; ``FIELDS``)."""
        if self._views is None:
            raise ValueError("no step was written into the input buffers yet")
        return self._views[1][name]

    def _views_of(self, key: tuple[int, int, int]) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor], int]:
        """The host (numpy) and device views of every field for a step of shape ``key``, and the
        bytes to copy; kept for the last shape (slicing costs microseconds; steps in a row
        often have one shape)."""
        if self._views is None or self._views[0] != key:
            layout = input_layout(key[0], key[1], self.blocks_per_req, key[2])
            host, device = {}, {}
            for name, dtype, _ in FIELDS:
                offset, length = layout[name]
                end = offset + dtype.itemsize * length
                host[name] = self._host_np[offset:end].view(np.dtype(str(dtype).removeprefix("torch.")))
                device[name] = self.device[offset:end].view(dtype)  # [length]
            device["block_table"] = device["block_table"].view(key[1], self.blocks_per_req)  # [R_pad, B]
            self._views = (key, host, device, layout_bytes(layout))
        return self._views[1], self._views[2], self._views[3]

    # --8<-- [start:fill]
    def fill(
        self,
        token_ids: list[int],
        step: StepInputs,
        block_table: np.ndarray,  # [R_pad, B] int32: the block table's rows of the step
        block_size: int,
        *,
        max_query_len: int,
        max_seq_len: int,
        fed_positions: Sequence[int] = (),
        fed_rows: Sequence[int] = (),
    ) -> tuple[torch.Tensor, AttentionMetadata, tuple[torch.Tensor, torch.Tensor]]:
        """Write one step (already padded) into the buffer and send it up; return ``input_ids``,
        the metadata, and the fed positions and rows (``model_runner.py`` NOTE 12)."""
        n_pad, r_pad = len(step.positions), len(step.seq_lens)
        if len(token_ids) != step.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for a step of {step.num_tokens} tokens")
        if block_table.shape != (r_pad, self.blocks_per_req):
            raise ValueError(f"block table rows of shape {block_table.shape} for {r_pad} requests of {self.blocks_per_req} blocks")
        if n_pad > self.max_num_tokens or r_pad > self.max_num_reqs:
            raise ValueError(f"a step of {n_pad} tokens and {r_pad} requests does not fit input buffers "
                             f"of {self.max_num_tokens} tokens and {self.max_num_reqs} requests")  # fmt: skip
        if len(fed_positions) != len(fed_rows):
            raise ValueError(f"{len(fed_positions)} fed positions for {len(fed_rows)} rows")
        host, device, nbytes = self._views_of((n_pad, r_pad, len(fed_positions)))
        self.wait_for_copies()  # NOTE 2: the last step's copy has read the twin
        self._write_host(host, token_ids + [PAD_TOKEN_ID] * (n_pad - step.num_tokens), step, block_table,
                         fed_positions, fed_rows)  # fmt: skip
        if self.device is not self.host:  # NOTE 3: the step's bytes, in one copy
            self.device[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        if self.copied is not None:
            self.copied.record()  # NOTE 2
        metadata = AttentionMetadata(
            positions=device["positions"],  # [N_pad]
            query_start_loc=device["query_start_loc"],  # [R_pad + 1]
            seq_lens=device["seq_lens"],  # [R_pad]
            slot_mapping=device["slot_mapping"],  # [N_pad]
            block_table=device["block_table"],  # [R_pad, B]
            logits_indices=device["logits_indices"],  # [R_pad]
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=block_size,
        )
        return device["input_ids"], metadata, (device["fed_positions"], device["fed_rows"])  # [N_pad], ..., [F], [F]
    # --8<-- [end:fill]

    @staticmethod
    def _write_host(host: dict[str, np.ndarray], token_ids: list[int], step: StepInputs, block_table: np.ndarray,
                    fed_positions: Sequence[int], fed_rows: Sequence[int]) -> None:  # fmt: skip
        """Every field of the step into its host view (the twin, off the CPU)."""
        host["input_ids"][:] = token_ids
        for name in ("positions", "slot_mapping", "logits_indices", "query_start_loc", "seq_lens"):
            host[name][:] = getattr(step, name)
        host["block_table"][:] = block_table.reshape(-1)
        host["fed_positions"][:], host["fed_rows"][:] = fed_positions, fed_rows
