"""Priority scheduling (``scheduling_policy="priority"``): the waiting queue ordered by
(priority, arrival), the preemption victim chosen by the same key, and a victim that was
already scheduled in the step taking its tokens and its freshly cached blocks back
(``core/request_queue.py``, ``core/scheduler.py`` NOTE 7; vLLM's ``--scheduling-policy``)."""

import pytest

from fake_runner import next_token, run_to_completion
from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.async_scheduler import AsyncScheduler
from tinyvllm.core.request_queue import PriorityRequestQueue, create_request_queue, preemption_victim
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.request import Request, RequestStatus
from tinyvllm.sampling_params import SamplingParams

from test_scheduler import step


def make_scheduler(policy="priority", block_size=2, num_gpu_blocks=100, threshold=0, scheduler_cls=Scheduler, **kw):
    config = SchedulerConfig(max_model_len=64, policy=policy, long_prefill_token_threshold=threshold, **kw)
    return scheduler_cls(config, CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks))


def make_req(rid, prompt, priority=0, max_tokens=8, arrival_time=None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), params, priority=priority, arrival_time=arrival_time)


# -- the queue ---------------------------------------------------------------------------------


def test_the_priority_queue_serves_lower_priority_values_first_then_earlier_arrivals():
    queue = PriorityRequestQueue()
    requests = [make_req("late-urgent", [1], priority=-1, arrival_time=5.0), make_req("a", [1], priority=2, arrival_time=1.0),
                make_req("b", [1], priority=0, arrival_time=3.0), make_req("c", [1], priority=0, arrival_time=2.0)]  # fmt: skip
    for r in requests:
        queue.add_request(r)
    assert [r.request_id for r in queue] == ["late-urgent", "c", "b", "a"]  # iteration is pop order
    assert queue.peek_request().request_id == "late-urgent" and len(queue) == 4
    queue.remove_request(requests[2])
    queue.check_invariants()
    assert [queue.pop_request().request_id for _ in range(3)] == ["late-urgent", "c", "a"]
    assert not queue
    with pytest.raises(IndexError):
        queue.pop_request()
    with pytest.raises(ValueError, match="not in the waiting queue"):
        queue.remove_request(requests[0])


def test_equal_keys_keep_the_order_they_were_queued_in():
    """Same priority and the same arrival time: first queued, first served (vLLM falls back
    on the request id; a queue of equal priorities here is plain FCFS)."""
    queue = create_request_queue("priority")
    for rid in ["z", "m", "a"]:
        queue.add_request(make_req(rid, [1], arrival_time=7.0))
    assert [r.request_id for r in queue] == ["z", "m", "a"]


def test_the_invariant_check_sees_a_key_changed_while_queued():
    queue = PriorityRequestQueue()
    r = make_req("r", [1], priority=3)
    queue.add_request(r)
    r.priority = 0
    with pytest.raises(AssertionError, match="key changed"):
        queue.check_invariants()


def test_the_victim_is_the_last_running_under_fcfs_and_the_largest_key_under_priority():
    running = [make_req("low", [1], priority=5, arrival_time=1.0), make_req("high", [1], priority=0, arrival_time=2.0),
               make_req("mid", [1], priority=1, arrival_time=0.5)]  # fmt: skip
    assert preemption_victim(running, "fcfs") == 2
    assert preemption_victim(running, "priority") == 0
    twins = [make_req("x", [1], priority=1, arrival_time=1.0), make_req("y", [1], priority=1, arrival_time=1.0)]
    assert preemption_victim(twins, "priority") == 1  # equal keys: the later in the running list
    with pytest.raises(ValueError, match="no running request"):
        preemption_victim([], "priority")


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="'lifo'"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="'lifo'"):
        create_request_queue("lifo")


# -- admission -----------------------------------------------------------------------------------


def test_waiting_requests_are_admitted_by_priority_not_by_arrival():
    s = make_scheduler(max_num_seqs=1)
    for rid, priority in [("p3", 3), ("p1", 1), ("p2", 2), ("p1-later", 1)]:
        s.add_request(make_req(rid, [10, 11, 12], priority=priority, max_tokens=2))
    admitted = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        admitted += [new.req_id for new in out.scheduled_new_reqs]
    assert admitted == ["p1", "p1-later", "p2", "p3"]


def test_with_equal_priorities_both_policies_schedule_every_step_alike():
    prompts = {f"r{i}": [(5 * i + j) % 40 for j in range(3 + 2 * i)] for i in range(6)}
    schedules = {}
    for policy in ("fcfs", "priority"):
        s = make_scheduler(policy, block_size=4, max_num_batched_tokens=9, max_num_seqs=3)
        for rid, prompt in prompts.items():
            s.add_request(make_req(rid, prompt, max_tokens=5))
        steps = []
        while s.has_unfinished_requests():
            steps.append(dict(step(s)[0].num_scheduled_tokens))
        schedules[policy] = steps
    assert schedules["fcfs"] == schedules["priority"] and len(schedules["fcfs"]) > 5


# -- preemption ----------------------------------------------------------------------------------


def test_the_lowest_priority_request_is_preempted_even_when_it_is_not_the_last_running():
    """Pool of 5 two-token blocks. `low` (priority 5) runs first, `high` joins: both fill their
    last block at the same step. Next step `low` needs a block and there is none: FCFS preempts
    the last running request (`high`), the priority policy preempts `low` itself, and then
    schedules the running requests after it (today's vLLM: they rank higher and may fit, and
    `low` has just freed its blocks), so `high` decodes in that step instead of the step
    scheduling nothing (found by ``bench/vllm_scheduler_replay.py``)."""
    preempted = {}
    for policy in ("fcfs", "priority"):
        s = make_scheduler(policy, num_gpu_blocks=5)
        s.add_request(make_req("low", [1, 2, 3, 4, 5], priority=5, max_tokens=3))
        step(s)  # low: 5 tokens, 3 blocks
        s.add_request(make_req("high", [6, 7, 8], priority=0, max_tokens=3))
        step(s)  # low decodes into its third block; high: 3 tokens, 2 blocks; the pool is full
        out, _ = step(s)  # low's next position needs a fourth block
        preempted[policy] = (set(out.preempted_req_ids), dict(out.num_scheduled_tokens))
    assert preempted["fcfs"] == ({"high"}, {"low": 1})
    assert preempted["priority"] == ({"low"}, {"high": 1})  # the victim was `low` itself; high still runs


def scheduled_victim_scenario(scheduler_cls=Scheduler):
    """`low` (priority 5) is admitted first and prefills in chunks of 4; `mid` (priority 0) joins
    with a 4-token prompt. In step 2, `low` is scheduled its third chunk (blocks 4 and 5, both
    full and cached for this step), then `mid`'s first decode needs a block and the pool of 8
    is empty: the victim is `low`, although it was already scheduled."""
    s = make_scheduler(num_gpu_blocks=8, threshold=4, scheduler_cls=scheduler_cls)
    low = make_req("low", list(range(100, 112)), priority=5, max_tokens=4)
    s.add_request(low)
    step(s)  # low: positions 0-3
    mid = make_req("mid", [1, 2, 3, 4], priority=0, max_tokens=4)
    s.add_request(mid)
    step(s)  # low: positions 4-7; mid: its prompt, samples
    return s, low, mid


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_and_blocks_back():
    s, low, mid = scheduled_victim_scenario()
    out, _ = step(s)
    assert out.preempted_req_ids == {"low"}
    assert dict(out.num_scheduled_tokens) == {"mid": 1}  # low's 4 tokens are not in the step
    assert out.total_num_scheduled_tokens == 1
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["mid"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == ["low"]
    run_to_completion(s)
    for request in (low, mid):  # the tokens the fake model gives without any preemption
        seq = list(request.prompt_token_ids)
        for _ in range(4):
            seq.append(next_token(seq))
        assert request.output_token_ids == seq[request.num_prompt_tokens :], request.request_id
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 8


def test_blocks_a_victim_cached_in_the_step_that_dropped_it_are_not_prefix_hits():
    """`low`'s blocks for positions 8-11 were cached when its chunk was scheduled, but that
    chunk never runs: no request may find them. Its blocks for positions 0-7 were written by
    finished steps and stay hits (when not evicted)."""
    s, low, _ = scheduled_victim_scenario()
    step(s)
    kv = s.kv_cache_manager
    _, num_hit_tokens = kv.get_computed_blocks(low)
    assert num_hit_tokens <= 8  # only positions earlier steps wrote
    assert kv.uncommitted_blocks == []  # the dropped blocks left the step's bookkeeping too
    s.check_invariants()


def test_a_victim_found_before_the_cursor_does_not_make_the_scheduler_skip_a_request():
    """Async scheduling: `old` (priority 9) runs first; its last token is on the device, so the
    scheduler passes over it. `b` then needs a block, and the victim is `old`, which sits
    before the cursor in the running list: the cursor must move back one, or `c` is skipped
    for the whole step (vLLM issue #49097)."""
    s = make_scheduler(num_gpu_blocks=4, scheduler_cls=AsyncScheduler, async_scheduling=True)
    old = make_req("old", [1, 2, 3], priority=9, max_tokens=2)
    s.add_request(old)
    first = s.schedule()  # old's prompt: 2 blocks
    s.update_from_output(first, ModelRunnerOutput(["old"], {"old": 0}, [[50]]))
    s.add_request(make_req("b", [4, 5], priority=0, max_tokens=2))
    s.add_request(make_req("c", [6, 7], priority=1, max_tokens=2))
    second = s.schedule()  # old's last token (a placeholder); b and c's prompts: the pool is full
    assert dict(second.num_scheduled_tokens) == {"old": 1, "b": 2, "c": 2}
    third = s.schedule()  # old is passed over; b needs a block: old is preempted
    assert third.preempted_req_ids == {"old"}
    assert dict(third.num_scheduled_tokens) == {"b": 1, "c": 1}
    s.check_invariants()


def test_a_victims_tokens_go_back_to_the_budget_for_the_requests_after_it():
    """Budget 7, eight two-token blocks. `low` (priority 5) runs first; `mid` and `late` join.
    In step 2 `low` takes 1 token of the budget, then `mid` needs a block and `low` is the
    victim: its token goes back, so `late`'s prefill chunk gets 6 tokens, not 5."""
    s = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=7)
    s.add_request(make_req("low", range(100, 108), priority=5, max_tokens=4))
    step(s)  # low's prompt: 7 of its 8 tokens
    s.add_request(make_req("mid", [1, 2], priority=0, max_tokens=4))
    s.add_request(make_req("late", range(50, 60), priority=1, max_tokens=4))
    step(s)
    assert [r.request_id for r in s.running] == ["low", "mid", "late"]
    out, _ = step(s)
    assert out.preempted_req_ids == {"low"}
    assert dict(out.num_scheduled_tokens) == {"mid": 1, "late": 6}
    assert out.total_num_scheduled_tokens == 7  # the whole budget, low's token included
