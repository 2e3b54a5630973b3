"""C++ loader latency vs Python in-process, batch 1, 64 and 512.

    .venv/bin/python bench/cpp_bench.py [--plot PNG]

Exports a default-size DLRM (26 x 1000 x 16, INT8), then for each batch size runs
`recship_predict --bench` (predict = validation + input building + forward + output
copy, and the raw module forward with prebuilt inputs) and times the same artifact's
forward in Python with prebuilt tensors.
"""

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PLOT = ROOT / "bench" / "out" / "cpp_bench.png"


def main() -> None:
    from recship.export import ExportConfig, export_model
    from recship.export.artifact import open_artifact
    from recship.plots import write_bench_chart

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args()
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    from recship.native import find, runtime_env

    binary = find("recship_predict")  # the one installed with recship, else this checkout's (built now)
    work = Path(tempfile.mkdtemp(prefix="recship-cpp-bench-"))
    config = DLRMConfig()
    torch.manual_seed(0)
    art = work / "dlrm"
    export_model(BuiltinDLRM(config), ExportConfig(out=str(art), dtype="int8", progress=False, validation_batches=1))
    model, _ = open_artifact(art)
    print(f"DLRM 26 x {config.num_embeddings_per_feature[0]} x {config.embedding_dim} INT8, {torch.get_num_threads()} threads")
    print(f"{'batch':>5s} {'C++ predict p50 ms':>19s} {'C++ raw forward ms':>19s} {'C++ overhead':>13s} {'Python forward ms':>18s} {'C++ predict / Python':>21s}")
    g = np.random.default_rng(0)
    labels, ms = [], {"C++ predict p50": [], "C++ raw forward p50": [], "Python forward median": []}
    for batch in (1, 64, 512):
        sparse = {f"cat_{i}": [[int(x) for x in g.integers(0, r, size=3)] for _ in range(batch)] for i, r in enumerate(config.num_embeddings_per_feature)}
        dense = g.random((batch, config.num_dense)).tolist()
        request = work / f"req{batch}.json"
        request.write_text(json.dumps({"sparse": sparse, "dense": dense}))
        out = subprocess.run([str(binary), str(art), "--request", str(request), "--bench", "300"], capture_output=True, text=True, check=True,
                             env=runtime_env())
        predict = float(re.search(r"predict p50 ([\d.]+)", out.stderr).group(1))
        raw = float(re.search(r"raw forward p50 ([\d.]+)", out.stderr).group(1))
        lengths = torch.tensor([len(r) for f in sparse for r in sparse[f]], dtype=torch.int32)
        values = torch.tensor([i for f in sparse for r in sparse[f] for i in r], dtype=torch.int64)
        d = torch.tensor(dense, dtype=torch.float32)
        times = []
        with torch.inference_mode():
            for _ in range(300):
                t = time.perf_counter()
                model(d, lengths, values, None)
                times.append((time.perf_counter() - t) * 1e3)
        py = statistics.median(times)
        labels.append(f"batch {batch}")
        for key, value in zip(ms, (predict, raw, py)):
            ms[key].append(value)
        print(f"{batch:5d} {predict:19.3f} {raw:19.3f} {predict / raw - 1:13.1%} {py:18.3f} {predict / py:21.2f}")
    write_bench_chart(args.plot, f"C++ loader vs Python: DLRM 26 x {config.num_embeddings_per_feature[0]} INT8", labels, {"ms per call": ms})


if __name__ == "__main__":
    main()
