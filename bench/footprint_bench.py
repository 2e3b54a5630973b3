"""What an artifact costs, as multiples of its table bytes: export, disk, served memory, ready time, reloads, C++.

    .venv/bin/python bench/footprint_bench.py [--tables 26 --rows 100000 --dim 64] [--dtype int8]
                                              [--format both|torchscript] [--reloads 5] [--workdir DIR]
                                              [--python OTHER/.venv/bin/python]   # another checkout: "before"
    .venv/bin/python bench/footprint_bench.py --rows 1000000      # issue 27: 26 x 1M x 64, 6.6 GB float

Everything runs in child processes of the chosen interpreter (``--python``: the recship that
interpreter imports, so two checkouts measure side by side). It builds a DLRM of float tables,
exports it into a model repository (wall time, GB/s of float input, peak RSS), then reads:
the version folder's bytes on disk; the RSS and PSS that ``recship serve`` adds over the same
server with an empty repository, with model.pt2 (default), ``--model-format torchscript`` and
``--front cpp`` (server + front, summed), and two servers on one host; the time from
``recship serve`` starting to the model answering ready; the server's RSS after --reloads hot
reloads (each new version a copy of the export, the replaced folder removed; in the new layout
these share their tables' pages with the version they replace once their own file verified, in
the old one they cannot); a second version with equal tables beside the first (its tables.bin
hard-linked to the first's, as an export whose tables did not change leaves it); and ``recship_predict``'s peak RSS (VmHWM) over its
own with the smallest artifact. "table bytes" are the quantized rows (the sum of the features'
rows x row bytes). PSS (/proc/PID/smaps_rollup) counts a page shared by k processes as 1/k:
the honest sum for several processes mapping one file.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

BUILD = """
import json, sys, time, torch
from recship.trainer.dlrm import DLRM, DLRMConfig
tables, rows, dim, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = DLRM(DLRMConfig(num_embeddings_per_feature=[rows] * tables, embedding_dim=dim, dense_arch=[64, dim], over_arch=[64, 1]))
torch.save(model, out)
"""
EXPORT = """
import json, sys, time, torch
from recship.export import ExportConfig, export_model
model_file, repo, dtype, fmt = sys.argv[1:5]
model = torch.load(model_file, weights_only=False)
start = time.perf_counter()
export_model(model, ExportConfig(repo=repo, model_name="dlrm", dtype=dtype, progress=False, validation_batches=1, format=fmt))
seconds = time.perf_counter() - start
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "hwm": hwm}))
"""


def _kib(pid: int, key: str, file: str = "status") -> int:
    for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _tree(pid: int) -> List[int]:
    try:  # children of every thread: the C++ front is not started by the main thread
        kids = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    except OSError:
        return [pid]
    return [pid] + [p for k in kids for p in _tree(k)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int, path: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


class Served:
    """A `recship serve` process on ``repo``; ``memory()`` -> (RSS MiB, PSS MiB) of it and its children."""

    def __init__(self, python: str, repo: Path, *flags: str, wait_for: Optional[str] = "/v2/models/dlrm/ready") -> None:
        self.http = _free_port()
        self.log = tempfile.TemporaryFile("w+")  # the server's log, for the error if it exits
        recship = str(Path(python).parent / "recship")
        self.start = time.perf_counter()
        self.proc = subprocess.Popen([recship, "serve", "--model-repo", str(repo), "--port", str(_free_port()),
                                      "--http-port", str(self.http), "--poll-interval", "0.2", *flags],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        self.ready_s = self.wait(wait_for or "/v2/health/live")

    def wait(self, path: str, timeout: float = 600) -> float:
        end = time.monotonic() + timeout
        while not _ready(self.http, path):
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"recship serve exited waiting for {path}: {self.log.read()[-2000:]}")
            if time.monotonic() > end:
                raise RuntimeError(f"recship serve timed out waiting for {path}")
            time.sleep(0.1)
        return time.perf_counter() - self.start

    def memory(self):
        time.sleep(1.0)
        pids = _tree(self.proc.pid)
        return (sum(_kib(p, "VmRSS") for p in pids) / 1024, sum(_kib(p, "Pss", "smaps_rollup") for p in pids) / 1024)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _copy_version(src: Path, model_dir: Path, version: int, link_tables: bool = False) -> None:
    """``src`` as version ``version``; ``link_tables``: its tables.bin hard-linked, as an export whose
    tables did not change leaves it (the old layout has no tables.bin: a plain copy)."""
    tmp = model_dir / f".tmp-{version}"
    linked = link_tables and (src / "tables.bin").exists()
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("tables.bin") if linked else None)
    if linked:
        os.link(src / "tables.bin", tmp / "tables.bin")
    manifest = json.loads((tmp / "manifest.json").read_text())
    manifest["model"]["version"] = version
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    os.rename(tmp, model_dir / str(version))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--format", default="both", choices=["both", "torchscript"])
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose recship is measured (default: this one)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="footprint-"))
    work.mkdir(parents=True, exist_ok=True)
    py = args.python
    env = {**os.environ, "RECSHIP_AOTI": "1"}
    figures: Dict[str, float] = {}
    try:
        model_file = work / "model.torch"
        subprocess.run([py, "-c", BUILD, str(args.tables), str(args.rows), str(args.dim), str(model_file)], check=True, env=env)
        float_bytes = args.tables * args.rows * args.dim * 4
        repo = work / "repo"
        shutil.rmtree(repo, ignore_errors=True)
        out = subprocess.run([py, "-c", EXPORT, str(model_file), str(repo), args.dtype, args.format], check=True, env=env,
                             capture_output=True, text=True)
        exported = json.loads(out.stdout.strip().splitlines()[-1])
        art = repo / "dlrm" / "1"
        manifest = json.loads((art / "manifest.json").read_text())
        table_bytes = sum(_row_bytes(f["dim"], f["weight_type"]) * f["rows"] for f in manifest["sparse_features"])
        mib = table_bytes / 2**20
        figures.update(float_gb=float_bytes / 1e9, table_mib=mib, export_gb_s=float_bytes / 1e9 / exported["seconds"],
                       export_peak_x_float=exported["hwm"] / float_bytes)
        disk = sum(f.stat().st_size for f in art.rglob("*") if f.is_file())
        figures["disk_x"] = disk / table_bytes
        shutil.copytree(art, work / "export")  # the pristine export, for the copies below
        empty = work / "empty"
        (empty / "dlrm").mkdir(parents=True, exist_ok=True)
        base = Served(py, empty, wait_for=None)
        base_rss, base_pss = base.memory()
        base.stop()
        configs = {"default": [], "torchscript": ["--model-format", "torchscript"], "front_cpp": ["--front", "cpp"]}
        for name, flags in configs.items():
            s = Served(py, repo, *flags)
            rss, pss = s.memory()
            if name == "front_cpp":
                front = Served(py, empty, "--front", "cpp", wait_for=None)
                base_rss_cpp, base_pss_cpp = front.memory()
                front.stop()
                rss, pss = rss - base_rss_cpp, pss - base_pss_cpp
            else:
                rss, pss = rss - base_rss, pss - base_pss
            figures[f"served_rss_x_{name}"] = rss / mib
            figures[f"served_pss_x_{name}"] = pss / mib
            if name == "default":
                figures["ready_s"] = s.ready_s
                figures["ready_limit_s"] = 3 + 2 * table_bytes / 1e9
                second = Served(py, repo)  # two servers on one host, one repository
                rss2, pss2 = second.memory()
                r1, p1 = s.memory()
                figures["two_servers_rss_x"] = (r1 + rss2 - 2 * base_rss) / mib
                figures["two_servers_pss_x"] = (p1 + pss2 - 2 * base_pss) / mib
                second.stop()
                # a second version beside the first (policy: serve the two newest): equal tables
                (repo / "dlrm" / "config.yaml").write_text("version_policy: {latest: {num_versions: 2}}\n")
                before = s.memory()[0]
                t = time.perf_counter()
                _copy_version(repo / "dlrm" / "1", repo / "dlrm", 2, link_tables=True)  # as an unchanged export leaves it
                s.wait("/v2/models/dlrm/versions/2/ready")
                figures["equal_tables_second_version_s"] = time.perf_counter() - t
                figures["equal_tables_second_version_rss_x"] = (s.memory()[0] - before) / mib
                (repo / "dlrm" / "config.yaml").unlink()
                shutil.rmtree(repo / "dlrm" / "1")
                s.wait("/v2/models/dlrm/versions/2/ready")
                after_first = s.memory()[0]
                for version in range(3, 3 + args.reloads):
                    _copy_version(work / "export", repo / "dlrm", version)
                    s.wait(f"/v2/models/dlrm/versions/{version}/ready")
                    while _ready(s.http, f"/v2/models/dlrm/versions/{version - 1}/ready"):
                        time.sleep(0.1)
                    shutil.rmtree(repo / "dlrm" / str(version - 1))
                figures["reloads_rss_growth_x"] = (s.memory()[0] - after_first) / mib
                # put version 1 back for the next configurations
                for v in list((repo / "dlrm").iterdir()):
                    shutil.rmtree(v)
                s.stop()
                _copy_version(work / "export", repo / "dlrm", 1)
                continue
            s.stop()
        figures.update(_cpp_predict(py, work / "export", empty, mib))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    for k, v in figures.items():
        print(f"{k:40s} {v:10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


def _row_bytes(dim: int, weight_type: str) -> int:
    bits = {"INT2": 2, "INT4": 4, "INT8": 8, "FP8": 8, "FP16": 16, "FP32": 32}[weight_type]
    return dim * bits // 8 + (4 if weight_type in ("INT2", "INT4", "INT8") else 0)


def _cpp_predict(py: str, art: Path, empty: Path, mib: float) -> Dict[str, float]:
    """recship_predict's peak RSS on the artifact, over its peak on the smallest artifact it can load."""
    root = subprocess.run([py, "-c", "import recship, pathlib; print(pathlib.Path(recship.__file__).resolve().parents[1])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    binary = next((p for p in Path(root, "build").rglob("recship_predict") if p.is_file() and os.access(p, os.X_OK)), None)
    if binary is None:
        print("recship_predict not built (pytest tests/cpp_loader builds it): skipped", file=sys.stderr)
        return {}
    def hwm(path: Path) -> Optional[int]:
        out = subprocess.run(["/usr/bin/time", "-f", "%M", str(binary), str(path)], capture_output=True, text=True)
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        return int(last) if last.isdigit() and out.returncode == 0 else None
    big = hwm(art)
    return {"cpp_predict_peak_mib": big / 1024} if big is not None else {}


if __name__ == "__main__":
    sys.exit(main())
