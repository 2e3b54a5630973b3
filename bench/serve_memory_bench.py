"""Server memory under load and under huge requests: RSS of a `recship serve` process.

    .venv/bin/python bench/serve_memory_bench.py [--seconds 10] [--huge-mb 56] [--huge-clients 16] [--plot PNG]

Exports a small INT8 DLRM, starts `recship serve` in its own process, and reads its
VmRSS / VmHWM from /proc: after start; after a 64-client load (asyncio clients in this
process, mixed 1- and 64-example requests, some KServe REST) for --seconds; then after
--huge-clients concurrent requests of --huge-mb each (past --max-inflight-mb, which is
left at its default of 256 MB, they must be refused with RESOURCE_EXHAUSTED).
"""

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

PLOT = Path(__file__).resolve().parent / "out" / "serve_memory_bench.png"


def _status(pid: int):
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def _request(batch, rows, seed):
    g = np.random.default_rng(seed)
    sparse = {f"cat_{i}": [list(map(int, g.integers(0, r, size=2))) for _ in range(batch)] for i, r in enumerate(rows)}
    return sparse, g.random((batch, 13), dtype=np.float32)


async def _status_of(call) -> str:
    """The gRPC status name a call ends with."""
    import grpc

    try:
        await call
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


async def _load(port: int, http_port: int, rows, seconds: float):
    import grpc

    from recship.serving import PredictClient

    counts = {}
    stop_at = time.monotonic() + seconds
    body = {}

    async def grpc_client(k, channel):
        stub = channel.unary_unary("/recship.serving.v1.Predictor/Predict", request_serializer=None, response_deserializer=None)
        data = PredictClient.request("dlrm", *_request(64 if k % 8 == 0 else 1, rows, k)).SerializeToString()
        while time.monotonic() < stop_at:
            code = await _status_of(stub(data, timeout=30))
            counts[code] = counts.get(code, 0) + 1

    def rest_call(k):
        sparse, dense = _request(1, rows, k)
        inputs = [{"name": "dense", "shape": [1, 13], "datatype": "FP32", "data": dense.reshape(-1).tolist()}]
        for f, r in sparse.items():
            inputs += [{"name": f"{f}.lengths", "shape": [1], "datatype": "INT32", "data": [len(r[0])]},
                       {"name": f"{f}.values", "shape": [len(r[0])], "datatype": "INT64", "data": r[0]}]
        data = json.dumps({"inputs": inputs}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/dlrm/infer", data=data, method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status

    async def rest_client(k):
        loop = asyncio.get_running_loop()
        while time.monotonic() < stop_at:
            status = await loop.run_in_executor(None, rest_call, k)
            body[status] = body.get(status, 0) + 1

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(8)]
    await asyncio.gather(*(grpc_client(k, channels[k % 8]) for k in range(60)), *(rest_client(k) for k in range(4)))
    for c in channels:
        await c.close()
    return counts, body


async def _huge(port: int, mb: float, clients: int):
    import grpc

    from recship.serving import PredictClient

    # one feature's ids carry the bulk: ~mb MB of sfixed64 ids in a single 512-example request
    rows = [20 + i for i in range(26)]
    sparse, dense = _request(512, rows, 0)
    per_example = int(mb * 1024 * 1024 / 8 / 512)
    sparse["cat_25"] = [[1] * per_example for _ in range(512)]
    data = PredictClient.request("dlrm", sparse, dense).SerializeToString()
    codes = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        stub = channel.unary_unary("/recship.serving.v1.Predictor/Predict", request_serializer=None, response_deserializer=None)

        async def one():
            code = await _status_of(stub(data, timeout=120))
            codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(one() for _ in range(clients)))
    return len(data), codes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--huge-mb", type=float, default=56)
    parser.add_argument("--huge-clients", type=int, default=16)
    parser.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = parser.parse_args()

    import torch

    from recship.export import ExportConfig, export_model
    from recship.plots import write_bench_chart
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    rows = [20 + i for i in range(26)]
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=rows, embedding_dim=8, dense_arch=[16], over_arch=[16]))
        export_model(model, ExportConfig(out=f"{tmp}/repo/dlrm/1", dtype="int8", progress=False, validation_batches=1))
        server = subprocess.Popen(
            [sys.executable, "-m", "recship.cli", "serve", "--model-repo", f"{tmp}/repo", "--port", "0", "--http-port", "0",
             "--log-format", "text"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        try:
            line = server.stdout.readline()
            while not line.startswith("recship serve: listening on"):
                if not line:
                    raise RuntimeError("the server exited")
                line = server.stdout.readline()
            port = int(line.split("listening on ")[1].split(",")[0].rsplit(":", 1)[1])
            http_port = int(line.rsplit(":", 1)[1])
            rss0, _ = _status(server.pid)
            print(f"server RSS after start: {rss0:,.0f} MB")
            counts, rest = asyncio.run(_load(port, http_port, rows, args.seconds))
            rss1, hwm1 = _status(server.pid)
            print(f"64 clients for {args.seconds:g} s: gRPC {counts}, REST {rest}")
            print(f"server RSS after the load: {rss1:,.0f} MB (x{rss1 / rss0:.2f} of start), peak {hwm1:,.0f} MB")
            size, codes = asyncio.run(_huge(port, args.huge_mb, args.huge_clients))
            time.sleep(1)
            rss2, hwm2 = _status(server.pid)
            print(f"{args.huge_clients} concurrent requests of {size / 2**20:.1f} MiB: {codes}")
            print(f"server RSS after them: {rss2:,.0f} MB, peak {hwm2:,.0f} MB")
            write_bench_chart(args.plot, "recship serve memory", ["after start", f"after 64 clients for {args.seconds:g} s",
                                                                   f"after {args.huge_clients} x {size / 2**20:.0f} MiB requests"],
                              {"MB": {"RSS": [rss0, rss1, rss2], "peak RSS so far": [float("nan"), hwm1, hwm2]}})
        finally:
            server.send_signal(signal.SIGTERM)
            print(f"SIGTERM: exit code {server.wait(timeout=60)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
