"""RequestQueue: the order of the waiting queue, and whom to preempt (scheduling policies).

Concept: the scheduler admits waiting requests in the order its waiting queue gives, and
preempts a running request when the KV cache is full. Both follow one policy:
``"fcfs"`` (first come, first served: the default) or ``"priority"`` (a request's
``priority`` first, lower served earlier, then its arrival).

Mirrors: ``vllm/v1/core/sched/request_queue.py`` (``SchedulingPolicy``, ``FCFSRequestQueue``,
``PriorityRequestQueue``, ``create_request_queue``) and the victim choice in
``vllm/v1/core/sched/scheduler.py`` (``max(self.running, key=(priority, arrival_time))``).

Invariants (``check_invariants``): the priority queue is a heap of
``(priority, arrival_time, seq, request)`` entries whose keys are their requests' own; each
request is in a queue at most once.

NOTE 1 (lower is sooner): ``priority`` is an int, as in vLLM; lower values are served first
(as Unix ``nice``). Equal priorities go by ``arrival_time``, then by the order they were
queued (``seq``), so a queue of equal priorities is served first come, first served. vLLM
breaks exact ties of both by request id.
NOTE 2 (a heap has no front): FCFS puts a preempted request back at the *front*; a priority
queue puts it back by its key. Its arrival time is older than that of later requests of
its priority, so it still comes before them, but a more urgent request that arrived since
goes first.
NOTE 3 (the victim): under FCFS, the last running request (the one admitted last, seed 003's
"preempt the lowest-priority request"); under priority, the running request with the
largest ``(priority, arrival_time)``, the last in the running list among equal keys. That
request may already have been scheduled earlier in the same step: the scheduler then
takes its tokens back (``scheduler.py`` NOTE 7).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from tinyvllm.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)


def check_policy(policy: object, name: str = "scheduling_policy") -> SchedulingPolicy:
    """The one check of a policy name: TypeError for a non-str, ValueError naming any other."""
    if not isinstance(policy, str):
        raise TypeError(f"{name} must be a str, got {policy!r}")
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"{name} must be one of {SCHEDULING_POLICIES}, got {policy!r}")
    return policy


# --8<-- [start:victim]
def priority_key(request: Request) -> tuple[int, float]:
    """What orders requests under the priority policy: lower first (NOTE 1)."""
    return (request.priority, request.arrival_time)


def preemption_victim(running: Sequence[Request], policy: SchedulingPolicy) -> int:
    """The index in ``running`` of the request to preempt when the KV cache is full (NOTE 3)."""
    if not running:
        raise ValueError("no running request to preempt")
    if policy == "fcfs":
        return len(running) - 1
    return max(range(len(running)), key=lambda i: (priority_key(running[i]), i))
# --8<-- [end:victim]


class FCFSRequestQueue(deque):
    """First come, first served: a deque; preempted requests go back to the front."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: Sequence[Request]) -> None:
        """Put ``requests`` back at the front, in the order given."""
        self.extendleft(reversed(requests))

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def check_invariants(self) -> None:
        assert len({id(r) for r in self}) == len(self), "a request is queued twice"


# --8<-- [start:priority_queue]
class PriorityRequestQueue:
    """A heap ordered by ``(priority, arrival_time)``, then by insertion (NOTE 1); iterating
    gives the order requests would be popped in."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0  # insertion counter: ties of the key keep the order they were queued in

    def add_request(self, request: Request) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (*priority_key(request), self._seq, request))

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[-1]

    prepend_request = add_request  # NOTE 2: no front; back by its key

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        """Remove ``request`` (ValueError if it is not queued); the heap is rebuilt."""
        kept = [entry for entry in self._heap if entry[-1] is not request]
        if len(kept) == len(self._heap):
            raise ValueError(f"{request!r} is not in the waiting queue")
        self._heap = kept
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda entry: entry[:3]))

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def check_invariants(self) -> None:
        heap = self._heap
        for i in range(1, len(heap)):
            assert heap[(i - 1) // 2][:3] <= heap[i][:3], f"heap order broken at {i}"
        for entry in heap:
            assert entry[:2] == priority_key(entry[-1]), f"{entry[-1]!r}: its key changed while queued"
        assert len({id(entry[-1]) for entry in heap}) == len(heap), "a request is queued twice"
# --8<-- [end:priority_queue]


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """An empty waiting queue for ``policy``; ValueError naming any other policy."""
    return FCFSRequestQueue() if check_policy(policy) == "fcfs" else PriorityRequestQueue()
