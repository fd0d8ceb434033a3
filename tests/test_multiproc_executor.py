"""The multiprocess executor (``executor/multiproc_executor.py``): two worker processes on the
CPU (gloo), every call one message to each rank, results in rank order; every rank samples the
same ids; a worker that dies becomes ``EngineDeadError`` within seconds; no worker process
outlives the engine (``shutdown``, a parent killed with SIGKILL); a bad
``tensor_parallel_size`` is refused before any process starts. Few engine starts: each one
spawns two interpreters that import torch (about 2 s on two cores)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from multiprocessing import resource_tracker
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tinyvllm import LLM, SamplingParams
from tinyvllm.exceptions import EngineDeadError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks processes through /proc")
SRC = str(Path(__file__).resolve().parents[1] / "src")
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def children() -> set[int]:
    """The pids of this process's live (not zombie) children. Spawning starts multiprocessing's
    resource tracker once per interpreter, and it stays: started here first, it is in every
    ``before`` and never counts as the engine's."""
    resource_tracker.ensure_running()
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def last_sampled(worker) -> dict[str, list[int]]:
    """Each request's output tokens as this rank's runner holds them (runs in the worker)."""
    return {rid: list(state.output_token_ids) for rid, state in worker.model_runner.requests.items()}


def rank_of(worker) -> int:
    return worker.rank


def sleep_then_say(worker, seconds: float) -> str:
    time.sleep(seconds)
    return "late"


def interrupted_call(executor) -> None:
    """A Ctrl-C (a KeyboardInterrupt raised in this thread) while the ranks run a call."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            executor.collective_rpc(sleep_then_say, args=(1.0,))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def raise_here(worker):
    raise ValueError(f"rank {worker.rank} says no")


def slow_launches(worker, seconds: float) -> None:
    """From now on every step this rank launches first sleeps ``seconds`` (0: no more)."""
    vars(worker).pop("execute_model_async", None)
    if seconds:
        launch = worker.execute_model_async

        def slow(*args, **kwargs):
            time.sleep(seconds)
            return launch(*args, **kwargs)

        worker.execute_model_async = slow


def failing_launches(worker, rank: int) -> None:
    """From now on rank ``rank`` raises when it launches a step (the other ranks carry on)."""
    if worker.rank == rank:

        def fail(*args, **kwargs):
            raise RuntimeError(f"rank {rank} fails its step")

        worker.execute_model_async = fail


@contextlib.contextmanager
def ctrl_c_after(seconds: float):
    """A Ctrl-C (a KeyboardInterrupt raised in this thread) ``seconds`` into the block."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def qwen3(tiny_model_dirs):
    return str(tiny_model_dirs["qwen3"])


def tp_llm(folder: str, **kwargs) -> LLM:
    return LLM(folder, device="cpu", torch_threads=1, tensor_parallel_size=2, **kwargs)


def test_two_ranks_answer_in_rank_order_and_sample_the_same_ids(qwen3, caplog):
    with caplog.at_level(logging.INFO, logger="tinyvllm.engine.llm_engine"):
        llm = tp_llm(qwen3, seed=3)
    executor = llm.engine.model_executor
    logged = "".join(r.getMessage() for r in caplog.records if r.name == "tinyvllm.engine.llm_engine")
    for report in llm.engine.startup_reports:  # the start-up report has every rank's own line
        assert report.rank_line() in logged and report.weight_bytes > 0 and report.num_kv_heads == 1
    try:
        assert type(executor).__name__ == "MultiprocExecutor"
        assert executor.collective_rpc(rank_of) == [0, 1]
        assert len(set(executor.worker_pids)) == 2 and os.getpid() not in executor.worker_pids
        # seeded sampling: both ranks draw the same ids, step by step (their runners agree)
        prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8, 9]}]
        engine, params = llm.engine, SamplingParams(max_tokens=5, temperature=1.0, seed=11)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt["prompt_token_ids"], params)
        for _ in range(3):
            engine.step()
            per_rank = executor.collective_rpc(last_sampled)
            assert per_rank[0] == per_rank[1] and any(per_rank[0].values())
            engine.check_invariants()  # every rank's runner agrees with the scheduler
        engine.abort_request(["0", "1"])
        interrupted_call(executor)  # the replies it left are dropped before the next call
        assert executor.collective_rpc(rank_of) == [0, 1]
        with pytest.raises(RuntimeError, match="no model runner in this process"):
            llm.engine.model_runner
        assert len(llm.engine.startup_reports) == 2 and llm.startup_report is llm.engine.startup_reports[0]
        # a worker's exception outside a step comes back as itself, naming the rank; the engine is dead then
        with pytest.raises(ValueError, match="rank [01] says no") as error:  # whichever reply came first
            executor.collective_rpc(raise_here)
        rank = str(error.value)[5]
        assert f"worker rank {rank} during raise_here" in "".join(error.value.__notes__)
        with pytest.raises(EngineDeadError):
            llm.generate("again", GREEDY, use_tqdm=False)
    finally:
        pids = executor.worker_pids
        executor.shutdown()
    assert wait_gone(pids, 10) == []


def test_a_killed_worker_is_engine_dead_error_within_seconds_and_shutdown_leaves_no_child(qwen3):
    before = children()
    llm = tp_llm(qwen3)
    executor = llm.engine.model_executor
    assert set(executor.worker_pids) <= children() - before
    os.kill(executor.worker_pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 30
    with pytest.raises(EngineDeadError):  # and every later call
        llm.engine.step()
    assert wait_gone(executor.worker_pids, 10) == []  # the monitor killed rank 0 too
    executor.shutdown()
    assert children() - before == set()


def test_llm_shutdown_ends_the_workers_at_once_and_the_llm_serves_no_more(qwen3):
    before = children()
    llm = tp_llm(qwen3)
    pids = llm.engine.model_executor.worker_pids
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
    llm.shutdown()
    assert wait_gone(pids, 10) == [] and children() - before == set()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
    llm.shutdown()  # a second call does nothing


def test_an_async_launch_waits_for_no_rank_and_ctrl_c_loses_no_step_output(qwen3):
    """Async steps (``executor/step_replies.py``): launching a step writes its message and
    returns; step 1's output comes with the reply to step 2's launch. A Ctrl-C while that
    reply is awaited leaves it owed; the next call reads it and keeps the output, so each
    step's ``result()`` still gives the tokens of an uninterrupted one-rank run."""
    prompt, params = [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = LLM(qwen3, device="cpu", torch_threads=1).generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    expected = list(expected[0].outputs[0].token_ids)
    llm = tp_llm(qwen3, async_scheduling=True)
    engine, executor = llm.engine, llm.engine.model_executor
    try:
        engine.add_request("r", prompt, params)
        first = executor.execute_model(engine.scheduler.schedule(), non_block=True)  # the prompt, token 1
        executor.collective_rpc(slow_launches, args=(1.0,))
        started = time.monotonic()
        second = executor.execute_model(engine.scheduler.schedule(), non_block=True)  # token 2, on a placeholder
        assert time.monotonic() - started < 0.5  # the ranks sleep in the launch; the engine does not wait
        with pytest.raises(KeyboardInterrupt), ctrl_c_after(0.3):
            first.result()  # its output comes with the reply to the second launch, a second from now
        assert executor.collective_rpc(rank_of) == [0, 1]  # reads that reply first, and keeps what it carries
        executor.collective_rpc(slow_launches, args=(0.0,))
        assert first.result().sampled_token_ids == [expected[:1]]
        assert second.result().sampled_token_ids == [expected[1:2]]  # nothing brought it: the executor asks for it
    finally:
        executor.shutdown()


@pytest.mark.parametrize("fault", ["killed", "raises"])
def test_a_rank_lost_with_two_steps_in_flight_is_engine_dead_error_and_leaves_no_process(qwen3, fault):
    """Async scheduling: rank 1 dies (SIGKILL) or raises while it launches a step, the step
    before still unread; the step fails with ``EngineDeadError``, as does every later one, and
    no worker process is left."""
    before = children()
    llm = tp_llm(qwen3, async_scheduling=True)
    engine, executor = llm.engine, llm.engine.model_executor
    pids = executor.worker_pids
    try:
        for i in range(2):
            engine.add_request(str(i), [1 + i, 2, 3, 4], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        engine.step()
        engine.step()  # steady state: a step in flight between calls
        if fault == "killed":
            executor.collective_rpc(slow_launches, args=(2.0,))
            killer = threading.Timer(0.5, os.kill, args=(pids[1], signal.SIGKILL))  # mid-launch, the step before unread
            killer.start()
        else:
            executor.collective_rpc(failing_launches, args=(1,))
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.step()
        assert time.monotonic() - started < 30
        assert not engine.steps_in_flight() and not engine.has_unfinished_requests()  # they failed together
        with pytest.raises(EngineDeadError):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
        assert wait_gone(pids, 10) == []
    finally:
        executor.shutdown()
    assert children() - before == set()


def test_a_bad_tensor_parallel_size_is_refused_before_any_process_starts(qwen3):
    before = children()
    for size, error in [(0, ValueError), (-2, ValueError), ("2", TypeError), (True, TypeError), (3, ValueError)]:
        with pytest.raises(error, match="tensor_parallel_size"):
            LLM(qwen3, device="cpu", tensor_parallel_size=size)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(qwen3, device="cpu", tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(qwen3, device="cpu", tensor_parallel_size=2, distributed_executor_backend="ray")
    assert children() == before
    from tinyvllm.config import ParallelConfig
    from tinyvllm.engine.engine_args import EngineArgs

    for size, backend, resolved in [(1, None, "uni"), (2, None, "mp"), (1, "mp", "mp"), (2, "external_launcher", "external_launcher")]:
        config = EngineArgs(qwen3, device="cpu", tensor_parallel_size=size, distributed_executor_backend=backend)
        assert config.create_engine_config().parallel_config == ParallelConfig(size, resolved)


async def aenumerate(stream):
    count = 0
    async for item in stream:
        count += 1
        yield count, item


def test_a_killed_worker_ends_every_async_stream_with_engine_dead_error(qwen3):
    import asyncio

    from tinyvllm.engine.async_llm import AsyncLLM
    from tinyvllm.engine.engine_args import EngineArgs

    engine = AsyncLLM.from_engine_args(EngineArgs(qwen3, device="cpu", torch_threads=1, tensor_parallel_size=2))
    executor = engine.engine.model_executor
    from tinyvllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def stream(i: int) -> BaseException | None:
        try:
            async for count, _ in aenumerate(engine.generate({"prompt_token_ids": [1 + i, 2, 3]}, params, f"r{i}")):
                if i == 0 and count == 3:  # mid-stream, every request running
                    os.kill(executor.worker_pids[0], signal.SIGKILL)
        except EngineDeadError as error:
            return error
        return None

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(3))), 30)
        finally:
            await engine.shutdown()

    try:
        errors = asyncio.run(main())
    finally:
        executor.shutdown()
    assert all(isinstance(e, EngineDeadError) for e in errors), errors
    assert wait_gone(executor.worker_pids, 10) == []


PARENT = textwrap.dedent(
    """
    import json, sys, time
    from tinyvllm import LLM

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], device="cpu", torch_threads=1, tensor_parallel_size=2)
        print(json.dumps(llm.engine.model_executor.worker_pids), flush=True)
        if sys.argv[2] == "wait":
            time.sleep(600)
    """
)


@pytest.mark.parametrize(
    "end", ["SIGKILL to the parent", pytest.param("Ctrl-C to the process group", marks=pytest.mark.slow),
            pytest.param("the script returns", marks=pytest.mark.slow)],
)  # fmt: skip
def test_no_worker_outlives_its_parent(qwen3, tmp_path, end):
    """SIGKILL: the workers see their parent pipe close (and PR_SET_PDEATHSIG); Ctrl-C (SIGINT
    to the whole group, as a terminal sends it): the workers ignore it, the parent's
    KeyboardInterrupt ends the interpreter, whose exit stops them; a script that returns
    without shutting down: the same exit handler (``weakref.finalize``)."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": SRC}
    mode = "return" if end == "the script returns" else "wait"
    parent = subprocess.Popen(
        [sys.executable, str(script), qwen3, mode], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=env, start_new_session=True,
    )  # fmt: skip
    try:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 2
        if end == "SIGKILL to the parent":
            parent.kill()
        elif end.startswith("Ctrl-C"):
            os.killpg(parent.pid, signal.SIGINT)
        assert parent.wait(30) != 0 or mode == "return"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert wait_gone(pids, 10) == []


@pytest.mark.slow
def test_an_engine_collected_as_garbage_leaves_no_worker(qwen3):
    import gc

    llm = tp_llm(qwen3)
    pids = llm.engine.model_executor.worker_pids
    del llm
    gc.collect()
    assert wait_gone(pids, 15) == []


def test_nccl_wants_a_gpu_per_rank(qwen3, monkeypatch):
    """More ranks than GPUs is refused before any process starts (faked: a one-GPU machine);
    with NCCL rank r takes ``cuda:r``, with gloo the ranks share the engine's device."""
    import dataclasses

    import torch

    from tinyvllm.config import DeviceConfig, EngineConfig, ParallelConfig
    from tinyvllm.executor.multiproc_executor import rank_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("TINYVLLM_DISTRIBUTED_BACKEND", raising=False)
    before = children()
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs a GPU per rank .NCCL., but 1 are present"):
        LLM(qwen3, device="cuda", attention_backend="torch", tensor_parallel_size=2)
    assert children() == before
    config = EngineConfig(device_config=DeviceConfig(device="cuda"))
    assert rank_config(config, 1, "nccl").device_config.device == "cuda:1"
    assert rank_config(config, 1, "gloo") is config
    cpu = dataclasses.replace(config, device_config=DeviceConfig(device="cpu", torch_threads=1))
    assert rank_config(cpu, 1, "gloo") is cpu  # the threads asked for
    shared = dataclasses.replace(cpu, device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig(2, "mp"))
    assert rank_config(shared, 1, "gloo").device_config.torch_threads == max(1, torch.get_num_threads() // 2)


def test_the_tensor_parallel_bench_runs_every_part_and_writes_its_json(qwen3, tmp_path):
    """bench/tensor_parallel.py at tiny settings: the message at 1 / 32 / 256 requests, the
    Qwen3-0.6B shape's bytes per rank (the figures the sharded layers give), a decode step
    at N = 1 and N = 2 on the tiny Qwen3, and async steps on two ranks with their traffic."""
    out = tmp_path / "tensor_parallel.json"
    env = {**os.environ, "PYTHONPATH": SRC}
    bench = Path(__file__).resolve().parents[1] / "bench" / "tensor_parallel.py"
    command = [
        sys.executable, str(bench), "--part", "all", "--quick", "--out", str(out), "--models", "tiny_qwen3",
        "--tiny-model", qwen3, "--decode-repeats", "2", "--steps", "2", "--batches", "1", "2", "--async-batches", "2",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    parts = json.loads(out.read_text())["parts"]
    message = parts["message"]
    assert set(message["by_num_reqs"]) == {"1", "32", "256"}
    sizes = [message["by_num_reqs"][n]["message_bytes"] for n in ("1", "32", "256")]
    assert sizes == sorted(sizes) and all(r["send_ms"] > 0 for r in message["by_num_reqs"].values())
    memory = parts["memory"]["by_tensor_parallel_size"]
    # bf16: 596,049,920 parameters whole; at N = 2 the 65,536 norm weights whole, the rest halved
    assert [memory[n]["weight_bytes_per_rank"] for n in ("1", "2")] == [1_192_099_840, 596_115_456]
    assert memory["2"]["weight_ratio_to_1"] <= 0.55 and memory["4"]["kv_heads_per_rank"] == 2
    per_block = [memory[n]["kv_bytes_per_block_per_rank"] for n in ("1", "2", "4")]
    assert per_block == [28 * 2 * 16 * 8 * 128 * 2, 28 * 2 * 16 * 4 * 128 * 2, 28 * 2 * 16 * 2 * 128 * 2]  # L 2 B Hkv D bf16
    assert memory["2"]["kv_tokens_per_rank"] > 2 * memory["1"]["kv_tokens_per_rank"]  # half the heads and less weight
    decode = parts["decode"]
    assert decode["goal"] is None and decode["repeats"] == 1  # --quick halves the repeats
    ms = decode["models"]["tiny_qwen3"]["ms_per_step"]
    assert set(ms) == {"tp1_threads1", "tp1_threads2", "tp2_threads1_per_rank"}
    assert all(set(by_batch) == {"1", "2"} and min(by_batch.values()) > 0 for by_batch in ms.values())
    steps = parts["async"]["versions"]["this"]["by_batch"]["2"]  # counted by wrapping the executor's pipes
    assert steps["messages_per_step_per_rank"] == steps["replies_per_step_per_rank"] == 1 and steps["ms_per_step"] > 0


def test_torchrun_with_the_external_launcher_gives_one_process_tokens(qwen3, tmp_path):
    """Two ranks started by ``torchrun`` (gloo on the CPU), each running the same engine, give
    rank 0 the tokens of one process."""
    from tinyvllm.executor.multiproc_executor import free_port

    from tp_torchrun_script import generate  # tests/ is on the path, as for engine_compare

    out = tmp_path / "tokens.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(Path(__file__).parent / "tp_torchrun_script.py"), qwen3, str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["tokens"] == generate(qwen3)


def test_the_command_line_refuses_a_bad_size_naming_its_flag(qwen3, capsys, tmp_path):
    from tinyvllm import cli

    before = children()
    assert cli.main(["generate", "--prompt", "p", "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size must be an int >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["generate", "--model", qwen3, "--prompt", "p", "--tensor-parallel-size", "3"]) == 2
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in capsys.readouterr().err
    assert cli.main(["serve", "--tensor-parallel-size", "2", "--distributed-executor-backend", "uni"]) == 2
    assert "--distributed-executor-backend 'uni' runs one worker" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n", encoding="utf-8")
    assert cli.main(["trace", "--prompts", str(prompts), "--tensor-parallel-size", "0"]) == 2  # trace takes N > 1
    assert "--tensor-parallel-size must be an int >= 1, got 0" in capsys.readouterr().err  # (test_trace_tensor_parallel.py)
    assert cli.main(["trace", "--prompts", str(prompts), "--model", qwen3, "--tensor-parallel-size", "3"]) == 2
    assert "--tensor-parallel-size 3 does not divide the model's 4 attention heads" in capsys.readouterr().err
    assert children() == before


def test_ctrl_c_is_held_back_while_a_message_is_written():
    """A call's message reaches every rank or none: SIGINT waits until the writes are done."""
    from tinyvllm.executor.multiproc_executor import _sigint_held

    written = False
    with pytest.raises(KeyboardInterrupt):
        with _sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            written = True  # not interrupted inside the block
    assert written
