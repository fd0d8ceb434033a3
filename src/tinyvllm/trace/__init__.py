"""tinyvllm.trace: pictures of every engine step.

Record a run, then look at it step by step:

    import tinyvllm.trace
    with tinyvllm.trace.record(llm) as t:
        llm.generate(prompts, params)
    t.save_html("trace.html")  # one self-contained file: a slider, arrow keys, inline SVG

``record`` also takes a ``Scheduler``, a ``KVCacheManager`` or an ``InputBatch`` driven by
hand (then ``t.capture(label)`` takes each picture). ``tinyvllm trace --workload NAME``
replays the documents' worked examples (``tinyvllm/trace/workloads.py``).

The modules: ``snapshot`` (the frozen schema), ``invariants`` (what every snapshot must
satisfy), ``recorder`` (reading the live objects), ``runner_state`` (what it reads of the
runner, through the executor, in whichever process the runner lives), ``in_flight`` (the step
still on the device under async scheduling), ``svg_parts`` and ``svg_step`` and
``svg_runs`` (drawing), ``viewer`` (the HTML file), ``workloads`` (the built-in examples),
``command`` (the ``tinyvllm trace`` subcommand).

Layering: this package only reads the engine's state. Nothing in ``core/``, ``worker/``,
``sample/``, ``attention/`` or ``models/`` imports it (``tests/test_import_layers.py``), and
importing it does not import torch.
"""

from tinyvllm.trace.invariants import check_snapshot, check_trace
from tinyvllm.trace.recorder import Recorder, record
from tinyvllm.trace.snapshot import StepSnapshot, Trace

__all__ = ["Recorder", "StepSnapshot", "Trace", "check_snapshot", "check_trace", "record"]
