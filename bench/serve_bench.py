"""Serving throughput and latency over loopback gRPC, batching on and off, vs the model in-process.

    .venv/bin/python bench/serve_bench.py [--seconds 3]

Exports a default-size DLRM (26 tables x 1000 rows x 16, INT8), serves it from this
process, and drives it from a separate load-generator process (threads, one
channel each) for a bounded time per configuration: concurrency 1, 8, 32, 128 with
1- and 64-example requests, batching on (2 ms window) and off. Then 512-example
requests at concurrency 1 against the in-process forward time.
"""

import argparse
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def _request_body(batch, rows, num_dense, seed):
    g = np.random.default_rng(seed)
    sparse = {f"cat_{i}": [list(g.integers(0, r, size=3)) for _ in range(batch)] for i, r in enumerate(rows)}
    return sparse, g.random((batch, num_dense), dtype=np.float32)


def _load(target, concurrency, batch, seconds, rows, num_dense, out):
    """Runs in its own process: `concurrency` threads send requests until `seconds` pass."""
    from recship.serving import PredictClient

    latencies, stop_at = [], time.time() + seconds
    lock = threading.Lock()

    def worker(k):
        client = PredictClient(target)
        req = client.request("dlrm", *_request_body(batch, rows, num_dense, k))
        mine = []
        while time.time() < stop_at:
            t = time.perf_counter()
            client.stub.Predict(req, timeout=30)
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)
        client.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - started
    lat = sorted(latencies)
    out.put((len(lat) * batch / elapsed, lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3))


def _drive(target, concurrency, batch, seconds, rows, num_dense):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_load, args=(target, concurrency, batch, seconds, rows, num_dense, q))
    p.start()
    result = q.get(timeout=seconds + 120)
    p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    import torch

    from recship.export import ExportConfig, export_model
    from recship.export.artifact import load_artifact
    from recship.serving.server import Server, ServerConfig
    from recship.trainer.dlrm import DLRM, DLRMConfig

    work = Path(tempfile.mkdtemp(prefix="recship-serve-bench-"))
    config = DLRMConfig()
    torch.manual_seed(0)
    export_model(DLRM(config), ExportConfig(out=str(work / "repo" / "dlrm" / "1"), dtype="int8", progress=False, validation_batches=1))
    rows, num_dense = config.num_embeddings_per_feature, config.num_dense
    model, _ = load_artifact(work / "repo" / "dlrm" / "1")
    print(f"DLRM 26 x {rows[0]} x {config.embedding_dim}, INT8; {args.seconds:g} s per point; torch threads {torch.get_num_threads()}")
    print(f"{'batching':8s} {'conc':>4s} {'ex/req':>6s} {'examples/s':>11s} {'p50 ms':>7s} {'p99 ms':>7s}")
    results = {}
    for delay in (2.0, 0.0):
        server = Server(ServerConfig(model_repo=str(work / "repo"), port=0, max_delay_ms=delay))
        try:
            target = f"127.0.0.1:{server.port}"
            for batch in (1, 64):
                for conc in (1, 8, 32, 128):
                    tput, p50, p99 = _drive(target, conc, batch, args.seconds, rows, num_dense)
                    results[(delay, conc, batch)] = tput
                    print(f"{'on' if delay else 'off':8s} {conc:4d} {batch:6d} {tput:11.0f} {p50:7.2f} {p99:7.2f}")
            if delay:
                _, p50_512, _ = _drive(target, 1, 512, args.seconds, rows, num_dense)
        finally:
            server.stop()
    sparse, dense = _request_body(512, rows, num_dense, 0)
    lengths = torch.tensor([len(r) for f in sparse for r in sparse[f]], dtype=torch.int32)
    values = torch.tensor([i for f in sparse for r in sparse[f] for i in r], dtype=torch.int64)
    with torch.no_grad():
        times = []
        for _ in range(30):
            t = time.perf_counter()
            model(torch.from_numpy(dense), lengths, values, None)
            times.append((time.perf_counter() - t) * 1e3)
    forward = statistics.median(times)
    print(f"batching on vs off, 32 clients x 1 example: {results[(2.0, 32, 1)] / results[(0.0, 32, 1)]:.2f}x (target >= 5x)")
    print(f"512-example requests: p50 {p50_512:.2f} ms end to end vs {forward:.2f} ms in-process forward = {p50_512 / forward:.2f}x (target <= 1.3x)")


if __name__ == "__main__":
    main()
