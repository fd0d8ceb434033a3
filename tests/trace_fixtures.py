"""The built-in trace workloads, each run once per test session, and how to count a picture.

``workload_trace(name)`` runs ``tinyvllm.trace.workloads.run_workload(name)`` the first time
it is asked and hands back the same frozen ``Trace`` after that, so the tests of the
recorder, the viewer and the CLI share one run of each workload (the two that run the
engine build a tiny model and take a few seconds). ``drawn_counts`` reads the counts a
picture draws (by ``data-role``) out of an SVG string; ``snapshot_counts`` says what they
must be for a snapshot. The browser test counts the same roles in the rendered page. A
workload that needs a package the venv lacks (``NEEDS``: the GPU machine has no xgrammar) is
skipped.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest

from tinyvllm.trace.snapshot import StepSnapshot, Trace
from tinyvllm.trace.workloads import run_workload


NEEDS = {"structured-outputs": "xgrammar"}  # a workload's package that a venv may lack (the GPU machine's)


def workload_trace(name: str) -> Trace:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    return _run(name)


@functools.cache
def _run(name: str) -> Trace:
    return run_workload(name)


def snapshot_counts(snapshot: StepSnapshot, panels: tuple[str, ...]) -> Counter:
    """What a step's picture must draw: free blocks, blocks per request, queue entries, rows, written slots."""
    want: Counter = Counter()
    if "free_queue" in panels:
        want["free-block"] = len(snapshot.free_queue)
    if "block_tables" in panels:
        for r in snapshot.requests:
            want[f"table-block:{r.request_id}"] = len(r.block_ids)
    if "scheduler" in panels and snapshot.scheduler is not None:
        want["running"] = len(snapshot.scheduler.running)
        want["waiting"] = len(snapshot.scheduler.waiting)
        for x in snapshot.scheduler.scheduled:
            for row, count in enumerate(x.num_allowed_tokens or ()):
                want[f"allowed:{x.request_id}:{row}"] = count + 1  # + 1: a count of 0 still counts
    if "batch" in panels and snapshot.batch is not None:
        want["batch-row"] = len(snapshot.batch.rows)
    if "kv_cache" in panels:
        want["written-slot"] = len(snapshot.slots)
    return +want  # drop the zeros


def drawn_counts(svg: str) -> Counter:
    """The same counts, read from the elements of an SVG string."""
    got: Counter = Counter()
    for element in re.findall(r"<rect [^>]*>", svg):
        role = re.search(r'data-role="([\w-]+)"', element)
        if role is None:
            continue
        request = re.search(r'data-request="([^"]*)"', element)
        if role[1] == "table-block":
            got[f"table-block:{request[1]}"] += 1
        elif role[1] == "slot":
            got["written-slot"] += 'data-written="1"' in element
        elif role[1] == "free-run":  # a run of free blocks the trace never touched (svg_step NOTE 2)
            got["free-block"] += int(re.search(r'data-count="(\d+)"', element)[1])
        elif role[1] == "allowed-tokens":  # svg_step NOTE 4: one box per constrained request
            for row, count in enumerate(re.search(r'data-allowed="([\d ]*)"', element)[1].split()):
                got[f"allowed:{request[1]}:{row}"] += int(count) + 1
        elif role[1] in ("free-block", "running", "waiting", "batch-row"):
            got[role[1]] += 1
    return +got
