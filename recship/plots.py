"""PNG charts: training curves, an artifact's per-table bytes and error, benchmark tables.

The training and table charts each have a ``*_figure`` function that builds the matplotlib Figure
(what tests read: lines, bars, labels) and a ``plot_*`` one that writes it as a PNG.

matplotlib is the optional extra ``plots`` (``pip install 'recship[plots]'``), imported inside
these functions only, so ``import recship`` stays fast. Figures are drawn on their own Agg
canvas (``matplotlib.figure.Figure`` + ``FigureCanvasAgg``): no pyplot, no global backend, no
window. Every PNG is written to a hidden temporary sibling and renamed into place, so a run
killed mid-write leaves the previous file or none, never half a PNG.

Without matplotlib every function raises ``PlotsUnavailable`` (an ImportError, and a ValueError
so the CLI reports it as one line with exit code 2 when a plot was asked for). Code that draws
a chart as a side effect (training's curves, export's table chart) calls ``plot_if_available``
instead: without matplotlib no chart, one INFO line per process saying how to get them (not a warning:
an install without the extra is a choice, not a fault), and the run goes on.
"""

import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

log = logging.getLogger("recship.plots")

INSTALL_HINT = "pip install 'recship[plots]'"
DPI = 100
CURVES_SIZE = (9.0, 6.0)  # inches: 900 x 600 pixels at DPI
MAX_POINTS = 2000  # train-loss points drawn per curve
BAR_WIDTH = 10.0  # inches, bench charts; their height grows with the number of bars
TABLES_WIDTH = 12.0  # inches, the table chart (three panels); its height grows with the number of tables


class PlotsUnavailable(ImportError, ValueError):
    """matplotlib (the ``plots`` extra) is not installed; the message says how to install it."""


def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure of ``width`` x ``height`` inches on its own Agg canvas."""
    try:
        # lazy: matplotlib is an optional extra (`plots`), absent from a plain install
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotsUnavailable(f"writing a chart needs matplotlib, which is not installed ({e}): {INSTALL_HINT}") from None
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")  # room for titles, labels and legends
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: Union[str, Path]) -> Path:
    """Writes ``fig`` as ``path`` (PNG) atomically: a temporary sibling, then os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=DPI)  # no bbox_inches="tight": the pixel size stays the figure's
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def require() -> None:
    """Raises PlotsUnavailable unless matplotlib is installed; finds it without importing it (cheap),
    so a command asked for a chart can refuse before its long work rather than after."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # a module object without a spec in sys.modules
        found = False
    if not found:
        raise PlotsUnavailable(f"a chart was asked for, but matplotlib is not installed: {INSTALL_HINT}")


_noted = False


def plot_if_available(plot: Callable[..., Path], *args: Any, **kwargs: Any) -> Optional[Path]:
    """``plot(*args, **kwargs)``, or None when matplotlib is missing, saying how to get charts in one INFO line
    per process.

    For charts drawn as a side effect: a missing optional extra must not fail a training run or
    an export, nor warn on every one. Any other error still raises (a chart that cannot be drawn is a bug to see).
    """
    global _noted
    try:
        return plot(*args, **kwargs)
    except PlotsUnavailable:
        if not _noted:
            log.info("no charts: matplotlib is not installed (%s draws them)", INSTALL_HINT)
            _noted = True
        return None


def moving_average(values: Sequence[float], window: int) -> List[float]:
    """The trailing mean of ``values`` over the last ``window`` points (fewer at the start), one per value."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    total = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(0, end - window)
    return ((total[end] - total[start]) / (end - start)).tolist()


def training_curves_figure(
    steps: Sequence[int], losses: Sequence[float], evals: Sequence[Mapping[str, Any]], title: str = "training",
    starts: Sequence[Mapping[str, Any]] = (),
) -> Any:
    """The matplotlib Figure of ``plot_training_curves`` (900 x 600 pixels): train loss per step (raw
    and its moving average) with the eval log loss as points on the top axes, the eval AUC as points
    on the bottom one, and a vertical line on both at each resume (dashed gray) or change of world
    size (solid purple, labelled ``1 -> 2 ranks`` at the top).

    ``steps``/``losses``: the train loss after each step (same length); ``evals``: dicts with
    ``step``, ``log_loss`` and ``auc`` (and, for a multi-task model, ``tasks``: {task: {log_loss, auc}}, each
    task drawn too; other keys are ignored), in step order; ``starts``: where
    each run started, dicts with ``step``, ``world_size`` and ``resumed`` in step order (history.jsonl's
    start records; none for a history written before they existed). The marker lines carry the gid
    ``resume`` or ``world_size``, so their steps can be read back from the axes.
    """
    if len(steps) != len(losses):
        raise ValueError(f"steps and losses must have the same length, got {len(steps)} and {len(losses)}")
    for e in evals:
        missing = [k for k in ("step", "log_loss", "auc") if k not in e]
        if missing:
            raise ValueError(f"an eval entry lacks {missing}: {dict(e)}")
    for r in starts:
        missing = [k for k in ("step", "world_size", "resumed") if k not in r]
        if missing:
            raise ValueError(f"a start entry lacks {missing}: {dict(r)}")
    fig = _figure(*CURVES_SIZE)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    if losses:
        window = max(1, min(100, len(losses) // 20))
        smooth = moving_average(losses, window)
        every = max(1, len(losses) // MAX_POINTS)  # a long run: every n-th point (the PNG has ~800 pixels across)
        if window == 1:  # a short run: the mean would be the loss itself
            top.plot(steps, losses, color="tab:blue", linewidth=1.8, label="train loss")
        else:
            top.plot(steps[::every], losses[::every], color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
            top.plot(steps[::every], smooth[::every], color="tab:blue", linewidth=1.8, label=f"train loss, mean of {window} steps")
    eval_steps = [int(e["step"]) for e in evals]
    if evals:
        # points, with a faint guide between them: an evaluation is a measurement, not a curve between measurements
        point = dict(marker="o", markersize=6, linestyle=":", linewidth=0.8, zorder=3)
        top.plot(eval_steps, [float(e["log_loss"]) for e in evals], color="tab:red", label="eval log loss", **point)
        bottom.plot(eval_steps, [float(e["auc"]) for e in evals], color="tab:green", label="eval AUC", **point)
        # a multi-task model's evaluations carry each task's metrics too ("tasks": {output: {log_loss, auc}})
        tasks = list(dict.fromkeys(t for e in evals for t in (e.get("tasks") or {})))
        for i, task in enumerate(tasks if len(tasks) > 1 else []):
            at = [(int(e["step"]), e["tasks"][task]) for e in evals if task in (e.get("tasks") or {})]
            style = dict(point, marker="s^vDP"[i % 5], markersize=4, color=f"C{(i + 4) % 10}")
            top.plot([s for s, _ in at], [float(m["log_loss"]) for _, m in at], label=f"eval log loss: {task}", alpha=0.6, **style)
            bottom.plot([s for s, _ in at], [float(m["auc"]) for _, m in at], label=f"eval AUC: {task}", alpha=0.6, **style)
        if len(tasks) > 1:
            bottom.legend(loc="lower right", fontsize="small")
    else:
        bottom.text(0.5, 0.5, "no evaluations", ha="center", va="center", transform=bottom.transAxes, color="gray")
    _mark_starts(top, bottom, starts)
    top.set_ylabel("log loss")
    top.set_title(title)
    top.grid(alpha=0.3)
    if losses or evals or len(top.lines):
        top.legend(loc="upper right")
    bottom.set_ylabel("AUC")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    return fig


def _mark_starts(top: Any, bottom: Any, starts: Sequence[Mapping[str, Any]]) -> None:
    """A vertical line on both axes where a run resumed (gid ``resume``) or changed its world size (gid
    ``world_size``, with ``W -> W' ranks`` written at the top); a fresh run's start is not marked."""
    previous: Optional[int] = None
    labelled = set()
    for r in starts:
        world, step = int(r["world_size"]), int(r["step"])
        changed = previous is not None and world != previous
        if changed:
            kind, style, label = "world_size", dict(color="tab:purple", linestyle="-", linewidth=1.2), "world size changed"
        elif r["resumed"]:
            kind, style, label = "resume", dict(color="gray", linestyle="--", linewidth=1.0), "resumed"
        else:  # a fresh run's start (step 0): nothing to mark
            previous = world
            continue
        for ax in (top, bottom):
            ax.axvline(step, gid=kind, label=label if ax is top and kind not in labelled else "_nolegend_", zorder=1, **style)
        labelled.add(kind)
        if changed:
            top.annotate(f"{previous} -> {world} ranks", xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                         textcoords="offset points", ha="left", va="top", fontsize="small", color="tab:purple", gid=kind)
        previous = world


def plot_training_curves(
    path: Union[str, Path], steps: Sequence[int], losses: Sequence[float], evals: Sequence[Mapping[str, Any]],
    title: str = "training", starts: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Writes ``path`` (900 x 600 PNG): ``training_curves_figure`` of the arguments; returns ``path``."""
    return _save(training_curves_figure(steps, losses, evals, title=title, starts=starts), path)


def _spans_decades(values: Sequence[float]) -> bool:
    """Whether a log axis suits ``values``: all positive and the largest >= 100 x the smallest."""
    positive = [v for v in values if v > 0]
    return len(positive) == len(values) and bool(positive) and max(positive) >= 100 * min(positive)


def _bar_height(rows: int) -> float:
    return min(60.0, 1.8 + 0.3 * rows)  # inches; capped so thousands of tables stay a sane PNG


def _paired_bars(ax: Any, y: List[int], first: Tuple[List[float], str, str], second: Tuple[List[float], str, str], xlabel: str,
                 small: bool = False) -> None:
    """Two horizontal bars per row (values, legend label, colour each), log-scaled when the values span decades;
    ``small``: values like 1e-4, labelled in scientific notation on a linear axis."""
    half = 0.4
    for (values, label, color), shift in ((first, -half / 2), (second, half / 2)):
        ax.barh([i + shift for i in y], values, height=half, color=color, label=label)
    if _spans_decades(first[0] + second[0]):
        ax.set_xscale("log")
    elif small:  # errors of 1e-4 would print as 0.0001, 0.0002, ... side by side
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
    ax.set_xlabel(xlabel)
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=2, frameon=False)
    ax.grid(axis="x", alpha=0.3)



TABLE_NEEDS = ("table", "data_type", "float_bytes", "quantized_bytes", "max_abs_error", "mean_abs_error", "pooled_relative_error")


def table_report_figure(tables: Sequence[Mapping[str, Any]], title: str = "tables") -> Any:
    """The matplotlib Figure of ``plot_table_report`` (1200 pixels wide), three panels sharing the
    tables' rows: bytes as float32 and as stored (log scale when the sizes span two decades); the
    absolute quantization error of a weight (max and mean |error|); and the pooled relative error
    (|pooled(quantized) - pooled(float)| / |pooled(float)| over sample lookups), which does not grow
    with the size of a table's weights as the absolute error does (an INT4 table of large rows
    looks several times worse on the absolute error alone).

    ``tables``: the manifest's ``quantization.tables`` entries (``table``, ``data_type``,
    ``float_bytes``, ``quantized_bytes``, ``max_abs_error``, ``mean_abs_error``,
    ``pooled_relative_error``). The axes carry the gids ``bytes``, ``abs_error`` and ``rel_error``.
    """
    if not tables:
        raise ValueError("no tables to chart")
    for t in tables:
        missing = [k for k in TABLE_NEEDS if k not in t]
        if missing:
            raise ValueError(f"table entry {t.get('table', '?')!r} lacks {missing}")
    labels = [f"{t['table']} ({str(t['data_type']).lower()})" for t in tables]
    fig = _figure(TABLES_WIDTH, _bar_height(len(tables)))
    size_ax, err_ax, rel_ax = fig.subplots(1, 3, sharey=True, gridspec_kw={"width_ratios": [1.2, 1, 1]})
    y = list(range(len(tables)))
    size_ax.set_gid("bytes")
    _paired_bars(size_ax, y, ([float(t["float_bytes"]) for t in tables], "float32", "lightgray"),
                 ([float(t["quantized_bytes"]) for t in tables], "stored", "tab:blue"), "bytes")
    size_ax.set_yticks(y, labels)
    size_ax.invert_yaxis()  # the first table on top, as in the printed report
    err_ax.set_gid("abs_error")
    _paired_bars(err_ax, y, ([float(t["max_abs_error"]) for t in tables], "max |error|", "tab:orange"),
                 ([float(t["mean_abs_error"]) for t in tables], "mean |error|", "tab:red"), "absolute error of a weight", small=True)
    rel_ax.set_gid("rel_error")
    rel = [float(t["pooled_relative_error"]) for t in tables]
    rel_ax.barh(y, rel, height=0.6, color="tab:purple", label="pooled relative error")
    if _spans_decades(rel):
        rel_ax.set_xscale("log")
    else:
        rel_ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
    rel_ax.set_xlabel("pooled relative error")
    rel_ax.legend(loc="lower left", bbox_to_anchor=(0, 1), frameon=False)
    rel_ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title)
    return fig


def plot_table_report(path: Union[str, Path], tables: Sequence[Mapping[str, Any]], title: str = "tables") -> Path:
    """Writes ``path`` (PNG, 1200 pixels wide): ``table_report_figure`` of ``tables``; returns ``path``."""
    return _save(table_report_figure(tables, title=title), path)


def plot_artifact(path: Union[str, Path], manifest: Mapping[str, Any]) -> Path:
    """``plot_table_report`` of an artifact's manifest (the parsed manifest.json), titled with the
    model's name and its tables' total bytes before and after quantization; returns ``path``."""
    q = manifest["quantization"]
    model = manifest["model"]
    ratio = q["quantized_bytes"] / max(1, q["float_bytes"])
    title = (f"{model['name']} ({model['kind']}): {len(q['tables'])} tables, {q['float_bytes']:,} -> {q['quantized_bytes']:,} bytes "
             f"({ratio:.3f} of float32)")
    return plot_table_report(path, q["tables"], title=title)


def plot_bench(
    path: Union[str, Path], title: str, labels: Sequence[str], panels: Mapping[str, Mapping[str, Sequence[float]]],
    log: Optional[bool] = None,
) -> Path:
    """Writes ``path`` (PNG, 1000 pixels wide): a benchmark's headline figures as horizontal bars,
    one group per row of its printed table, one bar per series; returns ``path``.

    ``labels``: the table's rows, top to bottom; ``panels``: x-axis label (the unit) -> series name
    -> one value per row (NaN: no bar); panels sit side by side and share the rows. ``log``: log x
    axes (None: each panel whose values span two decades).
    """
    if not labels:
        raise ValueError("no rows to chart")
    if not panels or not all(panels.values()):
        raise ValueError("every panel needs at least one series")
    for unit, series in panels.items():
        for name, values in series.items():
            if len(values) != len(labels):
                raise ValueError(f"series {name!r} of panel {unit!r} has {len(values)} values for {len(labels)} rows")
    most = max(len(series) for series in panels.values())
    fig = _figure(BAR_WIDTH, _bar_height(len(labels) * (1 + most) // 2))
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (unit, series) in zip(axes, panels.items()):
        n = len(series)
        height = 0.8 / n
        shown: List[float] = []
        for k, (name, values) in enumerate(series.items()):
            xs = [float(v) for v in values]
            ax.barh([i - 0.4 + height * (k + 0.5) for i in range(len(labels))], [0.0 if math.isnan(x) else x for x in xs],
                    height=height, label=name)
            shown += [x for x in xs if not math.isnan(x)]
        if log if log is not None else _spans_decades(shown):
            ax.set_xscale("log")
        only = next(iter(series))
        ax.set_xlabel(unit if n > 1 or only == unit else f"{only} ({unit})")  # one series: no legend, so name it here
        ax.grid(axis="x", alpha=0.3)
        if n > 1:
            ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncol=min(3, n), frameon=False, fontsize="small")
    axes[0].set_yticks(range(len(labels)), list(labels))
    axes[0].invert_yaxis()  # the table's first row on top
    fig.suptitle(title)
    return _save(fig, path)


def write_bench_chart(
    path: str, title: str, labels: Sequence[str], panels: Mapping[str, Mapping[str, Sequence[float]]], log: Optional[bool] = None,
) -> Optional[Path]:
    """What a bench script calls after printing its table: ``plot_bench`` and a line naming the PNG;
    nothing for an empty ``path`` (``--plot ''``), an INFO line without matplotlib (the table is printed already)."""
    if not path:
        return None
    written = plot_if_available(plot_bench, path, title, labels, panels, log)
    if written is not None:
        print(f"chart: {written}")
    return written
