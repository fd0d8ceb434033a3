"""Drawing primitives for the trace pictures: an SVG canvas, one colour per request, token text.

Concept: the pictures are plain SVG strings built by Python (``svg_step.py`` draws one
step, ``svg_runs.py`` a whole run), so the same drawing serves the HTML viewer, the
static files for pages and slides, and the tests, which count the drawn elements by
their ``data-role`` attributes. This module holds what both share: the ``Canvas`` (a list
of elements and a height), the palette, and how tokens are written in a block.

Follows: seed 002 §3.2's legend, kept as the colours of the three structures: the block
tables orange (橘色块), the prefix cache map yellow (黄色块), the free queue blue (蓝色块).
Mirrors: nothing in vLLM.

Invariants: every string put into the SVG is escaped; every element a test counts carries
``data-role`` (and ``data-request`` / ``data-block`` where it belongs to one).

NOTE 1 (colours): a request keeps its colour for the whole trace, given in order of first
appearance from a palette of ten that stays readable for the common colour-vision
deficiencies (Okabe and Ito's eight, plus two); the eleventh request reuses the first.
"""

from __future__ import annotations

from html import escape

from tinyvllm.trace.snapshot import Trace

WIDTH = 960
MARGIN = 16
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace"
PALETTE = (
    "#E69F00", "#56B4E9", "#009E73", "#D55E00", "#0072B2", "#CC79A7", "#999933", "#882255", "#44AA99", "#F0E442",
)  # fmt: skip
BLOCK_TABLE_ORANGE = "#f4a259"  # seed 002 §3.2's three colours
PREFIX_CACHE_YELLOW = "#f6d55c"
FREE_QUEUE_BLUE = "#7fb3e6"
CACHED_GREY = "#e2e2e2"
INK = "#222222"
MUTED = "#666666"


def lighten(colour: str, amount: float = 0.6) -> str:
    """``colour`` mixed with white (``amount`` of white)."""
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * amount) for c in (r, g, b)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def request_colours(trace: Trace) -> dict[str, str]:
    """Each request id of the trace -> its colour (NOTE 1)."""
    order: dict[str, None] = {}
    for step in trace.steps:
        for r in step.requests:
            order.setdefault(r.request_id, None)
        if step.scheduler is not None:
            for x in step.scheduler.scheduled:
                order.setdefault(x.request_id, None)
        if step.batch is not None:
            for rid in (*step.batch.previous_rows, *step.batch.rows):
                order.setdefault(rid, None)
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(order)}


def tokens_text(trace: Trace, token_ids: tuple[int, ...] | list[int]) -> str:
    """Tokens as the trace prints them, joined: ``ABCD`` for letters, ``0 1 2 3`` for numbers."""
    labels = [trace.token_label(t) for t in token_ids]
    if any(s.isdigit() for s in labels):
        return " ".join(labels)
    return "".join(labels)


def fit(text: str, width: float, size: float = 11) -> str:
    """``text`` cut (with an ellipsis) to about ``width`` pixels at font size ``size``."""
    room = max(int(width / (size * 0.6)), 1)
    return text if len(text) <= room else text[: max(room - 1, 0)] + "\u2026"


def attrs(values: dict[str, object]) -> str:
    return "".join(f' {k.replace("_", "-")}="{escape(str(v))}"' for k, v in values.items() if v is not None)


class Canvas:
    """SVG elements in drawing order, a running height, and the final ``<svg>`` string."""

    def __init__(self, uid: str, width: int = WIDTH) -> None:
        self.uid = uid  # prefixes the ids of the markers and patterns: one page holds many pictures
        self.width = width
        self.parts: list[str] = []
        self.y = 0.0  # where the next row starts

    def rect(self, x: float, y: float, w: float, h: float, fill: str = "none", stroke: str | None = INK, **more) -> None:
        base = {"x": f"{x:.1f}", "y": f"{y:.1f}", "width": f"{max(w, 0):.1f}", "height": f"{h:.1f}", "fill": fill}
        base["stroke"] = stroke
        self.parts.append(f"<rect{attrs(base | more)}/>")

    def text(self, x: float, y: float, s: str, size: float = 11, **more) -> None:
        base = {"x": f"{x:.1f}", "y": f"{y:.1f}", "font-size": size, "fill": more.pop("fill", INK)}
        self.parts.append(f"<text{attrs(base | more)}>{escape(s)}</text>")

    @property
    def arrow(self) -> str:
        return f"url(#{self.uid}-arrow)"

    @property
    def hatch(self) -> str:
        return f"url(#{self.uid}-hatch)"

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = MUTED, **more) -> None:
        base = {"x1": f"{x1:.1f}", "y1": f"{y1:.1f}", "x2": f"{x2:.1f}", "y2": f"{y2:.1f}", "stroke": stroke}
        self.parts.append(f"<line{attrs(base | more)}/>")

    def open(self, **more) -> None:
        self.parts.append(f"<g{attrs(more)}>")

    def close(self) -> None:
        self.parts.append("</g>")

    def heading(self, title: str, subtitle: str = "", swatch: str | None = None) -> None:
        """A panel's title row, with a rule under it; ``swatch``: seed 002's colour of the structure."""
        self.y += 14
        x = MARGIN
        if swatch:
            self.rect(x, self.y + 2, 12, 12, swatch, None, rx=2)
            x += 18
        self.text(x, self.y + 12, title, 13, font_weight="bold")
        x += len(title) * 8 + 12
        if subtitle:
            self.text(x, self.y + 12, fit(subtitle, self.width - MARGIN - x), 11, fill=MUTED)
        self.line(MARGIN, self.y + 18, self.width - MARGIN, self.y + 18, "#cccccc")
        self.y += 26

    def render(self, title: str, role: str) -> str:
        height = int(self.y + MARGIN)
        defs = (
            "<defs>"
            f'<marker id="{self.uid}-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
            f'<path d="M 0 0 L 10 5 L 0 10 z" fill="{MUTED}"/></marker>'
            f'<pattern id="{self.uid}-hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
            '<rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#b0b0b0" stroke-width="2"/></pattern>'
            "</defs>"
        )
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{height}" '
            f'viewBox="0 0 {self.width} {height}" font-family="{escape(FONT)}" data-role="{role}" role="img">'
            f"<title>{escape(title)}</title>{defs}"
            f'<rect x="0" y="0" width="{self.width}" height="{height}" fill="#ffffff"/>' + "".join(self.parts) + "</svg>"
        )


def wrap(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at spaces."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            if line and len(line) + 1 + len(word) > width:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return [line for line in lines if line] or []
