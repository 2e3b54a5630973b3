"""PNG charts (recship/plots.py): what each writes, from real training and a real artifact; without matplotlib."""

import logging
import math
import shutil
import sys

import numpy as np
import pytest

from recship import plots
from recship.export.artifact import Manifest
from recship.trainer.train import TrainConfig, launch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _read_png(path):
    """[H, W, 4] float pixels of a PNG file, after checking it is one."""
    import matplotlib.image

    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_SIGNATURE), f"{path}: {len(data)} bytes, starts {data[:8]!r}"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[2] == 4
    assert float(np.ptp(pixels[..., :3])) > 0.5, "a blank image"  # something dark was drawn on the white
    return pixels


def _tiny_training(out, **kw):
    base = dict(out=str(out), steps=8, batch_size=32, num_embeddings_per_feature=[40] * 26, embedding_dim=8, dense_arch=[16],
                over_arch=[16], eval_every=4, eval_batches=2, checkpoint_every=4, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_moving_average_matches_numpy():
    values = np.random.default_rng(0).random(50).tolist()
    for window in (1, 3, 7, 50, 80):
        want = [np.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]
        np.testing.assert_allclose(plots.moving_average(values, window), want, rtol=1e-12)
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        plots.moving_average(values, 0)


def test_training_curves_from_a_real_run(tmp_path):
    summary = launch(_tiny_training(tmp_path / "run"))
    assert [e["step"] for e in summary["evals"]] == [4, 8]
    losses = summary["losses"]
    path = plots.plot_training_curves(tmp_path / "curves.png", list(range(1, len(losses) + 1)), losses, summary["evals"])
    assert path == tmp_path / "curves.png"
    w, h = plots.CURVES_SIZE
    assert _read_png(path).shape == (h * plots.DPI, w * plots.DPI, 4)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_training_curves_checks_its_inputs(tmp_path):
    with pytest.raises(ValueError, match="same length, got 2 and 1"):
        plots.plot_training_curves(tmp_path / "c.png", [1, 2], [0.5], [])
    with pytest.raises(ValueError, match=r"lacks \['auc'\]"):
        plots.plot_training_curves(tmp_path / "c.png", [1], [0.5], [{"step": 1, "log_loss": 0.4}])
    # no evaluations, or no steps at all (a resumed run that trained none): still a chart
    _read_png(plots.plot_training_curves(tmp_path / "c.png", [1, 2, 3], [0.7, 0.6, 0.65], []))
    assert plots.plot_training_curves(tmp_path / "e.png", [], [], [{"step": 4, "log_loss": 0.6, "auc": 0.7}]).stat().st_size > 0


def test_table_chart_from_a_real_artifact(tmp_path, small_artifact):
    tables = Manifest.read(small_artifact).quantization["tables"]
    assert len(tables) == 26
    path = plots.plot_table_report(tmp_path / "sub" / "tables.png", tables, title="dlrm")
    pixels = _read_png(path)
    assert pixels.shape == (round(plots._bar_height(26) * plots.DPI), plots.TABLES_WIDTH * plots.DPI, 4)
    with pytest.raises(ValueError, match="no tables"):
        plots.plot_table_report(tmp_path / "t.png", [])
    broken = [{k: v for k, v in tables[0].items() if k != "quantized_bytes"}]
    with pytest.raises(ValueError, match=r"'sparse_arch.embedding_bag_collection.t_cat_0' lacks \['quantized_bytes'\]"):
        plots.plot_table_report(tmp_path / "t.png", broken)


def _by_gid(fig):
    return {ax.get_gid(): ax for ax in fig.axes if ax.get_gid()}


def _bars(ax):
    """(width, centre row) of each bar of ``ax``, in drawing order."""
    return [(p.get_width(), p.get_y() + p.get_height() / 2) for p in ax.patches]


def test_table_chart_shows_the_pooled_relative_error_beside_the_absolute_error(tmp_path):
    from recship.export import export_model

    manifest = export_model(_small_dlrm(), _export_config(out=str(tmp_path / "art"), dtype="int4",
                                                          table_dtypes={"t_cat_0": "int8", "t_cat_1": "fp32"}, plot=True))
    tables = manifest["quantization"]["tables"]
    assert [t["data_type"].lower() for t in tables[:3]] == ["int8", "fp32", "int4"]
    fig = plots.table_report_figure(tables, title="mixed")
    axes = _by_gid(fig)
    assert set(axes) == {"bytes", "abs_error", "rel_error"}
    rows = [float(i) for i in range(len(tables))]
    # the reference: the manifest's numbers, one bar each, on the table's row
    rel = _bars(axes["rel_error"])
    assert [r for _, r in rel] == pytest.approx(rows)
    assert [w for w, _ in rel] == [t["pooled_relative_error"] for t in tables]
    absolute = _bars(axes["abs_error"])
    assert [w for w, _ in absolute] == [t["max_abs_error"] for t in tables] + [t["mean_abs_error"] for t in tables]
    sizes = _bars(axes["bytes"])
    assert [w for w, _ in sizes] == [t["float_bytes"] for t in tables] + [t["quantized_bytes"] for t in tables]
    assert [t.get_text() for t in axes["bytes"].get_yticklabels()] == [f"{t['table']} ({t['data_type'].lower()})" for t in tables]
    assert axes["rel_error"].get_xlabel() == "pooled relative error"
    assert axes["abs_error"].get_xlabel() == "absolute error of a weight"
    assert [t.get_text() for t in axes["rel_error"].get_legend().get_texts()] == ["pooled relative error"]
    assert fig.get_suptitle() == "mixed"
    # all three panels share the rows: a table is one line across the chart
    assert axes["rel_error"].get_ylim() == axes["bytes"].get_ylim()
    assert tables[1]["pooled_relative_error"] == 0.0 and axes["rel_error"].get_xscale() == "linear"  # fp32: no log axis
    # the artifact's own chart is this figure
    assert _read_png(tmp_path / "art" / "tables.png").shape[:2] == (round(plots._bar_height(26) * plots.DPI),
                                                                     plots.TABLES_WIDTH * plots.DPI)
    broken = [{k: v for k, v in tables[0].items() if k != "pooled_relative_error"}]
    with pytest.raises(ValueError, match=r"'sparse_arch.embedding_bag_collection.t_cat_0' lacks \['pooled_relative_error'\]"):
        plots.table_report_figure(broken)


def _vlines(ax, gid):
    """The steps of ``ax``'s vertical marker lines of ``gid``."""
    found = []
    for line in ax.lines:
        if line.get_gid() == gid:
            xs = list(line.get_xdata())
            assert xs[0] == xs[1], xs  # vertical
            found.append(xs[0])
    return found


def test_training_curves_mark_resumes_and_world_size_changes_and_draw_evals_as_points():
    steps = list(range(1, 13))
    losses = [0.7 - 0.01 * s for s in steps]
    evals = [{"step": 4, "log_loss": 0.66, "auc": 0.61}, {"step": 8, "log_loss": 0.62, "auc": 0.65},
             {"step": 12, "log_loss": 0.6, "auc": 0.7}]
    starts = [{"step": 0, "world_size": 1, "resumed": False}, {"step": 4, "world_size": 1, "resumed": True},
              {"step": 8, "world_size": 2, "resumed": True}, {"step": 10, "world_size": 4, "resumed": True}]
    fig = plots.training_curves_figure(steps, losses, evals, title="t", starts=starts)
    top, bottom = fig.axes
    for ax in (top, bottom):
        assert _vlines(ax, "resume") == [4]
        assert _vlines(ax, "world_size") == [8, 10]
    assert [t.get_text() for t in top.texts] == ["1 -> 2 ranks", "2 -> 4 ranks"]
    assert [t.xy[0] for t in top.texts] == [8, 10]
    by_label = {line.get_label(): line for line in top.lines + bottom.lines}
    for label, key, ax in (("eval log loss", "log_loss", top), ("eval AUC", "auc", bottom)):
        line = by_label[label]
        assert line in ax.lines and line.get_marker() == "o"
        assert list(line.get_xdata()) == [4, 8, 12] and list(line.get_ydata()) == [e[key] for e in evals]
    assert list(by_label["train loss"].get_xdata()) == steps and list(by_label["train loss"].get_ydata()) == losses
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert legend == ["train loss", "eval log loss", "resumed", "world size changed"]  # each kind of marker once
    # a history without start records (written before they existed), or a fresh run: no marks
    for none in ((), starts[:1]):
        fig = plots.training_curves_figure(steps, losses, evals, starts=none)
        assert all(line.get_gid() is None for ax in fig.axes for line in ax.lines) and not fig.axes[0].texts
    with pytest.raises(ValueError, match=r"a start entry lacks \['resumed'\]"):
        plots.training_curves_figure(steps, losses, evals, starts=[{"step": 0, "world_size": 1}])


def test_recship_train_records_and_marks_a_resume_on_more_ranks(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "--steps", "4") == 0
    assert _train(out, "--steps", "8", "--resume", "--nproc-per-node", "2") == 0
    assert _train(out, "--steps", "10", "--resume", "--nproc-per-node", "2") == 0
    h = _history(out)
    assert h.starts == [{"step": 0, "world_size": 1, "resumed": False}, {"step": 4, "world_size": 2, "resumed": True},
                        {"step": 8, "world_size": 2, "resumed": True}]
    assert h.steps == list(range(1, 11)) and [e["step"] for e in h.evals] == [4, 8, 10]
    fig = plots.training_curves_figure(h.steps, h.loss_values, h.evals, starts=h.starts)
    assert _vlines(fig.axes[0], "world_size") == [4] and _vlines(fig.axes[0], "resume") == [8]
    assert [t.get_text() for t in fig.axes[0].texts] == ["1 -> 2 ranks"]


def test_log_scale_only_when_values_span_decades():
    assert plots._spans_decades([1.0, 100.0])
    assert not plots._spans_decades([1.0, 99.0])
    assert not plots._spans_decades([0.0, 1.0, 1000.0])  # a zero (an fp32 table's error) has no log
    assert not plots._spans_decades([])


def test_bench_chart(tmp_path, capsys):
    labels = ["batch 1", "batch 64", "batch 512"]
    panels = {"us": {"python": [10.0, 80.0, 700.0], "c++": [4.0, math.nan, 650.0]}, "MB": {"rss": [300.0, 310.0, 330.0]}}
    written = plots.write_bench_chart(str(tmp_path / "out" / "bench.png"), "bench", labels, panels)
    assert written == tmp_path / "out" / "bench.png"
    assert capsys.readouterr().out == f"chart: {written}\n"
    assert _read_png(written).shape[1] == plots.BAR_WIDTH * plots.DPI
    assert plots.write_bench_chart("", "bench", labels, panels) is None  # --plot '': none
    with pytest.raises(ValueError, match="series 'rss' of panel 'MB' has 2 values for 3 rows"):
        plots.plot_bench(tmp_path / "b.png", "bench", labels, {"MB": {"rss": [1.0, 2.0]}})
    with pytest.raises(ValueError, match="no rows"):
        plots.plot_bench(tmp_path / "b.png", "bench", [], {"MB": {"rss": []}})


def test_a_failed_write_keeps_the_previous_png(tmp_path):
    path = tmp_path / "curves.png"
    plots.plot_training_curves(path, [1, 2], [0.7, 0.6], [])
    before = path.read_bytes()

    class Killed:
        def savefig(self, target, **kw):
            with open(target, "wb") as f:
                f.write(PNG_SIGNATURE)  # half a PNG, then the process is interrupted
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        plots._save(Killed(), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png"]


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib (and of its submodules already loaded) fail, as in an install without the extra."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(plots, "_noted", False)


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, no_matplotlib):
    with pytest.raises(plots.PlotsUnavailable, match=r"pip install 'recship\[plots\]'") as e:
        plots.plot_training_curves(tmp_path / "c.png", [1], [0.5], [])
    assert isinstance(e.value, ImportError) and isinstance(e.value, ValueError)  # the CLI's one-line errors are ValueErrors
    assert not (tmp_path / "c.png").exists()


def test_side_effect_charts_say_once_how_to_get_them_without_matplotlib(tmp_path, no_matplotlib, caplog):
    """An install without the plots extra draws no chart and says so in one INFO line per process, not a warning."""
    with caplog.at_level(logging.INFO, logger="recship.plots"):
        assert plots.plot_if_available(plots.plot_training_curves, tmp_path / "c.png", [1], [0.5], []) is None
        table = {"table": "t", "data_type": "INT8", "float_bytes": 64, "quantized_bytes": 24, "max_abs_error": 0.1,
                 "mean_abs_error": 0.01, "pooled_relative_error": 0.004}
        assert plots.plot_if_available(plots.plot_table_report, tmp_path / "t.png", [table]) is None
        assert plots.write_bench_chart(str(tmp_path / "b.png"), "bench", ["a"], {"us": {"x": [1.0]}}) is None
    lines = [r for r in caplog.records if r.name == "recship.plots"]
    assert len(lines) == 1 and "recship[plots]" in lines[0].getMessage()
    assert lines[0].levelno == logging.INFO
    assert list(tmp_path.iterdir()) == []


def test_other_errors_are_not_swallowed(tmp_path):
    with pytest.raises(ValueError, match="same length"):
        plots.plot_if_available(plots.plot_training_curves, tmp_path / "c.png", [1, 2], [0.5], [])


# -- the commands that draw them -------------------------------------------------------------------

TRAIN_FLAGS = ["--steps", "8", "--batch-size", "32", "--num-embeddings-per-feature", "40", "--embedding-dim", "8",
               "--dense-arch", "16", "--over-arch", "16", "--eval-every", "4", "--eval-batches", "2", "--checkpoint-every", "4",
               "--no-progress"]


def _train(out, *extra):
    from recship.cli import main

    return main(["train", "--out", str(out), *TRAIN_FLAGS, *extra])


def _history(out):
    from recship.trainer.history import History

    h = History(out, keep_until=10**9)
    h.close()
    return h


def test_recship_train_draws_the_whole_run_across_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"curves: {out / 'curves.png'}"
    w, h = plots.CURVES_SIZE
    assert _read_png(out / "curves.png").shape == (h * plots.DPI, w * plots.DPI, 4)
    first = _history(out)
    assert first.steps == list(range(1, 9)) and [e["step"] for e in first.evals] == [4, 8]
    assert all(set(e) >= {"log_loss", "auc"} for e in first.evals)

    assert _train(out, "--steps", "12", "--resume") == 0
    resumed = _history(out)
    assert resumed.steps == list(range(1, 13)) and [e["step"] for e in resumed.evals] == [4, 8, 12]
    assert resumed.losses[:8] == first.losses

    # back to the checkpoint of step 4 (as if 8 and 12 were lost): steps 5-12 of the old history must go
    for step in (8, 12):
        shutil.rmtree(out / "checkpoints" / f"step_{step:08d}")
    mtime = (out / "curves.png").stat().st_mtime_ns
    assert _train(out, "--steps", "6", "--resume") == 0
    again = _history(out)
    assert again.steps == list(range(1, 7)) and [e["step"] for e in again.evals] == [4, 6]
    # the resumes at 8 (the abandoned part) and at 4 before it: only the last start at 4 stays
    assert again.starts == [{"step": 0, "world_size": 1, "resumed": False}, {"step": 4, "world_size": 1, "resumed": True}]
    # the resume is exact, so steps 5 and 6 train to the losses they had the first time
    np.testing.assert_allclose(again.loss_values, first.loss_values[:6], rtol=0, atol=1e-6)
    assert (out / "curves.png").stat().st_mtime_ns != mtime  # redrawn


def test_recship_train_no_plot_keeps_the_history_only(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "--steps", "2", "--no-plot") == 0
    assert "curves:" not in capsys.readouterr().out
    assert not (out / "curves.png").exists()
    assert _history(out).steps == [1, 2]


def test_training_without_matplotlib_says_so_once_and_finishes(tmp_path, no_matplotlib, caplog):
    with caplog.at_level(logging.INFO, logger="recship.plots"):
        summary = launch(_tiny_training(tmp_path / "run", steps=4))
    assert summary["steps"] == 4 and summary["curves"] is None
    lines = [r for r in caplog.records if r.name == "recship.plots"]
    assert len(lines) == 1 and "recship[plots]" in lines[0].getMessage()  # once, not at each evaluation
    assert lines[0].levelno == logging.INFO  # not a warning on every run of an install without the extra
    assert not (tmp_path / "run" / "curves.png").exists()
    assert _history(tmp_path / "run").steps == [1, 2, 3, 4]


def _small_dlrm():
    import torch

    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    torch.manual_seed(0)
    return BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[20 + i for i in range(26)], embedding_dim=8, dense_arch=[16], over_arch=[16]))


def _export_config(**kw):
    from recship.export import ExportConfig

    return ExportConfig(**{"progress": False, "validation_batches": 1, "validation_batch_size": 32, "format": "torchscript", **kw})


def test_export_puts_the_table_chart_in_the_artifact(tmp_path):
    from recship.export import export_model
    from recship.export.artifact import open_artifact
    from recship.export.config import TABLES_CHART

    manifest = export_model(_small_dlrm(), _export_config(out=str(tmp_path / "art"), plot=True))
    art = tmp_path / "art"
    assert sorted(p.name for p in art.iterdir()) == ["manifest.json", "model.pt", "sample", "tables.bin", TABLES_CHART]
    assert _read_png(art / TABLES_CHART).shape[:2] == (round(plots._bar_height(26) * plots.DPI), plots.TABLES_WIDTH * plots.DPI)
    _, loaded = open_artifact(art)  # still a valid, self-checking artifact
    assert loaded.to_dict() == manifest
    # a repository version gets it too, published with the rest (no temporary folder left)
    export_model(_small_dlrm(), _export_config(repo=str(tmp_path / "repo"), model_name="dlrm", plot=True))
    assert sorted(p.name for p in (tmp_path / "repo" / "dlrm").iterdir()) == ["1"]
    assert (tmp_path / "repo" / "dlrm" / "1" / TABLES_CHART).stat().st_size > 1000


def test_export_without_matplotlib(tmp_path, no_matplotlib):
    from recship.export import export_model

    with pytest.raises(plots.PlotsUnavailable, match=r"recship\[plots\]"):
        _export_config(out=str(tmp_path / "asked"), plot=True)  # asked for: refused before any work
    export_model(_small_dlrm(), _export_config(out=str(tmp_path / "art"), plot=None))  # not asked: no chart, no failure
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == ["manifest.json", "model.pt", "sample", "tables.bin"]


def test_recship_export_prints_the_chart_and_inspect_draws_one(tmp_path, capsys, small_artifact):
    from recship.cli import main

    assert _train(tmp_path / "run", "--steps", "4", "--no-plot") == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "art"), "--format", "torchscript"]) == 0
    out = capsys.readouterr().out
    assert f"chart: {tmp_path / 'art' / 'tables.png'}" in out.splitlines()
    assert (tmp_path / "art" / "tables.png").read_bytes().startswith(PNG_SIGNATURE)
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "plain"), "--format", "torchscript", "--no-plot"]) == 0
    assert not (tmp_path / "plain" / "tables.png").exists() and "chart:" not in capsys.readouterr().out

    chart = tmp_path / "charts" / "inspect.png"
    assert main(["inspect", str(small_artifact), "--plot", str(chart)]) == 0
    assert f"chart: {chart}" in capsys.readouterr().out.splitlines()
    assert _read_png(chart).shape[:2] == (round(plots._bar_height(26) * plots.DPI), plots.TABLES_WIDTH * plots.DPI)


def test_recship_inspect_plot_alone_is_a_switch_as_in_export(tmp_path, capsys, small_artifact, monkeypatch):
    """inspect --plot without a file, as train's and export's --plot: tables.png in the current folder, its path
    printed; the artifact is left as it was."""
    from recship.cli import main

    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in small_artifact.iterdir())
    assert main(["inspect", str(small_artifact), "--plot"]) == 0
    assert f"chart: {tmp_path / 'tables.png'}" in capsys.readouterr().out.splitlines()
    assert _read_png(tmp_path / "tables.png").shape[:2] == (round(plots._bar_height(26) * plots.DPI), plots.TABLES_WIDTH * plots.DPI)
    assert sorted(p.name for p in small_artifact.iterdir()) == before


def test_recship_inspect_plot_without_matplotlib_is_a_one_line_error(tmp_path, capsys, small_artifact, no_matplotlib):
    from recship.cli import main

    assert main(["inspect", str(small_artifact), "--plot", str(tmp_path / "t.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "pip install 'recship[plots]'" in captured.err
    assert main(["inspect", str(small_artifact)]) == 0  # without --plot, matplotlib is not needed
