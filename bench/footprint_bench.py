"""What an artifact costs, as multiples of its table bytes: export, disk, served memory, ready time, reloads, C++.

    .venv/bin/python bench/footprint_bench.py [--tables 26 --rows 100000 --dim 64] [--dtype int8]
                                              [--format both|torchscript] [--reloads 5] [--workdir DIR]
                                              [--python OTHER/.venv/bin/python]   # another checkout: "before"
    .venv/bin/python bench/footprint_bench.py --rows 1000000      # real size: 26 x 1M x 64, 6.6 GB float
    .venv/bin/python bench/footprint_bench.py --model two_tower --rows 50000000 --dim 32   # real size: 50M x 32, 6.4 GB float

Everything runs in child processes of the chosen interpreter (``--python``: the recship that
interpreter imports, so two checkouts measure side by side). It builds a model of float tables,
exports it into a model repository (wall time, GB/s of float input, peak RSS), then reads:
the version folder's bytes on disk; the RSS and PSS that ``recship serve`` adds over the same
server with an empty repository, with model.pt2 (default), ``--model-format torchscript`` and
``--front cpp`` (server + front, summed), and two servers on one host; the time from
``recship serve`` starting to the model answering ready; the server's RSS after --reloads hot
reloads (each new version a copy of the export, the replaced folder removed; in the new layout
these share their tables' pages with the version they replace once their own file verified, in
the old one they cannot); a second version with equal tables beside the first (its tables.bin
hard-linked to the first's, as an export whose tables did not change leaves it); and ``recship_predict``'s peak RSS (VmHWM) over its
own with a small artifact of the same model (--rows 1000). "table bytes" are the quantized rows
(the sum of the features' rows x row bytes). Per model, for each configuration: what each of --models
models adds to a server serving one, in PSS (but for the pages of tables.bin files) and threads, every
model having answered requests of 1, 64 and 512 examples (copies of the export whose equal tables are
shared: what a model costs besides them).

``--model dlrm`` (default): --tables tables of --rows x --dim, saved with torch.save and exported
from the loaded module in a second child. ``--model two_tower`` (recship.models:TwoTower, --tables
not used): about --rows rows of --dim in all, 40% users and 30% items for each of its two item
tables (history, an unpooled EmbeddingCollection, and item_ids), plus 50 countries and 100
categories of --dim/2; built and exported from memory in one child, without a save (export_model
deep-copies a module it is given, so that child's peak holds the float tables twice).

PSS (/proc/PID/smaps_rollup) counts a page shared by k processes as 1/k: the honest sum for
several processes mapping one file.
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

BUILD = """  # DLRM: build and torch.save
import json, sys, time, torch
from recship.models.dlrm import BuiltinDLRM, DLRMConfig
tables, rows, dim, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
model = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[rows] * tables, embedding_dim=dim, dense_arch=[64, dim], over_arch=[64, 1]))
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
TWO_TOWER = """  # build a TwoTower and export it from memory (no save: that would be a third copy of the tables)
import json, sys, time, torch
from recship.export import ExportConfig, export_model
from recship.models import TwoTower
rows, dim, repo, dtype, fmt, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
torch.manual_seed(0)
users = round(rows * 0.4)
model = TwoTower(num_users=users, num_items=(rows - users) // 2, dim=dim)
float_bytes = sum(p.numel() * p.element_size() for m in (model.user_tables, model.history, model.item_tables) for p in m.parameters())
built = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
start = time.perf_counter()
export_model(model, ExportConfig(repo=repo, model_name=name, dtype=dtype, progress=False, validation_batches=1, format=fmt))
seconds = time.perf_counter() - start
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "hwm": hwm, "float_bytes": float_bytes, "built_rss": built}))
"""
TRAFFIC = """  # each model answers requests of 1, 64 and 512 examples: its forwards' costs count
import json, sys
import numpy as np
from recship.serving.client import PredictClient
port, names, manifest = int(sys.argv[1]), sys.argv[2].split(","), json.load(open(sys.argv[3]))
g = np.random.default_rng(0)
with PredictClient(f"127.0.0.1:{port}", timeout=300) as client:
    for name in names:
        for batch in (1, 64, 512):
            sparse = {f["name"]: [[int(i)] for i in g.integers(0, f["rows"], batch)] for f in manifest["sparse_features"]}
            weights = {f["name"]: [[1.0]] * batch for f in manifest["sparse_features"] if f.get("weighted")} or None
            dense = g.random((batch, manifest["num_dense"]), dtype=np.float32) if manifest["num_dense"] else None
            client.predict(name, sparse, dense=dense, weights=weights)
"""
MODEL_NAMES = {"dlrm": "dlrm", "two_tower": "two_tower"}  # --model -> the name it is exported and served under


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

    def __init__(self, python: str, repo: Path, *flags: str, wait_for: Optional[str]) -> None:
        self.http, self.port = _free_port(), _free_port()
        self.log = tempfile.TemporaryFile("w+")  # the server's log, for the error if it exits
        recship = str(Path(python).parent / "recship")
        self.start = time.perf_counter()
        self.proc = subprocess.Popen([recship, "serve", "--model-repo", str(repo), "--port", str(self.port),
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

    def pss_besides_tables(self) -> float:
        """PSS MiB of it and its children but for their mappings of tables.bin files (whose pages are resident as the
        kernel and the requests' ids decide: the per-model figures leave them out)."""
        kib = 0
        for p in _tree(self.proc.pid):
            tables = False
            for line in Path(f"/proc/{p}/smaps").read_text().splitlines():
                if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    tables = line.rstrip().removesuffix(" (deleted)").endswith("/tables.bin")
                elif line.startswith("Pss:") and not tables:
                    kib += int(line.split()[1])
        return kib / 1024

    def threads(self) -> int:
        """Threads named as their process (Python's, OpenMP's, the front's own; not gRPC's pools)."""
        pids = _tree(self.proc.pid)
        return sum(Path(f"/proc/{p}/task/{t}/comm").read_text() == Path(f"/proc/{p}/comm").read_text()
                   for p in pids for t in os.listdir(f"/proc/{p}/task"))

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
    parser.add_argument("--model", default="dlrm", choices=sorted(MODEL_NAMES), help="dlrm (default) or two_tower")
    parser.add_argument("--tables", type=int, default=26, help="the DLRM's tables (not used by two_tower)")
    parser.add_argument("--rows", type=int, default=100_000, help="each DLRM table's rows; two_tower: the rows of all its tables")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--format", default="both", choices=["both", "torchscript"])
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--models", type=int, default=5, help="models served at once for the per-model figures")
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose recship is measured (default: this one)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="footprint-"))
    work.mkdir(parents=True, exist_ok=True)
    py = args.python
    env = {**os.environ, "RECSHIP_AOTI": "1"}
    name = MODEL_NAMES[args.model]
    figures: Dict[str, float] = {}
    try:
        repo = work / "repo"
        t = time.perf_counter()
        exported = _export(py, args.model, args.tables, args.rows, args.dim, args.dtype, args.format, work, repo, env)
        print(f"built and exported in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        float_bytes = exported["float_bytes"]
        art = repo / name / "1"
        manifest = json.loads((art / "manifest.json").read_text())
        table_bytes = sum(_row_bytes(f["dim"], f["weight_type"]) * f["rows"] for f in manifest["sparse_features"])
        mib = table_bytes / 2**20
        figures.update(float_gb=float_bytes / 1e9, table_mib=mib, export_s=exported["seconds"],
                       export_gb_s=float_bytes / 1e9 / exported["seconds"], export_peak_mib=exported["hwm"] / 2**20,
                       export_peak_x_float=exported["hwm"] / float_bytes)
        if "built_rss" in exported:  # the built float model, before export_model: what the export added is the rest
            figures["built_model_rss_mib"] = exported["built_rss"] / 2**20
        disk = sum(f.stat().st_size for f in art.rglob("*") if f.is_file())
        figures["disk_mib"] = disk / 2**20
        figures["disk_x"] = disk / table_bytes
        shutil.copytree(art, work / "export")  # the pristine export, for the copies below
        empty = work / "empty"
        (empty / name).mkdir(parents=True, exist_ok=True)
        base = Served(py, empty, wait_for=None)
        base_rss, base_pss = base.memory()
        base.stop()
        configs = {"default": [], "torchscript": ["--model-format", "torchscript"], "front_cpp": ["--front", "cpp"]}
        for config, flags in configs.items():
            s = Served(py, repo, *flags, wait_for=f"/v2/models/{name}/ready")
            rss, pss = s.memory()
            if config == "front_cpp":
                front = Served(py, empty, "--front", "cpp", wait_for=None)
                base_rss_cpp, base_pss_cpp = front.memory()
                front.stop()
                rss, pss = rss - base_rss_cpp, pss - base_pss_cpp
            else:
                rss, pss = rss - base_rss, pss - base_pss
            figures[f"served_rss_x_{config}"] = rss / mib
            figures[f"served_pss_x_{config}"] = pss / mib
            if config == "default":
                figures["ready_s"] = s.ready_s
                figures["ready_limit_s"] = 3 + 2 * table_bytes / 1e9
                second = Served(py, repo, wait_for=f"/v2/models/{name}/ready")  # two servers on one host, one repository
                rss2, pss2 = second.memory()
                r1, p1 = s.memory()
                figures["two_servers_rss_x"] = (r1 + rss2 - 2 * base_rss) / mib
                figures["two_servers_pss_x"] = (p1 + pss2 - 2 * base_pss) / mib
                second.stop()
                # a second version beside the first (policy: serve the two newest): equal tables
                (repo / name / "config.yaml").write_text("version_policy: {latest: {num_versions: 2}}\n")
                before = s.memory()[0]
                t = time.perf_counter()
                _copy_version(repo / name / "1", repo / name, 2, link_tables=True)  # as an unchanged export leaves it
                s.wait(f"/v2/models/{name}/versions/2/ready")
                figures["equal_tables_second_version_s"] = time.perf_counter() - t
                figures["equal_tables_second_version_rss_x"] = (s.memory()[0] - before) / mib
                (repo / name / "config.yaml").unlink()
                shutil.rmtree(repo / name / "1")
                s.wait(f"/v2/models/{name}/versions/2/ready")
                after_first = s.memory()[0]
                for version in range(3, 3 + args.reloads):
                    _copy_version(work / "export", repo / name, version)
                    s.wait(f"/v2/models/{name}/versions/{version}/ready")
                    while _ready(s.http, f"/v2/models/{name}/versions/{version - 1}/ready"):
                        time.sleep(0.1)
                    shutil.rmtree(repo / name / str(version - 1))
                figures["reloads_rss_growth_x"] = (s.memory()[0] - after_first) / mib
                # put version 1 back for the next configurations
                for v in list((repo / name).iterdir()):
                    shutil.rmtree(v)
                s.stop()
                _copy_version(work / "export", repo / name, 1)
                continue
            s.stop()
        for config, flags in configs.items():
            figures.update(_per_model(py, work, name, config, flags, args.models, env))
        small = work / "small"  # recship_predict's own footprint: the same model with 1000 rows (DLRM: per table)
        shutil.rmtree(small, ignore_errors=True)
        _export(py, args.model, args.tables, 1000, args.dim, args.dtype, args.format, work, small, env)
        figures.update(_cpp_predict(py, work / "export", small / name / "1", mib))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    for k, v in figures.items():
        print(f"{k:40s} {v:10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


def _per_model(py: str, work: Path, name: str, config: str, flags: List[str], models: int, env: Dict[str, str]) -> Dict[str, float]:
    """What each of ``models`` - 1 more models costs a server serving one (PSS MiB but for tables.bin's pages, threads),
    every model having answered requests of 1, 64 and 512 examples: copies of the export under other names, moved in
    while it serves, their tables.bin hard-linked (equal tables are shared: what a copy adds is what a model costs
    besides them)."""
    repo, staged = work / "models", work / "staged"
    shutil.rmtree(repo, ignore_errors=True)
    shutil.rmtree(staged, ignore_errors=True)
    names = [name] + [f"{name}_{i}" for i in range(2, models + 1)]
    for n in names:
        shutil.copytree(work / "export", staged / n / "1", ignore=shutil.ignore_patterns("tables.bin"))
        os.link(work / "export" / "tables.bin", staged / n / "1" / "tables.bin")
    repo.mkdir()
    os.rename(staged / name, repo / name)
    manifest = str(work / "export" / "manifest.json")
    s = Served(py, repo, *flags, wait_for=f"/v2/models/{name}/ready")
    try:
        _child([py, "-c", TRAFFIC, str(s.port), name, manifest], env)
        time.sleep(1.0)
        one_pss, one_threads = s.pss_besides_tables(), s.threads()
        for n in names[1:]:
            os.rename(staged / n, repo / n)
        for n in names[1:]:
            s.wait(f"/v2/models/{n}/ready")
        _child([py, "-c", TRAFFIC, str(s.port), ",".join(names), manifest], env)
        more = len(names) - 1
        time.sleep(1.0)
        return {f"per_model_pss_mib_{config}": (s.pss_besides_tables() - one_pss) / more,
                f"per_model_threads_{config}": (s.threads() - one_threads) / more}
    finally:
        s.stop()
        shutil.rmtree(repo, ignore_errors=True)


def _export(py: str, model: str, tables: int, rows: int, dim: int, dtype: str, fmt: str, work: Path, repo: Path,
            env: Dict[str, str]) -> Dict[str, int]:
    """Builds the model and exports it as ``repo/<name>/1`` in child processes of ``py``; returns the export's
    {seconds, hwm (peak RSS of the exporting process, bytes), float_bytes (the float tables), built_rss (two_tower)}."""
    shutil.rmtree(repo, ignore_errors=True)
    if model == "dlrm":
        model_file = work / "model.torch"
        _child([py, "-c", BUILD, str(tables), str(rows), str(dim), str(model_file)], env)
        out = _child([py, "-c", EXPORT, str(model_file), str(repo), dtype, fmt], env)
        model_file.unlink()
        return {**out, "float_bytes": tables * rows * dim * 4}
    return _child([py, "-c", TWO_TOWER, str(rows), str(dim), str(repo), dtype, fmt, MODEL_NAMES[model]], env)


def _child(cmd: List[str], env: Dict[str, str]) -> Dict[str, int]:
    """Runs ``cmd``; its last line of stdout as JSON ({} if it prints none); its stderr in the error if it fails."""
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:2]} exited {out.returncode}: {out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _row_bytes(dim: int, weight_type: str) -> int:
    bits = {"INT2": 2, "INT4": 4, "INT8": 8, "FP8": 8, "FP16": 16, "FP32": 32}[weight_type]
    return dim * bits // 8 + (4 if weight_type in ("INT2", "INT4", "INT8") else 0)


def _cpp_predict(py: str, art: Path, small: Path, mib: float) -> Dict[str, float]:
    """recship_predict's peak RSS on the artifact, and that over its peak on ``small`` (the same model, few rows)."""
    # that Python's recship_predict: installed with it, else built in its source checkout (the release build)
    found = subprocess.run([py, "-c", "import json, recship.native as n; print(json.dumps([str(n.find('recship_predict')), n.runtime_env()]))"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        print(f"recship_predict not found: {found.stderr.strip()[-500:]}: skipped", file=sys.stderr)
        return {}
    where, env = json.loads(found.stdout.splitlines()[-1])
    binary = Path(where)
    def hwm(path: Path) -> Optional[int]:
        out = subprocess.run(["/usr/bin/time", "-f", "%M", str(binary), str(path)], capture_output=True, text=True, env=env)
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        if last.isdigit() and out.returncode == 0:
            return int(last)
        print(f"recship_predict {path} exited {out.returncode}: {out.stderr[-1500:]}", file=sys.stderr)
        return None
    big, base = hwm(art), hwm(small)
    if big is None:
        return {}
    figures = {"cpp_predict_peak_mib": big / 1024, "cpp_predict_peak_x": big / 1024 / mib}
    if base is not None:
        figures.update(cpp_predict_small_peak_mib=base / 1024, cpp_predict_rss_x=(big - base) / 1024 / mib)
    return figures


if __name__ == "__main__":
    sys.exit(main())
