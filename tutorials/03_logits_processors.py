"""Replay seed 001's worked examples of the logits processors (appendices N, R2, S2, U2).

Run: PYTHONPATH=src python tutorials/03_logits_processors.py

Appendix R2 is replayed twice. First with the appendix's own update, written by hand:
it removes row 1 and also adds a new request at row 1. Then with the same step made by a
real persistent batch (``InputBatch``, which records its changes with
``BatchUpdateBuilder``): there the new request takes the hole with ``pop_removed``, so
row 1 is added but not removed. Both end in the same state. The output is deterministic,
so the docs embed it (``docs/generated/03_logits_processors.txt``) and a test compares
the two; regenerate it with ``python tutorials/regenerate_golden.py 03``.
"""

import torch

from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.batch_update import BatchUpdate, BatchUpdateBuilder, MoveDirectionality
from tinyvllm.sample.logits_processors import LogitBiasLogitsProcessor, MinPLogitsProcessor, process_dict_updates
from tinyvllm.sample.logits_processors.state import LogitsProcessors
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
CONFIG = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=8))
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP


def bias_state(params, _prompt, _output):
    return params.logit_bias or None


def scenario(title, biases, update):
    print(f"{title}\n  before: biases = {biases}")
    changed = process_dict_updates(biases, update, bias_state)
    print(f"  after:  biases = {biases}  (updated={changed})")


def show_update(update):
    moved = [(a, b, d.name) for a, b, d in update.moved]
    print(f"  update: removed = {list(update.removed)}  added at rows {[a[0] for a in update.added]}  moved = {moved}")


def show_minp(label, minp, size):
    values = [round(v, 2) for v in minp.min_p_cpu[:size].tolist()]
    print(f"  {label}  min_p = {values}  count = {minp.min_p_count}  non-zero rows = {sum(1 for v in values if v)}")


print("== Appendix N: process_dict_updates ==")
scenario("N.1 added with logit_bias", {}, BatchUpdate(1, [], [(0, SamplingParams(logit_bias={100: 0.5, 200: -0.3}), None, [])], []))
scenario("N.2 removed", {0: {100: 0.5}, 1: {200: -0.3}}, BatchUpdate(1, [1], [], []))
scenario("N.3 SWAP", {0: {100: 0.5}, 1: {200: -0.3}}, BatchUpdate(2, [], [], [(0, 1, SWAP)]))
scenario("N.4 UNIDIRECTIONAL", {0: {100: 0.5}, 2: {300: 0.8}}, BatchUpdate(3, [], [], [(0, 1, UNI)]))
scenario("N.5 newcomer without bias", {0: {100: 0.5}}, BatchUpdate(1, [], [(0, SamplingParams(), None, [])], []))

print("\n== Appendix S2: LogitBias index tensors ==")
proc = LogitBiasLogitsProcessor(CONFIG, CPU, False)
proc.update_state(BatchUpdate(3, [], [
    (0, SamplingParams(logit_bias={100: 0.5, 200: -0.3}), None, []),
    (1, SamplingParams(), None, []),
    (2, SamplingParams(logit_bias={50: 1.0}), None, []),
], []))
print(f"  rows = {proc.logits_slice[0].tolist()}  tokens = {proc.logits_slice[1].tolist()}  bias = {[round(b, 2) for b in proc.bias_tensor.tolist()]}")


print("\n== Appendix R2: MinP's count ==")
print("the appendix's update, made by hand:")
minp = MinPLogitsProcessor(CONFIG, CPU, False)
minp.update_state(BatchUpdate(3, [], [(0, SamplingParams(min_p=0.1), None, []), (1, SamplingParams(), None, []), (2, SamplingParams(min_p=0.05), None, [])], []))
show_minp("start:", minp, 3)
update = BatchUpdate(4, [1], [(1, SamplingParams(min_p=0.2), None, []), (3, SamplingParams(), None, [])], [(2, 3, UNI)])
show_update(update)
minp.update_state(update)
show_minp("after:", minp, 4)
print("  the appendix ends at [0.1, 0.0, 0.0, 0.05] with count 1. Its listing applies added before removed, so")
print("  removing row 1 wipes the new 0.2 (count 3 -> 2); its walkthrough then takes 1 more off for the 0.0 that")
print("  the move overwrites, which the listing does not do. Ours: removed -> added -> moved, count = non-zero rows")

print("the same step in a real batch: r1 leaves, A (min_p 0.2) and B arrive, rows 2 and 3 swap:")
minp = MinPLogitsProcessor(CONFIG, CPU, False)
batch = InputBatch(8, CPU, LogitsProcessors([minp]))
for req_id, params in [("r0", SamplingParams(min_p=0.1)), ("r1", SamplingParams()), ("r2", SamplingParams(min_p=0.05))]:
    batch.add_request(req_id, params, None, [])
batch.refresh()
show_minp("start:", minp, 3)
batch.remove_request("r1")
batch.add_request("A", SamplingParams(min_p=0.2), None, [])  # pop_removed: takes row 1, the hole
batch.add_request("B", SamplingParams(), None, [])  # no hole left: a new row 3
batch.condense()  # nothing to condense
batch.swap_states(2, 3)
show_update(batch.refresh())
show_minp("after:", minp, 4)
print("  removed is empty: the builder took row 1 out of it when A filled the hole, so no row is ever")
print("  both removed and added, and the order of the two lists cannot change the result")

print("\n== Appendix U2: holes are handed out lowest first ==")
builder = BatchUpdateBuilder()
for index in (7, 3, 5):
    builder.removed_append(index)
print(f"  removed (descending) = {builder.removed}")
print(f"  pop_removed x3 = {[builder.pop_removed() for _ in range(3)]}")
