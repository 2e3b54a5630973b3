"""Which HTTP framework for the KServe REST front: requests/s of a minimal JSON handler.

    python bench/http_front_bench.py [--seconds 5] [--connections 32] [--plot PNG]

Each candidate serves GET /v2/health/live and POST /infer (parses a ~2 KB JSON body,
answers JSON) on loopback; `wrk` (Debian package) drives it from another process.
Candidates: the standard library's ThreadingHTTPServer (recship's first REST front),
aiohttp on an asyncio loop (what recship uses), and uvicorn + starlette when installed
(`pip install uvicorn starlette`; not recship dependencies).
"""

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLOT = Path(__file__).resolve().parent / "out" / "http_front_bench.png"
BODY = json.dumps({"inputs": [{"name": f"cat_{i}.values", "shape": [4], "datatype": "INT64", "data": [1, 2, 3, 4]} for i in range(26)]})


def _answer(body: bytes) -> bytes:
    doc = json.loads(body)
    return json.dumps({"outputs": [{"name": "prob", "shape": [1, 1], "data": [len(doc["inputs"]) / 100]}]}).encode()


def stdlib(port: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(b'{"live": true}')

        def do_POST(self):
            self._send(_answer(self.rfile.read(int(self.headers["Content-Length"]))))

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()


def aiohttp_front(port: int) -> None:
    from aiohttp import web

    async def live(request):
        return web.Response(body=b'{"live": true}', content_type="application/json")

    async def infer(request):
        return web.Response(body=_answer(await request.read()), content_type="application/json")

    app = web.Application()
    app.router.add_get("/v2/health/live", live)
    app.router.add_post("/infer", infer)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def starlette_front(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def live(request):
        return Response(b'{"live": true}', media_type="application/json")

    async def infer(request):
        return Response(_answer(await request.body()), media_type="application/json")

    app = Starlette(routes=[Route("/v2/health/live", live), Route("/infer", infer, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(port: int) -> None:
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("front did not start")


def _wrk(port: int, path: str, seconds: float, connections: int, script: str = "") -> float:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{int(seconds)}s", f"http://127.0.0.1:{port}{path}"] + (["-s", script] if script else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--plot", default=str(PLOT), metavar="PNG", help=f"the chart of the results (default bench/out/{PLOT.name}; '' for none)")
    args = p.parse_args()
    if shutil.which("wrk") is None:
        print("needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    fronts = {"stdlib ThreadingHTTPServer": stdlib, "aiohttp": aiohttp_front}
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        fronts["uvicorn + starlette"] = starlette_front
    except ImportError:
        print("(uvicorn/starlette not installed: skipped)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\nwrk.headers["Content-Type"] = "application/json"\n')
        post = f.name
    print(f"{'front':28s} {'GET live req/s':>15s} {'POST infer req/s':>17s}   ({args.connections} connections, wrk 1 thread, {os.cpu_count()} cores)")
    results = {}
    for name, target in fronts.items():
        port = _free_port()
        proc = mp.Process(target=target, args=(port,), daemon=True)
        proc.start()
        try:
            _wait(port)
            get = _wrk(port, "/v2/health/live", args.seconds, args.connections)
            infer = _wrk(port, "/infer", args.seconds, args.connections, post)
            print(f"{name:28s} {get:15,.0f} {infer:17,.0f}")
            results[name] = (get, infer)
        finally:
            proc.terminate()
            proc.join()
    os.unlink(post)
    from recship.plots import write_bench_chart

    write_bench_chart(args.plot, f"KServe REST front candidates ({args.connections} connections)", list(results),
                      {"requests/s": {"GET /v2/health/live": [r[0] for r in results.values()],
                                      "POST /infer": [r[1] for r in results.values()]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
