"""The loop's report: run_dir/report.html, from the cycle reports in run_dir/cycles.jsonl.

    write_report(run_dir) -> path of report.html

Per cycle: the live version, the canary's A/B table in Cursor's terms (edits kept %, dissatisfied
follow-ups %, latency, each with its interval) and verdict, the trained candidate and the gate's
decision with its reasons and any hacking alarm. Plots (matplotlib, inlined as SVG, so the file stands
alone): edits kept % and dissatisfied % per arm across cycles with their intervals, the gate's pass@1
of champion and candidate, and the mean training reward.
"""

from __future__ import annotations

import html
import io
import json
import logging
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first: no display here)

log = logging.getLogger(__name__)


def read_cycles(run_dir: Path) -> list[dict[str, Any]]:
    """The cycle reports of run_dir/cycles.jsonl; a line a stop cut short is left out (and logged)."""
    path = Path(run_dir) / "cycles.jsonl"
    cycles = []
    for number, line in enumerate(path.read_text().splitlines() if path.is_file() else [], start=1):
        if not line.strip():
            continue
        try:
            cycles.append(json.loads(line))
        except ValueError:
            log.warning("%s:%d is not a whole cycle report (a stop mid-write?); left out", path, number)
    return cycles


def cycle_metrics(report: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A cycle report's numeric leaves as flat metric keys (rewards/settled, train/reward_mean,
    gate/evidence/p_value)."""
    out: dict[str, float] = {}
    for key, value in report.items():
        if key in ("window_start", "cycle"):
            continue
        name = key if prefix and key.startswith(prefix) else f"{prefix}{key}"  # train/train/x -> train/x
        if isinstance(value, dict):
            out |= cycle_metrics(value, name + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _finish(fig: Any, ax: Any, plotted: bool, title: str, ylabel: str) -> str | None:
    if not plotted:
        plt.close(fig)
        return None
    ax.set_title(title)
    ax.set_xlabel("cycle")
    ax.set_ylabel(ylabel)
    ax.legend()
    return _svg(fig)


def _arm_plot(cycles: list[dict[str, Any]], metric: str, title: str) -> str | None:
    fig, ax = plt.subplots(figsize=(5, 3))
    plotted = False
    for offset, arm in ((-0.08, "champion"), (0.08, "candidate")):
        xs, ys, lo, hi = [], [], [], []
        for c in cycles:
            m = (c.get("canary") or {}).get("ab", {}).get("metrics", {}).get(metric)
            est = m and m[arm]
            if est and est["value"] is not None:
                xs.append(c["cycle"] + offset)
                ys.append(100 * est["value"])
                low = est["low"] if est["low"] is not None else est["value"]
                high = est["high"] if est["high"] is not None else est["value"]
                lo.append(max(0.0, 100 * (est["value"] - low)))  # an interval end can round past the value
                hi.append(max(0.0, 100 * (high - est["value"])))
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=arm)
            plotted = True
    return _finish(fig, ax, plotted, title, "%")


def _line_plot(cycles: list[dict[str, Any]], series: dict[str, Any], title: str, ylabel: str) -> str | None:
    fig, ax = plt.subplots(figsize=(5, 3))
    plotted = False
    for label, get in series.items():
        points = [(c["cycle"], v) for c in cycles if (v := get(c)) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
            plotted = True
    return _finish(fig, ax, plotted, title, ylabel)


def _gate_rate(c: dict[str, Any], arm: str) -> float | None:
    return (c.get("gate") or {}).get("evidence", {}).get(f"{arm}_pass_at_1")


def _ab_table(ab: dict[str, Any]) -> str:
    rows = []
    for m in ab.get("metrics", {}).values():
        scale = 100.0 if m["unit"] == "%" else 1.0

        def cell(e: dict[str, Any], sign: bool = False) -> str:
            if e["value"] is None:
                return "-"
            fmt = "{:+.2f}" if sign else "{:.2f}"
            text = fmt.format(e["value"] * scale)
            if e["low"] is not None and e["high"] is not None:
                text += f" [{fmt.format(e['low'] * scale)}, {fmt.format(e['high'] * scale)}]"
            return text

        relative = "-" if m["relative"] is None else f"{100 * m['relative']:+.2f}%"
        rows.append(f"<tr><td>{html.escape(m['label'])}</td><td>{cell(m['champion'])} (n={m['n_champion']})</td>"
                    f"<td>{cell(m['candidate'])} (n={m['n_candidate']})</td><td>{cell(m['difference'], True)}</td>"
                    f"<td>{relative}</td><td>{html.escape(m.get('method', ''))}</td></tr>")
    level = f"{ab.get('confidence', 0.95):.0%}"
    head = (f"<tr><th>metric</th><th>champion</th><th>candidate</th><th>difference [{level} CI]</th><th>relative</th>"
            "<th>method</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _cycle_section(c: dict[str, Any]) -> str:
    parts = [f"<h2>Cycle {c['cycle']}</h2>",
             f"<p>live before: v{c.get('live_version')}, after: v{c.get('live_version_after')}; "
             f"rewards settled {c.get('rewards', {}).get('settled', 0)}, pending {c.get('rewards', {}).get('pending', 0)}, "
             f"censored {c.get('rewards', {}).get('censored', 0)}, late events {c.get('rewards', {}).get('late', 0)}</p>"]
    canary = c.get("canary")
    if canary:
        parts.append(f"<h3>Canary v{canary['version']}: {html.escape(canary['decision'])}</h3>"
                     f"<p>{html.escape(canary['reason'])}</p>{_ab_table(canary['ab'])}")
        parts += [f"<p class=alarm>monitor alarm: {html.escape(r['reason'])}</p>"
                  for r in canary.get("monitors", {}).get("results", []) if r.get("status") == "alarm"]
    train = c.get("train")
    if train:
        parts.append(f"<h3>Training</h3><p>{html.escape(json.dumps(train))}</p>")
    gate = c.get("gate")
    if gate:
        parts.append(f"<h3>Gate v{gate['version']} vs v{gate['champion']}: {html.escape(gate['decision'])}</h3>"
                     "<ul>" + "".join(f"<li>{html.escape(r)}</li>" for r in gate.get("reasons", [])) + "</ul>")
    return "\n".join(parts)


def write_report(run_dir: Path, title: str = "realtime-rl: the real-time loop") -> Path:
    cycles = read_cycles(run_dir)
    plots = [
        _arm_plot(cycles, "edits_kept", "edits kept % (canary A/B)"),
        _arm_plot(cycles, "dissatisfied", "dissatisfied follow-ups % (canary A/B)"),
        _line_plot(cycles, {"champion": lambda c: _gate_rate(c, "champion"),
                            "candidate": lambda c: _gate_rate(c, "candidate")}, "gate: held-out pass@1", "pass@1"),
        _line_plot(cycles, {"trajectories": lambda c: (c.get("train") or {}).get("train/reward_mean")},
                   "mean reward of the training traffic", "reward"),
    ]
    body = "".join(f"<div class=plot>{p}</div>" for p in plots if p) + "".join(map(_cycle_section, cycles))
    page = (f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;max-width:1100px;margin:auto} .plot{display:inline-block}"
            "table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
            ".alarm{color:#b00}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{len(cycles)} cycles</p>{body}</body></html>")
    out = Path(run_dir) / "report.html"
    out.write_text(page)
    return out
