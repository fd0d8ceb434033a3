"""The block table: each batch row's block ids, kept in one persistent tensor.

Concept: attention finds a request's keys and values through its row of block ids. The
table is a fixed ``[R_max, B_max]`` int32 tensor that lives as long as the runner, with
``B_max = cdiv(max_model_len, block_size)``. It is updated the way the batch changes,
never rebuilt: a request entering row r writes its ids into row r, a running request
appends only the blocks it got this step, ``condense`` moves a row, a departing request
clears its row. Once per step the runner's input buffers copy the rows the step uses up
with the step's other inputs (``input_buffers.py`` NOTE 3), at an address fixed per padded
shape (a CUDA graph reads them there).

Follows: seed 003 "KV cache物理内存分配" (attention reads block ids from the metadata);
seed 000 "完整 CUDA 图捕获" (a captured graph replays on fixed input buffers).
Mirrors: ``vllm/v1/worker/block_table.py`` (``BlockTable``: ``add_row``, ``append_row``,
``move_row``, ``swap_row``, ``commit_block_table``).

Invariants (``check_invariants``): row r holds ``num_blocks[r]`` ids followed by
``PAD_BLOCK_ID`` only; rows of no request (``num_blocks[r] == 0``) are all padding, so a
padded request in a CUDA-graph step reads a valid (unused) row.

Left out: several KV-cache groups (hybrid models), the slot mapping (computed on the host
from the runner's block id lists), context parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Fills a row past the request's own blocks. Never read by the kernels (they stop at
# cdiv(seq_len, block_size)); block 0 keeps an accidental read in bounds.
PAD_BLOCK_ID = 0


class BlockTable:
    """Persistent ``[max_num_reqs, max_num_blocks_per_req]`` block ids (module header)."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        if max_num_reqs < 1 or max_num_blocks_per_req < 1:
            raise ValueError(
                f"max_num_reqs = {max_num_reqs} and max_num_blocks_per_req = {max_num_blocks_per_req} must be >= 1"
            )
        self.max_num_blocks_per_req = max_num_blocks_per_req
        shape = (max_num_reqs, max_num_blocks_per_req)
        self.cpu = torch.full(shape, PAD_BLOCK_ID, dtype=torch.int32)  # [R_max, B_max], on the host
        # The row edits go through a numpy view of the same memory: writing a few ids there
        # costs well under a microsecond, against several for torch indexing and a new tensor.
        self.np = self.cpu.numpy()
        self.num_blocks = [0] * max_num_reqs  # row -> ids in use

    # --8<-- [start:rows]
    def add_row(self, row: int, block_ids: Sequence[int]) -> None:
        """Row ``row`` now belongs to a request with these block ids (replacing the row)."""
        self.clear_row(row)
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: Sequence[int]) -> None:
        """The request in ``row`` got more blocks (block tables are append-only)."""
        start, end = self.num_blocks[row], self.num_blocks[row] + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row} would hold {end} blocks, more than {self.max_num_blocks_per_req}")
        if block_ids:
            self.np[row, start:end] = block_ids
        self.num_blocks[row] = end

    def clear_row(self, row: int) -> None:
        self.np[row, : self.num_blocks[row]] = PAD_BLOCK_ID
        self.num_blocks[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """``dst`` takes ``src``'s ids; ``src`` is cleared (condense)."""
        n = self.num_blocks[src]
        self.clear_row(dst)
        self.np[dst, :n] = self.np[src, :n]
        self.num_blocks[dst] = n
        self.clear_row(src)

    def swap_rows(self, a: int, b: int) -> None:
        self.np[[a, b]] = self.np[[b, a]]
        self.num_blocks[a], self.num_blocks[b] = self.num_blocks[b], self.num_blocks[a]

    def rows_for_step(self, num_rows: int) -> np.ndarray:
        """Rows ``0 .. num_rows-1``, a view: the input buffers copy them up with the step."""
        return self.np[:num_rows]  # [R, B_max]
    # --8<-- [end:rows]

    def row(self, row: int) -> list[int]:
        return self.np[row, : self.num_blocks[row]].tolist()

    def check_invariants(self) -> None:
        for r, n in enumerate(self.num_blocks):
            tail = self.cpu[r, n:]
            assert bool((tail == PAD_BLOCK_ID).all()), f"row {r} holds {n} blocks but its tail is {tail.tolist()}"
