"""Forward latency of the exported model: the pre-issue-19 forward vs the flat TorchScript vs AOTInductor.

    .venv/bin/python bench/aoti_bench.py [--rounds 7] [--threads 1] [--baseline-dlrm DIR] [--baseline-two-tower DIR] [--cpp]
        [--plot PNG]

For the default DLRM (26 x 1000 x 16, INT8) and the two-tower example (models/two_tower.py,
INT8) it exports the artifact (model.pt + model.pt2; compile time and sizes printed) and
times, at batch 1, 64 and 512, in interleaved rounds (median of per-round medians):

- baseline: the forward artifacts had before the flat path (a KJT built from the request,
  the inference-sharded collection's per-feature modules, fbgemm's TBE modules), rebuilt
  here from the same quantized tables; or, with ``--baseline-*``, an artifact exported by
  an older recship (its model.pt), the exact "today's artifact";
- flat TorchScript: the artifact's model.pt;
- AOTI: the artifact's model.pt2.

``--cpp`` also runs the C++ loader (`recship_predict --bench`) on model.pt and model.pt2
(and the baseline artifacts if given), alternating processes round by round.
"""

import argparse
import copy
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 64, 512)
PLOT = ROOT / "bench" / "out" / "aoti_bench.png"
VARIANTS = ("baseline", "flat TorchScript", "AOTI", "flat TorchScript, whole batch", "AOTI, whole batch")


def _requests(manifest, batch: int, seed: int):
    """dense, lengths, values: 0-2 ids per feature and example (mean 1), uniform over each table."""
    g = torch.Generator().manual_seed(seed)
    rows = [f.rows for f in manifest.sparse_features]
    lengths = torch.randint(0, 3, (len(rows) * batch,), generator=g)
    limit = torch.tensor(rows).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * limit).long()
    return torch.rand(batch, manifest.num_dense, generator=g), lengths.to(torch.int32), values


def _time(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _baseline_module(model: torch.nn.Module, num_dense: Optional[int]):
    """The pre-flat exported forward of ``model`` (KJT + inference-sharded modules + TBE modules), scripted."""
    from recship.export.model import ExportedModule, trace_and_script
    from recship.quantize.sharded import shard_quant_model
    from recship.quantize import quantize_embeddings
    from recship.trainer.entry_point import describe_model

    q, _ = quantize_embeddings(copy.deepcopy(model), dtype="int8")
    sharded, _ = shard_quant_model(q, shards=1, sharding="table_wise")
    names = [f[0] for f in describe_model(model, num_dense)["features"]]
    single = not hasattr(model, "eval_output")  # the DLRM names its outputs (serving_outputs); TwoTower answers a dict
    return trace_and_script(ExportedModule(sharded, names, single_output=single).eval())


def _python(name: str, model: torch.nn.Module, art: Path, baseline_dir: Optional[str], rounds: int,
            chart: Dict[str, List[float]]) -> None:
    """Prints the Python table; appends each batch's medians (us) to ``chart`` (a row label -> one per VARIANTS)."""
    from recship.export.artifact import Manifest, open_artifact

    manifest = Manifest.read(art)
    flat, _ = open_artifact(art, format="torchscript")
    compiled, _ = open_artifact(art, format="aoti")
    if baseline_dir:
        baseline, _ = open_artifact(baseline_dir, format="torchscript")
        label = f"artifact {baseline_dir}"
    else:
        baseline = _baseline_module(model, manifest.num_dense)
        label = "pre-flat forward rebuilt here"
    # the artifact's model runs in blocks of row_block rows (export/blocks.py: batch invariance); the loaded model
    # itself, run on the whole batch, is what every batch ran before it
    variants = {"baseline": baseline, "flat TorchScript": flat, "AOTI": compiled,
                "flat TorchScript, whole batch": getattr(flat, "model", flat), "AOTI, whole batch": getattr(compiled, "model", compiled)}
    print(f"\n{name}: Python, {torch.get_num_threads()} thread(s), baseline = {label}; "
          f"model.pt {(art / 'model.pt').stat().st_size / 1e6:.2f} MB, model.pt2 {(art / 'model.pt2').stat().st_size / 1e6:.2f} MB, "
          f"AOTI compile {manifest.aoti.compile_seconds:.1f} s")
    print(f"row_block {manifest.row_block or 0}: 'blocks' columns run the artifact as loaders do, 'whole' the same model on the "
          "whole batch (as before batch invariance)")
    print(f"{'batch':>5s} {'baseline us':>12s} {'flat TS us':>11s} {'AOTI us':>9s} {'flat/base':>10s} {'AOTI/base':>10s} "
          f"{'TS whole us':>12s} {'AOTI whole us':>14s} {'TS blocks/whole':>16s} {'AOTI blocks/whole':>18s}")
    for batch in BATCHES:
        dense, lengths, values = _requests(manifest, batch, seed=batch)
        with torch.inference_mode():
            want = flat(dense, lengths, values, None)
            got = compiled(dense, lengths, values, None)
            ref = baseline(dense, lengths, values, None)
            same = all(torch.equal(got[k], want[k]) for k in want)
            close = all(torch.allclose(ref[k], want[k], rtol=0, atol=1e-5) for k in want if k in ref)
            calls = 200 if batch < 512 else 40
            medians: Dict[str, List[float]] = {k: [] for k in variants}
            for _ in range(rounds):
                for k, m in variants.items():
                    medians[k].append(_time(lambda m=m: m(dense, lengths, values, None), calls))
        t = {k: statistics.median(v) for k, v in medians.items()}
        chart[f"{name}, Python, batch {batch}"] = [t[k] for k in VARIANTS]
        print(f"{batch:5d} {t['baseline']:12.1f} {t['flat TorchScript']:11.1f} {t['AOTI']:9.1f} "
              f"{t['flat TorchScript'] / t['baseline']:10.2f} {t['AOTI'] / t['baseline']:10.2f} "
              f"{t['flat TorchScript, whole batch']:12.1f} {t['AOTI, whole batch']:14.1f} "
              f"{t['flat TorchScript'] / t['flat TorchScript, whole batch']:16.2f} {t['AOTI'] / t['AOTI, whole batch']:18.2f}"
              f"{'' if same else '  (AOTI != TorchScript bitwise)'}{'' if close else '  (baseline differs!)'}")


def _cpp(name: str, art: Path, baseline_dir: Optional[str], rounds: int, work: Path, chart: Dict[str, List[float]]) -> None:
    """Prints the C++ table; appends each batch's raw forward medians (us) to ``chart`` (NaN: not run)."""
    from recship.export.artifact import Manifest
    from recship.native import find, runtime_env

    binary = find("recship_predict")  # the one installed with recship, else this checkout's (built now)
    env = runtime_env()
    manifest = Manifest.read(art)
    runs = {"flat TorchScript": (art, "torchscript"), "AOTI": (art, "aoti")}
    if baseline_dir:
        runs = {"baseline": (Path(baseline_dir), "torchscript"), **runs}
    print(f"\n{name}: C++ recship_predict --bench (raw forward p50 us; predict p50 in brackets)")
    print(f"{'batch':>5s} " + " ".join(f"{k:>24s}" for k in runs))
    for batch in BATCHES:
        dense, lengths, values = _requests(manifest, batch, seed=batch)
        sparse, start = {}, 0
        for i, f in enumerate(manifest.feature_names):
            rows = []
            for n in lengths[i * batch:(i + 1) * batch].tolist():
                rows.append(values[start:start + n].tolist())
                start += n
            sparse[f] = rows
        request = work / f"{name}-{batch}.json"
        body = {"sparse": sparse}
        if manifest.num_dense:
            body["dense"] = dense.tolist()
        request.write_text(json.dumps(body))
        raw: Dict[str, List[float]] = {k: [] for k in runs}
        predict: Dict[str, List[float]] = {k: [] for k in runs}
        for _ in range(rounds):
            for k, (path, fmt) in runs.items():
                out = subprocess.run([str(binary), str(path), "--request", str(request), "--bench", "200", "--format", fmt],
                                     capture_output=True, text=True, check=True, env=env)
                raw[k].append(float(re.search(r"raw forward p50 ([\d.]+)", out.stderr).group(1)) * 1e3)
                predict[k].append(float(re.search(r"predict p50 ([\d.]+)", out.stderr).group(1)) * 1e3)
        chart[f"{name}, C++, batch {batch}"] = [statistics.median(raw[k]) if k in raw else float("nan") for k in VARIANTS]
        cells = [f"{statistics.median(raw[k]):12.1f} ({statistics.median(predict[k]):9.1f})" for k in runs]
        print(f"{batch:5d} " + " ".join(f"{c:>24s}" for c in cells))


def main() -> None:
    from recship.export import ExportConfig, export_model
    from recship.models import TwoTower
    from recship.plots import write_bench_chart
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--baseline-dlrm", help="an artifact of the default DLRM exported by an older recship")
    parser.add_argument("--baseline-two-tower", help="an artifact of the default TwoTower exported by an older recship")
    parser.add_argument("--cpp", action="store_true", help="also time the C++ loader")
    parser.add_argument("--workdir", help="where artifacts go (default: a fresh temporary folder)")
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="recship-aoti-bench-"))
    models = [("DLRM 26 x 1000 x 16 INT8", BuiltinDLRM(DLRMConfig()), args.baseline_dlrm),
              ("two-tower INT8", TwoTower(), args.baseline_two_tower)]
    chart: Dict[str, List[float]] = {}
    for i, (name, model, baseline) in enumerate(models):
        torch.manual_seed(0)
        model = type(model)(DLRMConfig()) if i == 0 else TwoTower()  # after the seed: the same weights every run
        art = work / f"model{i}"
        export_model(model, ExportConfig(out=str(art), dtype="int8", progress=False, validation_batches=1, format="both",
                                         overwrite=True))
        _python(name, model, art, baseline, args.rounds, chart)
        if args.cpp:
            _cpp(name, art, baseline, max(3, args.rounds // 2), work, chart)
    series = {k: [row[i] for row in chart.values()] for i, k in enumerate(VARIANTS)}
    write_bench_chart(args.plot, "exported model forward (median us; C++: raw forward)", list(chart), {"us per call": series})


if __name__ == "__main__":
    main()
