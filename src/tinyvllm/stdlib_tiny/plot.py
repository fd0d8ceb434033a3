"""The shipped model's loss curve as an SVG, written by hand: ``loss_curve.svg``.

Concept: ``tinyvllm train-tiny`` leaves a picture of its run beside the weights, and the
model card embeds it. The picture is a few dozen SVG elements (grid, axes, two polylines,
dots, a legend), so it is written as text here rather than drawn with a plotting library
the runtime would then need: this module imports the standard library only.

Mirrors: nothing in vLLM (an inference engine does not train, nor plot).

Input: the curve ``train.py`` records (``loss_curve.json``): ``step`` and ``train_loss``
(one value per step) and ``eval`` (``{"step", "held_out_loss"}`` records), plus an
optional baseline (the unigram entropy of the held-out tokens). Output: one SVG document,
the same text for the same input.

NOTE 1 (bucket means): the shipped run took about 11,000 steps; a polyline through every
one makes a large file of noise. Past ``max_points`` steps the training loss is drawn as
the means of consecutive runs of ``k`` steps (``k`` the smallest that leaves at most
``max_points`` points), and the legend says ``k``. The held-out loss, measured every few
hundred steps, is drawn point by point.
NOTE 2 (axes): the loss axis runs between whole nats around every value drawn (the
baseline included); the step axis has at least four ticks past 0, at a round interval.
"""

from __future__ import annotations

import math
import statistics


def bucket_means(steps: list[int], values: list[float], max_points: int) -> tuple[list[float], list[float], int]:
    """(x, y, k): the means of consecutive runs of ``k`` steps and of their values, with
    ``k`` the smallest run length that leaves at most ``max_points`` points (k = 1 keeps
    every point). A short last run is averaged on its own (NOTE 1)."""
    k = max(1, math.ceil(len(steps) / max_points))

    def means(seq: list) -> list[float]:
        return [statistics.fmean(seq[i : i + k]) for i in range(0, len(seq), k)]

    return means(steps), means(values), k


def loss_curve_svg(
    curve: dict, baseline: float | None = None, width: int = 640, height: int = 360, max_points: int = 500
) -> str:
    """A hand-written SVG: training loss (a polyline; past ``max_points`` steps, the mean of
    each run of k steps), held-out loss (dots joined by a dashed line) and the unigram
    baseline (a horizontal line), against the step (NOTE 1, NOTE 2)."""
    left, right, top, bottom = 56, 16, 20, 44
    steps, train, k = bucket_means(curve["step"], curve["train_loss"], max_points)
    evals = curve["eval"]
    values = train + [e["held_out_loss"] for e in evals] + ([baseline] if baseline else [])
    y_max = math.ceil(max(values))
    y_min = math.floor(min(values))
    x_max = max(curve["step"][-1], 1)

    def x(step: float) -> float:
        return left + (width - left - right) * step / x_max

    def y(value: float) -> float:
        return top + (height - top - bottom) * (y_max - value) / max(y_max - y_min, 1e-9)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for v in range(y_min, y_max + 1):
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{width - right}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v}</text>')
    tick = 10 ** max(0, len(str(x_max)) - 1)
    while tick > 1 and x_max // tick < 4:  # at least four ticks past 0
        tick //= 2
    for s in range(0, x_max + 1, tick):
        out.append(f'<text x="{x(s):.1f}" y="{height - bottom + 16}" text-anchor="middle">{s}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">step</text>')
    out.append(
        f'<text x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(top + height - bottom) / 2})">loss (nats/token)</text>'
    )
    points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, train))
    out.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="1" points="{points}"/>')
    if evals:
        points = " ".join(f"{x(e['step']):.1f},{y(e['held_out_loss']):.1f}" for e in evals)
        out.append(f'<polyline fill="none" stroke="#d62728" stroke-width="1.5" stroke-dasharray="4 3" points="{points}"/>')
        for e in evals:
            out.append(f'<circle cx="{x(e["step"]):.1f}" cy="{y(e["held_out_loss"]):.1f}" r="2.5" fill="#d62728"/>')
    if baseline:
        out.append(
            f'<line x1="{left}" y1="{y(baseline):.1f}" x2="{width - right}" y2="{y(baseline):.1f}" '
            f'stroke="#2ca02c" stroke-dasharray="6 4"/>'
        )
    train_label = "training loss" if k == 1 else f"training loss (mean of {k} steps)"
    legend = [("#1f77b4", train_label), ("#d62728", "held-out loss"), ("#2ca02c", "unigram entropy (held out)")]
    for i, (color, label) in enumerate(legend if baseline else legend[:2]):
        ly = top + 14 + 16 * i
        out.append(f'<line x1="{width - 250}" y1="{ly - 4}" x2="{width - 230}" y2="{ly - 4}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - 224}" y="{ly}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
