"""Export time and peak memory: 26 tables x 100k rows x dim 64 (about 670 MB float) to INT8 and INT4.

    .venv/bin/python bench/export_bench.py [--rows 100000 --dim 64] [--workdir DIR]

Trains one step to get a checkpoint of that size, then exports it in a fresh process per
type and prints wall time, the process's peak RSS (VmHWM), the RSS of a process that only
imported torch + fbgemm_gpu + recship, and both as multiples of the float tables' size.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
import fbgemm_gpu, torch
from recship.export import ExportConfig, export_model
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
mode, checkpoint, out, dtype = sys.argv[1:5]
if mode == "baseline":
    print(json.dumps({"rss": hwm()}))
    sys.exit(0)
t = time.perf_counter()
export_model(checkpoint, ExportConfig(out=out, dtype=dtype, progress=False, overwrite=True))
print(json.dumps({"seconds": time.perf_counter() - t, "rss": hwm()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="recship-export-bench-"))
    float_bytes = 26 * args.rows * args.dim * 4
    print(f"26 tables x {args.rows} rows x dim {args.dim}: {float_bytes / 2**20:.0f} MB float; work dir {work}")
    from recship.trainer.train import TrainConfig, launch

    summary = launch(TrainConfig(out=str(work / "train"), steps=1, batch_size=256, num_embeddings_per_feature=[args.rows] * 26,
                                 embedding_dim=args.dim, eval_every=0, eval_batches=1, checkpoint_every=0, progress=False, overwrite=True))
    checkpoint = summary["checkpoint"]

    def child(*argv):
        out = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    base = child("baseline", "-", "-", "-")["rss"]
    print(f"process with torch + fbgemm_gpu + recship imported: {base / 2**20:.0f} MB RSS")
    print(f"{'type':5s} {'seconds':>8s} {'peak RSS MB':>12s} {'x float':>8s} {'(peak - imports) x float':>25s}")
    for dtype in ("int8", "int4"):
        r = child("export", checkpoint, str(work / f"art_{dtype}"), dtype)
        print(f"{dtype:5s} {r['seconds']:8.1f} {r['rss'] / 2**20:12.0f} {r['rss'] / float_bytes:8.2f} {(r['rss'] - base) / float_bytes:25.2f}")


if __name__ == "__main__":
    main()
