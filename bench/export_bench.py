"""Export throughput and peak memory: N tables x rows x dim of float to each type, with and without the error-minimising search.

    .venv/bin/python bench/export_bench.py [--tables 26 --rows 100000 --dim 64] [--dtypes int8,int4]
                                           [--search both|on|off] [--workdir DIR]
    .venv/bin/python bench/export_bench.py --rows 1000000 --dtypes int4   # real size: 6.6 GB float
    .venv/bin/python bench/export_bench.py --checkpoint CKPT [--dtypes ...]  # export a checkpoint already there
    .venv/bin/python bench/export_bench.py --cold-warm   # the compile cache: cold vs warm export of small models

Issue 40's quantization figures, before/after in one run against a checkout of the old code:

    git worktree add /tmp/recship-old <commit>
    .venv/bin/python bench/export_bench.py --rows 1000000 --dtypes int8,int4 --search off --against /tmp/recship-old --rounds 2
    .venv/bin/python bench/export_bench.py --rows 200000 --dtypes int4 --search on --against /tmp/recship-old --rounds 2

Trains one step to get a checkpoint of that size, then exports it in a fresh process per
(type, search) and prints wall time, GB/s of float input (the tables' float bytes over the
export's wall time, every stage included), the process's peak RSS (VmHWM), the RSS of a
process that only imported torch + fbgemm_gpu + recship, and both as multiples of the float
tables' size. Without --workdir the checkpoint goes to a temporary folder, deleted at the end.
``--against TREE``: each export also runs with the recship of TREE (another checkout: its packages are
imported instead of this one's), the two alternating, and the ratio is printed; ``--rounds N`` repeats
each export N times and keeps its fastest (on a shared machine the noise only adds time).

``--cold-warm``: the default DLRM (26 x 1000 x 16) and the two-tower (models/two_tower.py), INT8, format auto
(model.pt2 and model.pt), each exported from memory in a fresh process: cold (empty compile cache and inductor
cache), then warm (the same architecture with other weights, both caches as the cold export left them), then warm
with ``compile_cache=False`` (inductor's own caches only). Prints the export's seconds, the part in torch.export +
model.pt2's compile (or its cache lookup), and warm / cold.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Dict, Optional

from recship.plots import write_bench_chart

PLOT = Path(__file__).resolve().parent / "out" / "export_bench.png"
CHILD = """
import json, os, sys, time
import fbgemm_gpu, torch
from recship.export import ExportConfig, export_model
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
mode, checkpoint, out, dtype, search = sys.argv[1:6]
if mode == "baseline":
    print(json.dumps({"rss": hwm()}))
    sys.exit(0)
t, cpu = time.perf_counter(), os.times()
export_model(checkpoint, ExportConfig(out=out, dtype=dtype, error_minimizing=search == "on", progress=False, overwrite=True,
                                     format="torchscript"))  # quantization throughput: no AOTInductor compile (a fixed 15-40 s)
seconds, after = time.perf_counter() - t, os.times()
cpu_seconds = after.user + after.system - cpu.user - cpu.system
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "rss": hwm(), "threads": torch.get_num_threads()}))
"""

COLD_WARM_CHILD = """
import json, sys, time
import torch
from recship.export import ExportConfig, export_model
from recship.models import TwoTower
from recship.models.dlrm import BuiltinDLRM, DLRMConfig
name, out, seed, cache = sys.argv[1:5]
torch.manual_seed(int(seed))
model = BuiltinDLRM(DLRMConfig()) if name == "dlrm" else TwoTower()
t = time.perf_counter()
manifest = export_model(model, ExportConfig(out=out, dtype="int8", progress=False, overwrite=True,
                                            compile_cache=cache if cache != "off" else False))
print(json.dumps({"seconds": time.perf_counter() - t, "compile": (manifest.get("aoti") or {}).get("compile_seconds", 0.0)}))
"""


def cold_warm(work: Path) -> None:
    """Cold and warm exports of the small models (``--cold-warm``; see the module's docstring)."""
    print(f"{'model':22s} {'export':18s} {'seconds':>8s} {'compile':>8s} {'rest':>6s} {'x cold':>7s}")
    for name, label in (("dlrm", "DLRM 26 x 1000 x 16"), ("two_tower", "two-tower")):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / name / "inductor")}
        env.pop("RECSHIP_AOTI", None)
        cold = None
        for run, seed, cache in (("cold", 0, "cache"), ("warm", 1, "cache"), ("warm, no cache", 2, "off")):
            argv = [name, str(work / name / "art"), str(seed), str(work / name / "cache") if cache == "cache" else "off"]
            out = subprocess.run([sys.executable, "-c", COLD_WARM_CHILD, *argv], capture_output=True, text=True, check=True, env=env)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            cold = cold or r["seconds"]
            print(f"{label:22s} {run:18s} {r['seconds']:8.1f} {r['compile']:8.1f} {r['seconds'] - r['compile']:6.1f} "
                  f"{r['seconds'] / cold:7.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtypes", default="int8,int4", help="comma-separated export types")
    parser.add_argument("--search", choices=("both", "on", "off"), default="both", help="error-minimising search on, off or both")
    parser.add_argument("--workdir", default=None, help="keep the checkpoint and artifacts here (default: a temporary folder, deleted)")
    parser.add_argument("--checkpoint", default=None, help="export this checkpoint (of the built-in DLRM) instead of training one; "
                        "its tables give the float size")
    parser.add_argument("--against", default=None, metavar="TREE", help="also export with the recship of this checkout (e.g. a git "
                        "worktree of an older commit), alternating, and print the ratio")
    parser.add_argument("--rounds", type=int, default=1, help="exports of each kind; the fastest is kept (default 1)")
    parser.add_argument("--cold-warm", action="store_true", help="time cold vs warm exports of small models (the compile cache) instead")
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="recship-export-bench-"))
    try:
        if args.cold_warm:
            cold_warm(work)
        else:
            run(args, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    if args.checkpoint is None:
        float_bytes = args.tables * args.rows * args.dim * 4
        print(f"{args.tables} tables x {args.rows} rows x dim {args.dim}: {float_bytes / 1e9:.2f} GB float; work dir {work}")
        from recship.trainer.train import TrainConfig, launch

        summary = launch(TrainConfig(out=str(work / "train"), steps=1, batch_size=256, num_embeddings_per_feature=[args.rows] * args.tables,
                                     embedding_dim=args.dim, eval_every=0, eval_batches=1, checkpoint_every=0, progress=False, overwrite=True))
        checkpoint = summary["checkpoint"]
    else:
        from recship.trainer.checkpoint_reader import CheckpointReader

        checkpoint = args.checkpoint
        tables = [cfg for _, cfg in CheckpointReader(Path(checkpoint)).table_configs()]
        float_bytes = sum(t.num_embeddings * t.embedding_dim * 4 for t in tables)
        print(f"{checkpoint}: {len(tables)} tables, {float_bytes / 1e9:.2f} GB float; work dir {work}")

    trees: Dict[str, Optional[Path]] = {"this tree": None}
    if args.against:
        trees["against"] = package_map(Path(args.against), work / "against")

    def child(tree: Optional[Path], *argv):
        # run from the work folder (not this checkout: '' on sys.path would import it); --against's packages first
        env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else None
        out = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True, cwd=work, env=env)
        return json.loads(out.stdout.strip().splitlines()[-1])

    base = child(None, "baseline", "-", "-", "-", "-")["rss"]
    print(f"process with torch + fbgemm_gpu + recship imported: {base / 2**20:.0f} MB RSS")
    print(f"{'type':5s} {'search':6s} {'recship':9s} {'seconds':>8s} {'GB/s':>6s} {'CPU s':>7s} {'peak RSS MB':>12s} {'x float':>8s} "
          f"{'(peak - imports) x float':>25s}")
    searches = ("off", "on") if args.search == "both" else (args.search,)
    labels, throughput, memory, above = [], [], [], []
    for dtype in args.dtypes.split(","):
        for search in searches:
            best: Dict[str, dict] = {}
            for _ in range(args.rounds):
                for name, tree in trees.items():  # alternating: the machine's load falls on both alike
                    out = work / f"art_{dtype}_{search}"
                    r = child(tree, "export", checkpoint, str(out), dtype, search)
                    shutil.rmtree(out, ignore_errors=True)
                    if name not in best or r["seconds"] < best[name]["seconds"]:
                        best[name] = r
            for name, r in best.items():
                labels.append(f"{dtype}, search {search}" + (f" ({name})" if len(trees) > 1 else ""))
                throughput.append(float_bytes / 1e9 / r["seconds"])
                memory.append(r["rss"] / float_bytes)
                above.append((r["rss"] - base) / float_bytes)
                print(f"{dtype:5s} {search:6s} {name:9s} {r['seconds']:8.1f} {float_bytes / 1e9 / r['seconds']:6.3f} {r['cpu_seconds']:7.1f} "
                      f"{r['rss'] / 2**20:12.0f} {r['rss'] / float_bytes:8.2f} {(r['rss'] - base) / float_bytes:25.2f}", flush=True)
            if len(best) > 1:
                print(f"      this tree / against: {best['against']['seconds'] / best['this tree']['seconds']:.2f}x the GB/s, "
                      f"{best['this tree']['rss'] / best['against']['rss']:.2f}x the peak RSS")
    print(f"(torch intra-op threads in the export: {r['threads']}; fastest of {args.rounds} round(s))")
    write_bench_chart(args.plot, f"export of {float_bytes / 1e9:.2f} GB of float tables", labels,
                      {"GB/s": {"GB/s of float input": throughput},
                       "x float bytes": {"peak RSS": memory, "peak RSS - imports": above}})


def package_map(tree: Path, folder: Path) -> Path:
    """A folder from which ``import recship`` imports checkout ``tree``'s packages: recship/ holds links to tree/recship's
    files and, for each subpackage pyproject.toml maps to another folder (recship.quantize -> quantize/), a link to it."""
    if not (tree / "recship" / "__init__.py").is_file():
        raise SystemExit(f"--against {tree}: not a recship checkout (no recship/__init__.py)")
    dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = folder / "recship"
    package.mkdir(parents=True)
    for entry in (tree / "recship").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for name, source in dirs.items():
        if name.count(".") == 1 and not (package / name.split(".")[1]).exists():
            (package / name.split(".")[1]).symlink_to((tree / source).resolve())
    return folder


if __name__ == "__main__":
    main()
