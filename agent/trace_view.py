"""The HTML waterfall of one trace (``GET /v1/traces/{trace_id}/view``).

This module owns the rendering of a trace dict (``agent/trace.py``'s ``Trace.to_dict``)
as one self-contained HTML page: inline CSS and inline SVG, no script, no external fetch,
so it opens from a file, behind a strict Content-Security-Policy, or with JS disabled.
Each span is a bar on a shared time axis, indented by depth and coloured by kind; the
speculation cycles of a span are drawn as thin bars in a lane just below it, coloured by
accepted length; hovering a bar shows its attributes (SVG ``<title>``); a summary table
gives each top-level stage's share of the run.

Every piece of text from the trace goes through ``html.escape``: span names and
attributes may hold user text. Written by hand (not a plotting library) because the page
must be a few kilobytes of static markup with per-bar tooltips and no dependency.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping
from typing import Any

from specrag.agent.trace import CYCLE_EVENT, stage_durations
from specrag.decoding.stats import CYCLE_STAGES

LABEL_W = 380  # px for the indented span names and their durations
BAR_W = 820  # px for the time axis
AXIS_H = 28
ROW_H = 22
LANE_H = 14
INDENT = 14
MAX_TITLE_ATTRS = 40
MAX_ATTR_CHARS = 200

KIND_COLOURS = {
    "retrieval": "#4e79a7",
    "prompt": "#f28e2b",
    "prefill": "#b07aa1",
    "decode": "#76b7b2",
    "tool": "#59a14f",
    "other": "#bab0ac",
}
ERROR_COLOUR = "#d62728"
PLAIN_STEP_COLOUR = "#9e9e9e"  # a γ = 0 cycle: speculation off for that step
# Red -> yellow -> green (ColorBrewer RdYlGn ends and middle): 0 accepted -> all γ accepted.
SCALE = ((0xD7, 0x30, 0x27), (0xFE, 0xE0, 0x8B), (0x1A, 0x98, 0x50))


def span_kind(name: str) -> str:
    """The colour class of a span, from its (OTel GenAI style) name."""
    lowered = name.lower()
    if lowered.startswith("retrieval"):
        return "retrieval"
    if lowered.startswith("prompt"):
        return "prompt"
    if lowered.startswith("prefill"):
        return "prefill"
    if lowered.startswith("decode"):
        return "decode"
    if lowered.startswith("execute_tool"):
        return "tool"
    return "other"


def acceptance_colour(accepted_len: int, gamma: int) -> str:
    """Colour of a cycle on the red-yellow-green scale, grey for a plain step (γ = 0)."""
    if gamma <= 0:
        return PLAIN_STEP_COLOUR
    f = min(max(accepted_len / gamma, 0.0), 1.0)
    lo, hi, t = (SCALE[0], SCALE[1], f * 2) if f < 0.5 else (SCALE[1], SCALE[2], f * 2 - 1)
    r, g, b = (round(a + (c - a) * t) for a, c in zip(lo, hi, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def _fmt_ms(ms: float) -> str:
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    if ms >= 100:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _fmt_tick(ms: float) -> str:
    return f"{ms / 1000:g} s" if ms >= 10_000 else f"{ms:g} ms"


def _tick_step(total_ms: float, target_ticks: int = 8) -> float:
    raw = max(total_ms, 1e-6) / target_ticks
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _short(value: Any, limit: int = MAX_ATTR_CHARS) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ordered(spans: list[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], int]]:
    """Spans depth-first from the root(s), siblings by start time, with their depth."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[Mapping[str, Any]]] = {}
    for s in spans:
        parent = s["parent_id"] if s["parent_id"] in ids else None  # orphans draw at the top level
        children.setdefault(parent, []).append(s)
    out: list[tuple[Mapping[str, Any], int]] = []
    stack = [(s, 0) for s in sorted(children.get(None, []), key=lambda s: s["start_ns"], reverse=True)]
    while stack:
        span, depth = stack.pop()
        out.append((span, depth))
        kids = sorted(children.get(span["span_id"], []), key=lambda s: s["start_ns"], reverse=True)
        stack.extend((k, depth + 1) for k in kids)
    return out


def _cycles(span: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [e for e in span.get("events", []) if e.get("name") == CYCLE_EVENT]


def _cycle_ns(attrs: Mapping[str, Any]) -> int:
    if attrs.get("duration_s") is not None:
        return int(float(attrs["duration_s"]) * 1e9)
    seconds = sum(float(attrs.get(f"{name}_s", 0) or 0) for name in CYCLE_STAGES)
    return int(seconds * 1e9)


def _span_title(span: Mapping[str, Any], ms: float) -> str:
    lines = [f"{span['name']} — {_fmt_ms(ms)}", f"status: {span.get('status', 'unset')}"]
    if span.get("status_message"):
        lines.append(f"error: {_short(span['status_message'])}")
    attrs = list(span.get("attributes", {}).items())
    lines += [f"{k}: {_short(v)}" for k, v in attrs[:MAX_TITLE_ATTRS]]
    if len(attrs) > MAX_TITLE_ATTRS:
        lines.append(f"… {len(attrs) - MAX_TITLE_ATTRS} more")
    others = [e for e in span.get("events", []) if e.get("name") != CYCLE_EVENT]
    lines += [f"event {e['name']}: {_short(e.get('attributes', {}))}" for e in others[:10]]
    return _esc("\n".join(lines))


def render_waterfall(trace_dict: Mapping[str, Any]) -> str:
    """A self-contained HTML page drawing ``trace_dict`` as a waterfall (see module docstring)."""
    spans = list(trace_dict.get("spans", []))
    t0 = trace_dict.get("start_ns") or min((s["start_ns"] for s in spans), default=0)
    ends = [s["end_ns"] for s in spans if s.get("end_ns") is not None] + [trace_dict.get("end_ns") or t0]
    ends += [e["timestamp_ns"] for s in spans for e in s.get("events", [])]
    t_end = max(ends)
    total_ns = max(t_end - t0, 1)
    total_ms = total_ns / 1e6

    def x(ns: float) -> float:
        return LABEL_W + (ns - t0) / total_ns * BAR_W

    rows: list[str] = []
    y = AXIS_H
    max_gamma = 0
    n_cycles = 0
    for span, depth in _ordered(spans):
        kind = span_kind(span["name"])
        end_ns = span["end_ns"] if span.get("end_ns") is not None else t_end
        ms = (end_ns - span["start_ns"]) / 1e6
        error = span.get("status") == "error"
        max_chars = max(8, (LABEL_W - 90 - depth * INDENT) // 7)
        name = span["name"] if len(span["name"]) <= max_chars else span["name"][: max_chars - 1] + "…"
        bx = x(span["start_ns"])
        bw = max(x(end_ns) - bx, 1.0)
        rows.append(
            f'<g class="row{" error" if error else ""}">'
            f'<text class="name" x="{8 + depth * INDENT}" y="{y + 15}">{"✖ " if error else ""}{_esc(name)}</text>'
            f'<text class="ms" x="{LABEL_W - 8}" y="{y + 15}">{_esc(_fmt_ms(ms))}</text>'
            f'<rect class="bar kind-{kind}{" error" if error else ""}" data-span-id="{_esc(span["span_id"])}" '
            f'data-kind="{kind}" x="{bx:.2f}" y="{y + 3}" width="{bw:.2f}" height="{ROW_H - 6}" rx="2">'
            f"<title>{_span_title(span, ms)}</title></rect></g>"
        )
        y += ROW_H
        cycles = _cycles(span)
        if cycles:
            marks = []
            for c in cycles:
                a = c.get("attributes", {})
                gamma, accepted = int(a.get("gamma", 0) or 0), int(a.get("accepted_len", 0) or 0)
                max_gamma = max(max_gamma, gamma)
                cx = x(c["timestamp_ns"])
                cw = max(x(c["timestamp_ns"] + _cycle_ns(a)) - cx, 1.0)
                tip = _esc("\n".join(f"{k}: {_short(v)}" for k, v in a.items()))
                marks.append(
                    f'<rect class="cycle" data-cycle="{accepted}/{gamma}" x="{cx:.2f}" y="{y + 2}" '
                    f'width="{cw:.2f}" height="{LANE_H - 4}" fill="{acceptance_colour(accepted, gamma)}">'
                    f"<title>{tip}</title></rect>"
                )
            n_cycles += len(cycles)
            rows.append(
                f'<g class="lane"><text class="lane-label" x="{8 + (depth + 1) * INDENT}" y="{y + 11}">'
                f"{len(cycles)} speculation cycles</text>{''.join(marks)}</g>"
            )
            y += LANE_H
    height = y + 8

    step = _tick_step(total_ms)
    ticks = []
    for i in range(int(total_ms / step) + 1):
        tx = LABEL_W + i * step / total_ms * BAR_W
        ticks.append(
            f'<line class="grid" x1="{tx:.2f}" y1="{AXIS_H - 6}" x2="{tx:.2f}" y2="{height}"/>'
            f'<text class="tick" x="{tx:.2f}" y="{AXIS_H - 10}">{_fmt_tick(i * step)}</text>'
        )
    svg = (
        f'<svg class="waterfall" width="{LABEL_W + BAR_W + 20}" '
        f'height="{height}" role="img" aria-label="span waterfall">{"".join(ticks)}{"".join(rows)}</svg>'
    )
    return _page(trace_dict, svg, total_ms, n_cycles, max_gamma)


def _summary(trace_dict: Mapping[str, Any], total_ms: float) -> str:
    try:
        stages = stage_durations(trace_dict)
    except (ValueError, KeyError):
        stages = {}
    rows = []
    for name, seconds in stages.items():
        ms = seconds * 1e3
        share = ms / total_ms * 100 if total_ms > 0 else 0.0
        rows.append(f"<tr><td>{_esc(name)}</td><td>{ms:.1f}</td><td>{share:.1f}%</td></tr>")
    covered = sum(stages.values()) * 1e3
    rows.append(
        f'<tr class="gap"><td>not in a stage</td><td>{total_ms - covered:.1f}</td>'
        f"<td>{(total_ms - covered) / total_ms * 100 if total_ms > 0 else 0.0:.1f}%</td></tr>"
        f'<tr class="total"><td>run</td><td>{total_ms:.1f}</td><td>100%</td></tr>'
    )
    return (
        '<table class="summary"><thead><tr><th>stage</th><th>ms</th><th>share of the run</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _legend(max_gamma: int, n_cycles: int) -> str:
    items = [f'<span class="key"><i style="background:{c}"></i>{_esc(kind)}</span>' for kind, c in KIND_COLOURS.items()]
    items.append('<span class="key"><i class="err"></i>error (✖)</span>')
    if n_cycles:
        stops = ",".join(acceptance_colour(i, 10) for i in range(11))
        gradient = f"background:linear-gradient(to right,{stops})"
        items.append(
            f'<span class="key">cycles: 0 accepted <i class="scale" style="{gradient}"></i>'
            f" γ = {max_gamma} accepted</span>"
            f'<span class="key"><i style="background:{PLAIN_STEP_COLOUR}"></i>plain step (γ = 0)</span>'
        )
    return f'<div class="legend">{"".join(items)}</div>'


CSS = """
body{font:13px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:17px;margin:0 0 4px}
.meta{color:#555;margin-bottom:8px}
.meta code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
.legend{display:flex;flex-wrap:wrap;gap:14px;margin:6px 0 10px;align-items:center}
.key{display:inline-flex;align-items:center;gap:5px}
.key i{display:inline-block;width:14px;height:10px;border-radius:2px}
.key i.err{background:#fff;border:2px solid #d62728;width:10px;height:6px}
.key i.scale{width:120px}
svg.waterfall{display:block;border:1px solid #e4e4e4;background:#fcfcfc}
svg .grid{stroke:#e8e8e8;stroke-width:1}
svg .tick{font-size:10px;fill:#777;text-anchor:middle}
svg .name{font-size:12px;fill:#222}
svg .ms{font-size:11px;fill:#555;text-anchor:end;font-variant-numeric:tabular-nums}
svg .lane-label{font-size:10px;fill:#888}
svg .row.error .name{fill:#d62728;font-weight:600}
svg .bar.error{stroke:#d62728;stroke-width:2}
svg .row:hover .bar,svg .cycle:hover{opacity:.75}
table.summary{border-collapse:collapse;margin-top:12px}
table.summary td,table.summary th{border:1px solid #ddd;padding:3px 10px;text-align:right}
table.summary td:first-child,table.summary th:first-child{text-align:left}
table.summary tr.gap td{color:#777}
table.summary tr.total td{font-weight:600}
""" + "".join(f"svg .kind-{k}{{fill:{c}}}\n" for k, c in KIND_COLOURS.items())


def _page(trace_dict: Mapping[str, Any], svg: str, total_ms: float, n_cycles: int, max_gamma: int) -> str:
    name = trace_dict.get("name", "trace")
    spans = trace_dict.get("spans", [])
    errors = sum(1 for s in spans if s.get("status") == "error")
    meta = (
        f"trace <code>{_esc(trace_dict.get('trace_id', '?'))}</code> · {_esc(_fmt_ms(total_ms))} · "
        f"{len(spans)} spans · {n_cycles} speculation cycles · {errors} error{'' if errors == 1 else 's'}"
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_esc(name)} — trace {_esc(trace_dict.get('trace_id', ''))}</title>"
        f"<style>{CSS}</style></head><body>"
        f'<h1>{_esc(name)}</h1><div class="meta">{meta}</div>'
        f"{_legend(max_gamma, n_cycles)}{svg}{_summary(trace_dict, total_ms)}"
        "</body></html>\n"
    )
