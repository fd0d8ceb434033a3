"""Persistent input buffers: the model's inputs live at one address for the whole run.

Concept: a CUDA graph reads its inputs from the addresses it was captured with. So the
runner does not build fresh tensors each step: it allocates, once, one buffer per input
sized for the largest step (``max_num_tokens`` rows, ``max_num_reqs`` requests) and each
step writes the step's values into a prefix of each buffer, padding included, and hands
the model views of those prefixes. Two steps with the same padded shape get views with
the same address, shape and stride: exactly what a replay needs. On a GPU each buffer has
a pinned host twin; the host values are written there and copied up in one
non-blocking copy per buffer.

Follows: seed 000, vLLM design doc "CUDA Graphs" (Chinese translation), "完整 CUDA 图捕获 &
热身" (a graph replays on fixed inputs; the runner pads the batch to the captured size).
Mirrors: ``vllm/v1/worker/gpu_model_runner.py`` (``self.input_ids``, ``self.positions``,
``query_start_loc``, ``seq_lens``: ``CpuGpuBuffer``s filled in ``_prepare_inputs``).

Invariants: the views returned for a step of ``N_pad`` rows and ``R_pad`` requests always
start at the buffers' first element; rows past what the step wrote keep stale values that
nothing reads (every view ends where the step's padded shape ends).

NOTE 1 (padding rows): input id ``PAD_TOKEN_ID`` (any valid id: its output is discarded),
position 0, slot ``PAD_SLOT_ID``; see ``worker/attention_metadata.py`` NOTE 1.
NOTE 2 (no race on the host twin): a ``non_blocking`` copy reads the pinned twin when the
device reaches it, not when it is queued. Synchronously, the next step writes the twins after
this step's sampled ids came back, so after every copy. With async scheduling the host
prepares step N+1 while step N may still be queued, copies included: ``fill`` records an event
behind its copies (and the block table's, queued just before), and the runner calls
``wait_for_copies`` before it writes any twin for the next step (vLLM's
``prepare_inputs_event``). The device reaches those copies first in its step, so the wait is
almost always already over; without it, a late device would run step N on step N+1's inputs.

Left out: M-RoPE positions, input embeddings (multimodal), speculative-decoding buffers.
"""

from __future__ import annotations

import torch

from tinyvllm.attention.metadata import AttentionMetadata
from tinyvllm.worker.attention_metadata import StepInputs

PAD_TOKEN_ID = 0  # NOTE 1


class PersistentBuffer:
    """One fixed-size device tensor and, off the CPU, its pinned host twin."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cpu = device.type == "cpu"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=not on_cpu)  # [size]
        self.np = self.cpu.numpy()  # writes through to self.cpu
        self.device = self.cpu if on_cpu else torch.zeros(size, dtype=dtype, device=device)  # [size]
        # The views of the last size written: (n, cpu[:n], device[:n]).
        self._last: tuple[int, torch.Tensor, torch.Tensor] = (0, self.cpu[:0], self.device[:0])

    def write(self, values: list[int]) -> torch.Tensor:
        """Put ``values`` at the front and return the device view of exactly that prefix."""
        n = len(values)
        if n > self.np.shape[0]:
            raise ValueError(f"{n} values do not fit a persistent buffer of {self.np.shape[0]}")
        self.np[:n] = values
        if self._last[0] != n:  # slicing costs microseconds; steps in a row often have one size
            self._last = (n, self.cpu[:n], self.device[:n])
        _, cpu, device = self._last
        if device is not cpu:
            device.copy_(cpu, non_blocking=True)
        return device


class InputBuffers:
    """The persistent inputs of the model: token ids and the attention metadata tensors."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: torch.device | str) -> None:
        if max_num_tokens < 1 or max_num_reqs < 1:
            raise ValueError(f"max_num_tokens = {max_num_tokens} and max_num_reqs = {max_num_reqs} must be >= 1")
        device = torch.device(device)
        self.max_num_tokens, self.max_num_reqs = max_num_tokens, max_num_reqs
        self.input_ids = PersistentBuffer(max_num_tokens, torch.int64, device)  # [N_max]
        self.positions = PersistentBuffer(max_num_tokens, torch.int64, device)  # [N_max]
        self.slot_mapping = PersistentBuffer(max_num_tokens, torch.int64, device)  # [N_max]
        self.query_start_loc = PersistentBuffer(max_num_reqs + 1, torch.int32, device)  # [R_max + 1]
        self.seq_lens = PersistentBuffer(max_num_reqs, torch.int32, device)  # [R_max]
        self.logits_indices = PersistentBuffer(max_num_reqs, torch.int64, device)  # [R_max]
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # NOTE 2: behind the last fill's copies

    def wait_for_copies(self) -> None:
        """NOTE 2: return once the last step's copies up have read the host twins."""
        if self.copied is not None:
            self.copied.synchronize()

    # --8<-- [start:fill]
    def fill(
        self,
        token_ids: list[int],
        step: StepInputs,
        block_table: torch.Tensor,  # [R_pad, B_max] int32, the committed persistent table
        block_size: int,
        *,
        max_query_len: int,
        max_seq_len: int,
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Write one step (already padded) into the buffers; return ``input_ids`` and metadata."""
        n_pad = len(step.positions)
        if len(token_ids) != step.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for a step of {step.num_tokens} tokens")
        if block_table.shape[0] != len(step.seq_lens):
            raise ValueError(f"block table has {block_table.shape[0]} rows for {len(step.seq_lens)} requests")
        input_ids = self.input_ids.write(token_ids + [PAD_TOKEN_ID] * (n_pad - step.num_tokens))  # [N_pad]
        metadata = AttentionMetadata(
            positions=self.positions.write(step.positions),  # [N_pad]
            query_start_loc=self.query_start_loc.write(step.query_start_loc),  # [R_pad + 1]
            seq_lens=self.seq_lens.write(step.seq_lens),  # [R_pad]
            slot_mapping=self.slot_mapping.write(step.slot_mapping),  # [N_pad]
            block_table=block_table,  # [R_pad, B_max]
            logits_indices=self.logits_indices.write(step.logits_indices),  # [R_pad]
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=block_size,
        )
        if self.copied is not None:
            self.copied.record()  # NOTE 2
        return input_ids, metadata
    # --8<-- [end:fill]
