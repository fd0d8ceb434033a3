"""Replay seed 001's thinking-budget examples (appendix O) and print every state change,
then force ``</think>`` on a real model.

Run: PYTHONPATH=src python tutorials/04_thinking_budget.py

The last part runs ``LLM()`` on the shipped model (``stdlib_tiny``, trained on the
standard library's sources). Its tokenizer has ``<think>`` and ``</think>`` as single
tokens, so the engine builds its reasoning config by itself; the model never saw either
token in training and does not close a think section on its own. With
``thinking_token_budget=6`` the engine forces ``</think>`` after six think tokens. Greedy
decoding: the output is the same on every run.
"""

import torch

from tinyvllm.config import EngineConfig, ReasoningConfig, SchedulerConfig
from tinyvllm.sample.batch_update import BatchUpdate
from tinyvllm.sample.logits_processors import build_logitsprocs
from tinyvllm.sample.sampler import Sampler
from tinyvllm.sample.thinking_budget import ThinkingBudgetStateHolder, compute_force_index
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.input_batch import InputBatch

CPU = torch.device("cpu")
THINK, END_A, END_B, WORD = 1, 2, 3, 7  # <think>, </think> as two tokens, an ordinary token
V = 10

print("== Appendix O.3: force_index ==")
for budget, think_count, spec_len in [(10, 8, 3), (10, 11, 3), (10, 7, 3)]:
    print(f"  budget={budget} think_count={think_count} spec_len={spec_len} -> force_index={compute_force_index(budget, think_count, spec_len)}")

print("\n== A request with budget 3 and a two-token end sequence ==")
config = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=2), reasoning_config=ReasoningConfig((THINK,), (END_A, END_B)))
holder = ThinkingBudgetStateHolder(config.reasoning_config, 2, 0, CPU, False)
batch = InputBatch(2, CPU, build_logitsprocs(config, CPU, False, False), holder)
output: list[int] = []
batch.add_request("r", SamplingParams(temperature=0, thinking_token_budget=3), [5], output)
model_says = [THINK] + [WORD] * 8  # a model that would think forever
for step in range(len(model_says)):
    batch.refresh()
    state = holder._state[0]
    logits = torch.zeros(1, V)
    logits[0, model_says[step]] = 5.0
    token = Sampler()(logits, batch.make_sampling_metadata()).sampled_token_ids.item()
    forced = "forced" if token != model_says[step] else "model"
    print(
        f"  step {step}: in_think={state['in_think']!s:5} in_end={state['in_end']!s:5} think_count={state['think_count']} "
        f"end_count={state['end_count']} force_index={state['force_index']} -> token {token} ({forced})"
    )
    output.append(token)
print(f"  output = {output}")

print("\n== Speculative decoding: budget 10, think_count 8, three drafts ==")
spec_holder = ThinkingBudgetStateHolder(config.reasoning_config, 2, 3, CPU, False)
spec_holder.sync_batch(BatchUpdate(1, [], [(0, SamplingParams(thinking_token_budget=10), [THINK], [])], []))
spec_holder.update_state([[WORD] * 8 + [WORD] * 3], [[WORD] * 3])
logits = spec_holder.apply_to_logits(torch.zeros(3, V), predict_bonus_token=False, spec_token_ids=[[WORD] * 3])
print(f"  force_index = {spec_holder._state[0]['force_index']}; forced rows = {(logits == 1e9).nonzero().tolist()}")

print("\n== The shipped model: a prompt that opens <think>, with and without a budget ==")
from tinyvllm import LLM  # noqa: E402

llm = LLM(device="cpu", num_gpu_blocks_override=64)
tok = llm.get_tokenizer()
reasoning = llm.config.reasoning_config
print(f"  reasoning config from the tokenizer: start {reasoning.reasoning_start_token_ids}, end {reasoning.reasoning_end_token_ids}")
prompt = "def area(radius):\n    <think>"
runs = llm.generate(
    [prompt, prompt],
    [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
     SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, thinking_token_budget=6)],
    use_tqdm=False,
)  # fmt: skip
for label, out in zip(("no budget", "budget 6"), runs):
    ids = out.outputs[0].token_ids
    end = reasoning.reasoning_end_token_ids[0]
    where = ids.index(end) if end in ids else None
    print(f"  {label}: </think> at position {where}; text {tok.decode(ids)!r}")
