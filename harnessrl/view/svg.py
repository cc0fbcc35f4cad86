"""Training curves as inline SVG: no plotting library, no script, every label escaped.

In: the records of a run's metrics.jsonl. Out: one `Chart` per panel (reward, eval, pass rate,
packing, compiles, timings), each an SVG line chart of one or more series over the step.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from markupsafe import Markup

WIDTH, HEIGHT = 460, 220
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 14, 34
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")

# (title, [(record kind, key, label)]) of each panel, in page order.
PANELS: tuple[tuple[str, tuple[tuple[str, str, str], ...]], ...] = (
    ("reward", (("train", "reward", "train reward"), ("eval", "eval_reward", "eval reward"))),
    ("pass rate", (("train", "pass_rate", "train"), ("eval", "eval_pass_rate", "eval"))),
    ("packing efficiency", (("train", "packing_efficiency", "packed / slots"),)),
    ("merge breaks per call", (("train", "merge_break_rate", "breaks"),)),
    ("compiles", (("train", "compiles", "learner + server"),)),
    (
        "timings (s)",
        (
            ("train", "t_rollout", "rollouts"),
            ("train", "t_update", "update"),
            ("train", "t_swap", "swap"),
            ("eval", "t_eval", "eval"),
        ),
    ),
)


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[float, float]]


@dataclass(frozen=True)
class Chart:
    title: str
    series: list[Series]
    svg: Markup


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def series_of(records: Sequence[dict[str, Any]], kind: str, key: str, label: str) -> Series:
    points = []
    for r in records:
        x, y = _number(r.get("step")), _number(r.get(key))
        if r.get("kind", "train") == kind and x is not None and y is not None:
            points.append((x, y))
    return Series(label, points)


def _ticks(low: float, high: float) -> list[float]:
    if high <= low:
        return [low]
    return [low + (high - low) * i / 4 for i in range(5)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def line_chart(title: str, series: Sequence[Series]) -> Chart:
    """An SVG with one polyline (and point markers) per series, axes and a legend."""
    drawn = [s for s in series if s.points]
    xs = [p[0] for s in drawn for p in s.points] or [0.0, 1.0]
    ys = [p[1] for s in drawn for p in s.points] or [0.0, 1.0]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(0.0, min(ys)), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0) * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img">',
        f"<title>{html.escape(title)}</title>",
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#999"/>',
    ]
    for t in _ticks(y0, y1):
        y = py(t)
        out.append(
            f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e3e3"/>'
        )
        out.append(f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    steps = x1 - x0 <= 10 and all(x == int(x) for x in xs)  # a short run: every step
    for t in [float(v) for v in range(int(x0), int(x1) + 1)] if steps else _ticks(x0, x1):
        x = px(t)
        out.append(f'<text x="{x:.1f}" y="{TOP + ph + 16}" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 3}" text-anchor="middle">step</text>')
    for i, s in enumerate(drawn):
        color = COLORS[i % len(COLORS)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        out.append(
            f'<polyline class="series" fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>'
        )
        for x, y in s.points:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{color}"/>')
        ly = TOP + 14 + 14 * i
        out.append(f'<rect x="{LEFT + 8}" y="{ly - 9}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{LEFT + 22}" y="{ly}">{html.escape(s.label)}</text>')
    if not drawn:
        out.append(
            f'<text x="{LEFT + pw / 2}" y="{TOP + ph / 2}" text-anchor="middle">no data</text>'
        )
    out.append("</svg>")
    return Chart(title, list(series), Markup("\n".join(out)))


def charts(records: Sequence[dict[str, Any]]) -> list[Chart]:
    """Every panel of PANELS drawn from `records` (panels without any point say so)."""
    return [
        line_chart(title, [series_of(records, *spec) for spec in specs]) for title, specs in PANELS
    ]
