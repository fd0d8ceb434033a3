"""Replay seed 001's worked examples of the logits processors (appendices N, R2, S2, U2).

Run: PYTHONPATH=src python tutorials/03_logits_processors.py
"""

import torch

from tinyvllm.config import EngineConfig, SchedulerConfig
from tinyvllm.sample.batch_update import BatchUpdate, BatchUpdateBuilder, MoveDirectionality
from tinyvllm.sample.logits_processors import LogitBiasLogitsProcessor, MinPLogitsProcessor, process_dict_updates
from tinyvllm.sampling_params import SamplingParams

CPU = torch.device("cpu")
CONFIG = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=8))
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP


def bias_state(params, _prompt, _output):
    return params.logit_bias or None


def scenario(title, biases, update):
    print(f"{title}\n  before: biases = {biases}")
    changed = process_dict_updates(biases, update, bias_state)
    print(f"  after:  biases = {biases}  (updated={changed})")


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
minp = MinPLogitsProcessor(CONFIG, CPU, False)
minp.update_state(BatchUpdate(3, [], [(0, SamplingParams(min_p=0.1), None, []), (1, SamplingParams(), None, []), (2, SamplingParams(min_p=0.05), None, [])], []))
print(f"  start:  min_p = {[round(v, 2) for v in minp.min_p_cpu[:3].tolist()]}  count = {minp.min_p_count}")
minp.update_state(BatchUpdate(4, [1], [(1, SamplingParams(min_p=0.2), None, []), (3, SamplingParams(), None, [])], [(2, 3, UNI)]))
values = [round(v, 2) for v in minp.min_p_cpu[:4].tolist()]
print(f"  after:  min_p = {values}  count = {minp.min_p_count}  non-zero rows = {sum(1 for v in values if v)}")
print("  (the document's walkthrough ends at [0.1, 0.0, 0.0, 0.05] with count 1)")

print("\n== Appendix U2: holes are handed out lowest first ==")
builder = BatchUpdateBuilder()
for index in (7, 3, 5):
    builder.removed_append(index)
print(f"  removed (descending) = {builder.removed}")
print(f"  pop_removed x3 = {[builder.pop_removed() for _ in range(3)]}")
