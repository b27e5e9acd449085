"""The figures of a run: startup latency against N, and what scale costs (both optional)."""

from __future__ import annotations

import importlib
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.harness._run import Series

#: Line style and colour by who runs the workers, the same in every panel.
_SIDES = {
    "aioelastic": ("-", "tab:blue"),
    "torch.elastic": ("--", "tab:orange"),
    "floor": (":", "tab:gray"),
}
#: One point of a curve: N, then the median, minimum and maximum of the metric.
Point = tuple[int, float, float, float]


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; ``None`` (with a note) when it is missing."""
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        return importlib.import_module("matplotlib.pyplot")
    except ImportError:
        print(
            "plots need matplotlib (pip install 'aioelastic[plot]'); no plot written",
            file=sys.stderr,
        )
        return None


def _family(system: str) -> str:
    """Who runs the workers: ``torch.elastic`` of ``torch.elastic/binary ...``."""
    return system.replace(" ", "/").partition("/")[0]


def _side(system: str) -> tuple[str, str]:
    return _SIDES.get(_family(system), ("-.", "tab:green"))


def _side_order(system: str) -> int:
    family = _family(system)
    return list(_SIDES).index(family) if family in _SIDES else len(_SIDES)


def plot(results: list[Series], path: Path) -> bool:
    """Startup latency against N for every system; False when matplotlib is missing."""
    curves: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for s in results:
        if s.measure not in ("startup", "floor") or s.status != "ok" or not s.samples:
            continue
        if s.system == "floor/true":
            continue  # a completion floor, not a startup one
        family, _, variant = s.system.partition("/")
        median = statistics.median(x["seconds"] for x in s.samples)
        curves.setdefault((family, variant), []).append((s.n, median * 1000))
    plt = _pyplot()
    if plt is None:
        return False
    # Colour says what starts (the start method, or the floor row), line style says who
    # starts it, so that 12 curves stay readable.
    variants = sorted({v for _, v in curves})
    palette = plt.get_cmap("tab10")
    colour = {v: palette(i % 10) for i, v in enumerate(variants)}
    figure, axes = plt.subplots(figsize=(11, 6))
    for (family, variant), points in sorted(curves.items()):
        points.sort()
        axes.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            _side(family)[0],
            color=colour[variant],
            marker="o",
            linewidth=2.2 if family == "aioelastic" else 1.4,
            label=f"{family} / {variant}" + (" (to exit)" if variant == "python -S" else ""),
        )
    ns = sorted({p[0] for points in curves.values() for p in points})
    axes.set_xscale("log", base=2)
    axes.set_xticks(ns, [str(n) for n in ns])
    axes.set_yscale("log")
    axes.set_xlabel("N workers")
    axes.set_ylabel("call to all workers running user code (ms, median)")
    axes.set_title("startup latency (lower is better); fn workers import torch")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _label(system: str) -> str:
    """``system`` as a legend or axis shows it: every scale system has torch loaded."""
    return system.replace(" (torch loaded)", "")


def _curves(results: list[Series], measure: str, group: str, metric: str) -> dict[str, list[Point]]:
    """Per system of ``measure``/``group``: one :data:`Point` of ``metric`` per N, by N."""
    curves: dict[str, list[Point]] = {}
    for s in results:
        if s.measure != measure or s.group != group or s.status != "ok":
            continue
        values = [x[metric] for x in s.samples if x.get(metric) is not None]
        if values:
            point = (s.n, statistics.median(values), min(values), max(values))
            curves.setdefault(s.system, []).append(point)
    for points in curves.values():
        points.sort()
    return curves


def _against_n(
    axes: Any, curves: dict[str, list[Point]], scale: float, marker: str, suffix: str
) -> None:
    for system, points in sorted(curves.items(), key=lambda item: _side_order(item[0])):
        line, colour = _side(system)
        axes.plot(
            [p[0] for p in points],
            [p[1] * scale for p in points],
            line,
            color=colour,
            marker=marker,
            label=_label(system) + suffix,
        )


def _bars(axes: Any, curves: dict[str, list[Point]], scale: float) -> int:
    """One bar per system (its largest N), min..max as error bars; returns that N."""
    chosen = sorted(curves.items(), key=lambda item: _side_order(item[0]))
    n = 0
    for index, (system, points) in enumerate(chosen):
        n, median, low, high = points[-1]
        axes.bar(
            index,
            median * scale,
            color=_side(system)[1],
            yerr=[[(median - low) * scale], [(high - median) * scale]],
            capsize=4,
        )
    labels = [textwrap.fill(_label(system), 30) for system, _ in chosen]
    axes.set_xticks(range(len(chosen)), labels, fontsize=7)
    return n


def plot_scale(results: list[Series], path: Path) -> bool:
    """What scale costs: per-worker time and memory against N, many groups, loop lateness.

    Four panels, from the ``binary`` (i) and ``scale`` (j) measures: per worker, the start
    call to every exit seen (``/bin/true`` and ``python -S`` workers from a torch-loaded
    supervisor: ours, torch at ``wait(period=0.01)``, the ``posix_spawn`` floor); the
    supervisor tree's memory per running worker; K = N/4 groups of 4 in one supervisor;
    the event loop's worst lateness while N tee'd workers start, against its 10 ms
    target. False when matplotlib is missing or the results hold none of these.
    """
    true_cost = {
        system: points
        for system, points in _curves(results, "binary", "bin", "per_worker").items()
        if "torch-defaults" not in system  # a 1 s polling period: 100x off this scale
    }
    python_cost = _curves(results, "scale", "cost", "per_worker")
    memory = _curves(results, "scale", "memory", "kb_per_worker")
    groups = _curves(results, "scale", "groups", "per_worker")
    lateness = _curves(results, "scale", "lateness", "lateness")
    if not (true_cost or python_cost or memory or groups or lateness):
        print(
            "no plot of scale: the results hold neither binary (i) nor scale (j)", file=sys.stderr
        )
        return False
    plt = _pyplot()
    if plt is None:
        return False
    figure, panels = plt.subplots(2, 2, figsize=(13, 8))
    (cost_axes, memory_axes), (groups_axes, late_axes) = panels
    _against_n(cost_axes, true_cost, 1000, "o", ", /bin/true")
    _against_n(cost_axes, python_cost, 1000, "s", ", python -S")
    cost_axes.set_title("per worker, start call to every exit seen (lower is better)")
    cost_axes.set_ylabel("ms per worker (median)")
    _against_n(memory_axes, memory, 1, "o", "")
    memory_axes.set_title("supervisor memory per running worker (lower is better)")
    memory_axes.set_ylabel("kB per worker (median)")
    cost_axes.set_yscale("log")  # /bin/true (~0.5 ms) and python -S (~5 ms) on one panel
    memory_axes.set_ylim(bottom=0)
    for axes, curves in ((cost_axes, {**true_cost, **python_cost}), (memory_axes, memory)):
        ns = sorted({p[0] for points in curves.values() for p in points})
        axes.set_xscale("log", base=2)
        if ns:
            axes.set_xticks(ns, [str(n) for n in ns])
        axes.set_xlabel("N workers")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    n = _bars(groups_axes, groups, 1000)
    groups_axes.set_title(f"{n // 4} groups of 4 /bin/true at once, per worker (lower is better)")
    groups_axes.set_ylabel("ms per worker (median; bars: min..max)")
    n = _bars(late_axes, lateness, 1000)
    late_axes.axhline(10, color="tab:red", linestyle="--", linewidth=1, label="target: < 10 ms")
    late_axes.set_title(f"event loop's worst lateness while {n} tee'd workers start")
    late_axes.set_ylabel("ms (median of repetitions; bars: min..max)")
    late_axes.set_yscale("log")  # one repetition hit by the machine must not hide the rest
    highest = max((p[3] for points in lateness.values() for p in points), default=0.0)
    late_axes.set_ylim(bottom=1, top=max(20.0, highest * 1000 * 1.5))  # the target in view
    late_axes.legend(fontsize=7)
    plain = importlib.import_module("matplotlib.ticker").FuncFormatter(lambda v, _: f"{v:g}")
    # 0.5 and 20, not 5x10^-1 and 2x10^1
    cost_axes.yaxis.set_major_formatter(plain)
    cost_axes.yaxis.set_minor_formatter(plain)
    late_axes.yaxis.set_major_formatter(plain)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
