"""Export of a model other than the DLRM at scale: wall time and peak memory.

    .venv/bin/python bench/export_any_bench.py [--rows 100000] [--dim 64] [--tables 26] [--dtype int8] [--plot PNG]

A two-tower model with ``--tables`` EmbeddingBagCollection tables (half in each tower) of
``--rows`` x ``--dim`` is trained for one step by ``recship train --model`` (so export
starts from a real checkpoint), then ``recship export`` runs in a fresh process whose
peak RSS (VmHWM) is compared with the float tables' size.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import nn

from recship import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recship.plots import write_bench_chart

PLOT = Path(__file__).resolve().parent / "out" / "export_any_bench.png"


class WideTwoTower(nn.Module):
    """``tables`` features, each with its own table, split between a user and an item tower; output ``score``."""

    def __init__(self, tables: int = 26, rows: int = 100_000, dim: int = 64, device: Optional[str] = None) -> None:
        super().__init__()
        self.num_dense = 0
        half = tables // 2
        self.user = EmbeddingBagCollection([EmbeddingBagConfig(name=f"u{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"u{i}"])
                                            for i in range(half)], device=device)
        self.item = EmbeddingBagCollection([EmbeddingBagConfig(name=f"i{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"i{i}"])
                                            for i in range(tables - half)], device=device)
        self.user_mlp = nn.Linear(half * dim, dim)
        self.item_mlp = nn.Linear((tables - half) * dim, dim)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> Dict[str, torch.Tensor]:
        u = self.user_mlp(self.user(features).values())
        v = self.item_mlp(self.item(features).values())
        return {"score": (u * v).sum(dim=1, keepdim=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args()
    float_mb = args.tables * args.rows * args.dim * 4 / 2**20
    print(f"WideTwoTower: {args.tables} tables x {args.rows:,} rows x dim {args.dim} = {float_mb:,.0f} MB float32")
    model_args = json.dumps({"tables": args.tables, "rows": args.rows, "dim": args.dim})
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([sys.executable, "-m", "recship.cli", "train", "--model", "bench.export_any_bench:WideTwoTower",
                              "--model-args", model_args, "--out", f"{tmp}/run", "--steps", "1", "--batch-size", "64",
                              "--eval-every", "0", "--eval-batches", "1", "--checkpoint-every", "0", "--no-progress"],
                             capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-2000:])
            return 1
        checkpoint = next(Path(tmp, "run", "checkpoints").iterdir())
        probe = ("import resource, runpy, sys, time; sys.argv = ['recship'] + sys.argv[1:]; t = time.perf_counter()\n"
                 "from recship.cli import main\ncode = main(sys.argv[1:])\n"
                 "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
                 "print(f'BENCH {time.perf_counter() - t:.2f} {int(hwm) / 1024:.0f}', file=sys.stderr); sys.exit(code)")
        started = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", probe, "export", str(checkpoint), "--out", f"{tmp}/artifact", "--dtype", args.dtype],
                             capture_output=True, text=True)
        wall = time.perf_counter() - started
        if out.returncode:
            print(out.stderr[-2000:])
            return 1
        seconds, peak = out.stderr.strip().splitlines()[-1].split()[1:]
        base = subprocess.run([sys.executable, "-c", "import fbgemm_gpu, torch, recship.export, recship.cli\n"
                               "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"],
                              capture_output=True, text=True)
        baseline = int(base.stdout.strip().splitlines()[-1]) / 1024
        print(f"export to {args.dtype}: {float(seconds):.1f} s in recship's main ({wall:.1f} s with the interpreter and imports); "
              f"peak RSS {float(peak):,.0f} MB = {float(peak) / float_mb:.2f}x the float tables; "
              f"{float(peak) - baseline:,.0f} MB = {(float(peak) - baseline) / float_mb:.2f}x above the {baseline:,.0f} MB "
              "of a process that only imported torch, fbgemm_gpu and recship")
        write_bench_chart(args.plot, f"export of WideTwoTower ({args.tables} x {args.rows:,} x {args.dim}) to {args.dtype}",
                          ["memory"], {"MB": {"float tables": [float_mb], "peak RSS of the export": [float(peak)],
                                              "RSS of the imports alone": [baseline]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
