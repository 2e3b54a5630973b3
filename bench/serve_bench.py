"""Serving throughput and latency over loopback gRPC, batching on and off, per front, vs the model in-process.

    .venv/bin/python bench/serve_bench.py [--seconds 3] [--model small|mlperf|all] [--front python|cpp|both] [--load cpp|python]
        [--plot PNG]

For each model shape (``small``: the package's default DLRM, 26 x 1000 x 16;
``mlperf``: MLPerf DLRM's widths, 26 x 20k x 128 with MLPs 512-256-128 and
1024-1024-512-256), exports an INT8 artifact (model.pt2 beside model.pt where a compiler
is present), serves it from this process with each front (``--front python``: grpc.aio;
``--front cpp``: the C++ front, serving/front.py) and drives it from a separate load
generator for a bounded time per configuration: concurrency 1, 8, 32, 128 with 1- and
64-example requests, batching greedy (the server's default, ``--max-delay-ms 0``: no waiting,
requests queued during a forward run together), with a window (``--max-delay-ms``, 2 ms here)
and off (``--no-batching``: one request per forward). Then
512-example requests at concurrency 1 against the in-process forward of the same model file.

The load generator is ``recship_load`` (C++, cpp_loader/tools/recship_load.cpp: callback
API, no thread per client), so it costs little next to the server; its CPU use is printed
(cores = CPU seconds / wall seconds) to show it is not the bottleneck. ``--load python``
uses the older asyncio generator instead.
"""

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

PLOT = Path(__file__).resolve().parent / "out" / "serve_bench.png"


def _request_body(batch, rows, num_dense, seed):
    g = np.random.default_rng(seed)
    sparse = {f"cat_{i}": [list(g.integers(0, r, size=3)) for _ in range(batch)] for i, r in enumerate(rows)}
    return sparse, g.random((batch, num_dense), dtype=np.float32)


def _load(target, concurrency, batch, seconds, rows, num_dense, out):
    """Runs in its own process: `concurrency` asyncio clients send requests until `seconds` pass.

    grpc.aio keeps the generator's own cost per request low (threads would fight
    over the GIL), so the figures say more about the server than about the client.
    """
    import asyncio

    import grpc

    from recship.serving import PredictClient
    from recship.serving.v1 import predictor_pb2_grpc as pb_grpc

    async def run():
        channels = [grpc.aio.insecure_channel(target) for _ in range(min(concurrency, 8))]
        latencies = []
        stop_at = time.perf_counter() + seconds

        async def worker(k):
            stub = pb_grpc.PredictorStub(channels[k % len(channels)])
            req = PredictClient.request("dlrm", *_request_body(batch, rows, num_dense, k))
            while time.perf_counter() < stop_at:
                t = time.perf_counter()
                await stub.Predict(req, timeout=30)
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - started
        for c in channels:
            await c.close()
        return latencies, elapsed

    latencies, elapsed = asyncio.run(run())
    lat = sorted(latencies)
    out.put((len(lat) * batch / elapsed, lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3))


def _drive_python(target, concurrency, batch, seconds, rows, num_dense):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_load, args=(target, concurrency, batch, seconds, rows, num_dense, q))
    p.start()
    tput, p50, p99 = q.get(timeout=seconds + 120)
    p.join()
    return tput, p50, p99, float("nan")


def _drive_cpp(load_binary, work, target, concurrency, batch, seconds, rows, num_dense):
    """recship_load with 8 distinct request files (client k sends file k % 8): (examples/s, p50 ms, p99 ms, generator cores)."""
    import json
    import subprocess

    from recship.serving import PredictClient

    files = []
    for k in range(min(concurrency, 8)):
        path = work / f"request-{rows[0]}-{num_dense}-{batch}-{k}.bin"  # per model shape
        if not path.exists():
            path.write_bytes(PredictClient.request("dlrm", *_request_body(batch, rows, num_dense, k)).SerializeToString())
        files += ["--request", str(path)]
    out = subprocess.run([str(load_binary), "--target", target, "--concurrency", str(concurrency), "--seconds", str(seconds),
                          "--timeout-ms", "30000", *files], capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"recship_load failed: {out.stderr.strip()} {out.stdout.strip()}")
    r = json.loads(out.stdout)
    if r["errors"]:
        raise RuntimeError(f"recship_load saw errors: {r['errors']} ({r['first_error']})")
    return r["rps"] * batch, r["p50_ms"], r["p99_ms"], r["cpu_seconds"] / r["seconds"]


MODELS = {
    # the package default: a forward at batch 1 is cheaper than one gRPC round trip
    "small": dict(rows=1000, dim=16, dense_arch=[64], over_arch=[64, 32]),
    # MLPerf DLRM's MLP and embedding widths (rows cut to keep the export short)
    "mlperf": dict(rows=20_000, dim=128, dense_arch=[512, 256], over_arch=[1024, 1024, 512, 256]),
}


def _forward_ms(model, sparse, dense, in_thread: bool, repeats: int = 50) -> float:
    """Median in-process forward time, on this thread or on a fresh one (as a server's worker runs it)."""
    import torch

    lengths = torch.tensor([len(r) for f in sparse for r in sparse[f]], dtype=torch.int32)
    values = torch.tensor([i for f in sparse for r in sparse[f] for i in r], dtype=torch.int64)
    dense_t = torch.from_numpy(dense)
    times = []

    def run():
        with torch.inference_mode():
            for _ in range(5):
                model(dense_t, lengths, values, None)
            for _ in range(repeats):
                t = time.perf_counter()
                model(dense_t, lengths, values, None)
                times.append((time.perf_counter() - t) * 1e3)

    if in_thread:
        import threading

        th = threading.Thread(target=run)
        th.start()
        th.join()
    else:
        run()
    return statistics.median(times)


def bench_model(name, seconds, work, fronts, load, torch_threads=None, window_ms=2.0, chart=None, row_block=None):
    """Prints the model's tables; adds each served point to ``chart`` (row label -> (examples/s, p50 ms, p99 ms))."""
    import torch

    from recship.export import ExportConfig, export_model
    from recship.export.artifact import open_artifact
    from recship.serving.settings import default_torch_threads
    from recship.serving.server import Server, ServerConfig
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    shape = MODELS[name]
    config = DLRMConfig(num_embeddings_per_feature=[shape["rows"]] * 26, embedding_dim=shape["dim"],
                        dense_arch=shape["dense_arch"] + [shape["dim"]], over_arch=shape["over_arch"])
    torch.manual_seed(0)
    out = work / name / "dlrm" / "1"
    export_model(BuiltinDLRM(config), ExportConfig(out=str(out), dtype="int8", progress=False, validation_batches=1,
                                            **({} if row_block is None else {"row_block": row_block})))
    rows, num_dense = config.num_embeddings_per_feature, config.num_dense
    model, _ = open_artifact(out)  # the file both fronts run: model.pt2 where it runs here, else model.pt
    fmt = getattr(model, "format", "torchscript")
    print(f"\n== {name}: DLRM 26 x {rows[0]} x {config.embedding_dim}, dense {config.dense_arch}, over {config.over_arch}, INT8 "
          f"({fmt}); {seconds:g} s per point; server forward threads {torch_threads or default_torch_threads()}, "
          f"in-process {torch.get_num_threads()}; load generator: {'recship_load (C++)' if load else 'asyncio (Python)'}")
    print(f"{'front':6s} {'batching':8s} {'conc':>4s} {'ex/req':>6s} {'examples/s':>11s} {'p50 ms':>7s} {'p99 ms':>7s} {'gen cores':>9s}")
    results, latency, p50s = {}, {}, {}
    for front in fronts:
        # greedy (the default): no waiting, what queued during a forward runs together; window: the first request of a
        # batch waits window_ms for company; off: one request per forward
        for mode, delay, batching in (("greedy", 0.0, True), ("window", window_ms, True), ("off", 0.0, False)):
            server = Server(ServerConfig(model_repo=str(work / name), port=0, max_delay_ms=delay, batching=batching,
                                         torch_threads=torch_threads, front=front))
            try:
                target = f"127.0.0.1:{server.port}"

                def drive(conc, batch):
                    if load:
                        return _drive_cpp(load, work, target, conc, batch, seconds, rows, num_dense)
                    return _drive_python(target, conc, batch, seconds, rows, num_dense)

                for batch in (1, 64):
                    for conc in (1, 8, 32, 128):
                        tput, p50, p99, cores = drive(conc, batch)
                        results[(front, mode, conc, batch)] = tput
                        latency[(front, mode, conc, batch)] = p50
                        if chart is not None:
                            chart[f"{name} {front} batching {mode}, {conc} x {batch} ex"] = (tput, p50, p99)
                        print(f"{front:6s} {mode:8s} {conc:4d} {batch:6d} {tput:11.0f} {p50:7.2f} {p99:7.2f} {cores:9.2f}")
                if mode == "greedy":
                    p50s[front] = statistics.median(drive(1, 512)[1] for _ in range(3))
            finally:
                server.stop()
    # what batching saves on the model side alone: in-process examples/s of 1-example vs 32-example forwards
    one = _forward_ms(model, *_request_body(1, rows, num_dense, 0), False, repeats=200)
    thirty_two = _forward_ms(model, *_request_body(32, rows, num_dense, 0), False, repeats=200)
    print(f"in-process forward ({fmt}): 1 example {one:.3f} ms, 32 examples {thirty_two:.3f} ms: batching 32 gives the model "
          f"{32 * one / thirty_two:.1f}x the examples/s; the served ratios below are what each request path leaves of it")
    sparse, dense = _request_body(512, rows, num_dense, 0)
    main_ms = statistics.median(_forward_ms(model, sparse, dense, False) for _ in range(3))
    thread_ms = statistics.median(_forward_ms(model, sparse, dense, True) for _ in range(3))
    for front in fronts:
        print(f"[{name} front {front}] low load, 1 client x 1 example: p50 {latency[(front, 'greedy', 1, 1)]:.2f} ms with the default "
              f"(greedy) vs {latency[(front, 'window', 1, 1)]:.2f} ms with a {window_ms:g} ms window = "
              f"{latency[(front, 'greedy', 1, 1)] / latency[(front, 'window', 1, 1)]:.2f}x")
        for mode, what in (("greedy", "the default, greedy"), ("window", f"{window_ms:g} ms window")):
            ratio = results[(front, mode, 32, 1)] / results[(front, "off", 32, 1)]
            print(f"[{name} front {front}] batching ({what}) vs off, 32 clients x 1 example: {ratio:.2f}x the examples/s (target >= 5x)")
        print(f"[{name} front {front}] 512-example requests: p50 {p50s[front]:.2f} ms end to end (median of 3 runs) vs in-process "
              f"forward {main_ms:.2f} ms on the main thread = {p50s[front] / main_ms:.2f}x (target <= 1.3x); "
              f"vs {thread_ms:.2f} ms on a worker thread = {p50s[front] / thread_ms:.2f}x")
    if len(fronts) == 2:
        for conc in (1, 32, 128):
            r = results[("cpp", "greedy", conc, 1)] / results[("python", "greedy", conc, 1)]
            print(f"[{name}] cpp front vs python front, default batching, {conc} clients x 1 example: {r:.2f}x the examples/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--row-block", type=int, help="the artifact's row_block (recship export --row-block; default: export's)")
    parser.add_argument("--model", choices=sorted(MODELS) + ["all"], default="all")
    parser.add_argument("--front", choices=["python", "cpp", "both"], default="both")
    parser.add_argument("--load", choices=["cpp", "python"], default="cpp", help="load generator (default: recship_load, C++)")
    parser.add_argument("--max-delay-ms", type=float, default=2.0, help="the batching window of 'window' (default 2 ms; the server's default is 0, greedy)")
    parser.add_argument("--torch-threads", type=int, help="the server's intra-op threads per forward (default: its own)")
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args()
    import logging

    logging.getLogger("recship").setLevel(logging.ERROR)  # the generator cancels its last calls: one warning each
    fronts = ["python", "cpp"] if args.front == "both" else [args.front]
    load = None
    if args.load == "cpp":  # the installed one (the wheel's recship/_cpp/bin), else built in a source checkout
        from recship.native import find

        load = find("recship_load")
    work = Path(tempfile.mkdtemp(prefix="recship-serve-bench-"))
    chart = {}
    for name in sorted(MODELS) if args.model == "all" else [args.model]:
        bench_model(name, args.seconds, work, fronts, load, args.torch_threads, args.max_delay_ms, chart, args.row_block)
    from recship.plots import write_bench_chart

    write_bench_chart(args.plot, f"serving over loopback gRPC, {args.seconds:g} s per point", list(chart),
                      {"examples/s": {"examples/s": [c[0] for c in chart.values()]},
                       "ms": {"p50": [c[1] for c in chart.values()], "p99": [c[2] for c in chart.values()]}})


if __name__ == "__main__":
    main()
