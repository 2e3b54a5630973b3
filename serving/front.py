"""The C++ gRPC front: ``recship serve --front cpp`` (``cpp_loader/tools/recship_front.cpp``).

Why: with the Python front every request costs ~0.25 ms of Python CPU (an empty grpc.aio
handler alone peaks near 4,000 requests/s on this 2-core machine), more than a one-example
forward, so batching 32 one-example clients gained only ~1.2x. The C++ front takes the
public gRPC port and answers ``Predictor/Predict`` itself: parse, validate, batch and run
(the C++ loader, ``model.pt2`` where it runs) without Python per request.

What stays Python (the control plane and everything off the hot path): the model repository
(scans, self-checks, hot swaps, rollbacks: each change is sent to the front as a command),
metrics (the front's counts are merged into the same families at each scrape), health,
reflection, KServe v2 (gRPC and REST) and the other Predictor methods. The front forwards
every call it does not answer byte for byte to the Python gRPC server behind it (a Unix
socket in a private folder), and that includes every Predict it would refuse: errors keep
the Python server's exact statuses and messages, and a model the front failed to load is
still served, by Python.
"""

import json
import logging
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import grpc
from prometheus_client.utils import floatToGoString

from recship.export.aoti import process_folder
from recship.native import NativeError, find, packaged, runtime_env
from recship.serving import rules
from recship.serving.grpc_status import CODES
from recship.serving.inference import ErrorKind, SampledLog
from recship.serving.metrics import ModelStats
from recship.serving.settings import ModelSettings

if TYPE_CHECKING:
    from recship.serving.repository import ServedVersion

log = logging.getLogger("recship.serving")
_front_log = logging.getLogger("recship.front")
_LINE_FIELDS = ("method", "model", "version", "status")  # a front log line's fields (log.cpp), a Python record's extra


class FrontError(RuntimeError):
    """The C++ front could not be built, started, or did not do what it was told."""


def build_front() -> Path:
    """Returns ``recship_front``: the one installed with recship (the wheel's), else built (incrementally) from the
    source checkout (recship.native.find); FrontError where neither can be had here."""
    if packaged("recship_front") is None:
        log.info("the C++ front of this source checkout: cmake builds what changed since its last build (minutes the first time)")
    try:
        return find("recship_front")
    except NativeError as e:
        raise FrontError(str(e)) from None


FRONT_REFUSALS = ("cancelled", "deadline", "queue_full", "overloaded", "internal")  # the refusals the C++ front makes itself


def front_tables() -> Dict[str, Any]:
    """What the C++ front counts and says as the Python server does, sent to it at start (``--tables``; the front has
    no copy of its own, cpp_loader/tools/front/tables.h): the serving rules' (``rules.py``) histogram buckets, sampled
    log, and the refusals it makes itself with the gRPC code and status name of each (``grpc_status.py``)."""
    def refusal(key: str) -> Dict[str, Any]:
        kind = ErrorKind[rules.REFUSALS[key].kind]
        return {"code": CODES[kind].value[0], "status": kind.label, "message": rules.REFUSALS[key].message}

    return {
        "latency_buckets": list(rules.LATENCY_BUCKETS),
        "batch_buckets": list(rules.BATCH_BUCKETS),
        "log_interval_s": rules.LOG_INTERVAL_S,
        "log_max_kinds": SampledLog.MAX_KINDS,
        "answered": grpc.StatusCode.OK.name,
        "refusals": {key: refusal(key) for key in FRONT_REFUSALS},
    }


class CppFront:
    """A running ``recship_front`` process and its command pipe (one command at a time)."""

    def __init__(self, config, backend: str, binary: Optional[Path] = None, on_exit: Optional[Callable[[int], None]] = None) -> None:
        """Starts the front on ``config.host:config.port``; ``on_exit(code)`` is called if it ever exits unasked."""
        self.binary = binary = binary or build_front()
        self._on_exit = on_exit
        self._stopping = False
        # the server's settings by ServerConfig's field names, as a model's own go in its load command
        settings = {**ModelSettings.defaults(config).front_settings(),
                    "max_message_bytes": config.max_message_bytes, "max_inflight_bytes": config.max_inflight_bytes}
        args = [str(binary), "--listen", f"{config.host}:{config.port}", "--backend", backend,
                "--settings", json.dumps(settings), "--tables", json.dumps(front_tables())]
        if config.tls_cert is not None:
            args += ["--tls-cert", config.tls_cert, "--tls-key", config.tls_key]
            if config.tls_client_ca is not None:
                args += ["--tls-client-ca", config.tls_client_ca]
        self._lock = threading.Lock()
        # the front's temp folder (TMPDIR: torch's AOTI loader extracts each model.pt2 there), inside this
        # process's own: removed once the front has exited, however it ended, and with this process's folder
        self.folder = Path(tempfile.mkdtemp(prefix="front-", dir=process_folder()))
        try:
            self._proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          bufsize=1, env={**runtime_env(), "TMPDIR": str(self.folder)})
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self._stderr = threading.Thread(target=self._forward_logs, name="front-logs", daemon=True)
        self._stderr.start()
        try:
            first = self._read()
        except FrontError:
            self._stopping = True  # it never started: its exit is this error, not a crash for on_exit to restart
            raise
        if "listening" not in first:
            self._stopping = True
            self._proc.wait(timeout=10)
            raise OSError(f"the C++ front could not start: {first.get('error', first)}")
        self.port = int(first["listening"])

    def _read(self) -> Dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait(timeout=10)
            raise FrontError(f"the C++ front exited (code {code})")
        return json.loads(line)

    def _forward_logs(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            line = line.rstrip("\n")
            try:
                entry = json.loads(line)
                level = logging.getLevelName(entry.get("level", "INFO"))
                extra = {k: entry[k] for k in _LINE_FIELDS if k in entry}  # what the line is about, as Python logs it
                _front_log.log(level if isinstance(level, int) else logging.INFO, "%s", entry.get("message", line), extra=extra)
            except ValueError:
                _front_log.warning("%s", line)
        code = self._proc.wait()  # stderr closed: the process is gone
        shutil.rmtree(self.folder, ignore_errors=True)
        if not self._stopping and self._on_exit is not None:
            self._on_exit(code)

    def command(self, **cmd: Any) -> Dict[str, Any]:
        """Sends one command and returns its answer; FrontError if it failed or the front is gone."""
        with self._lock:
            if self._proc.poll() is not None:
                raise FrontError(f"the C++ front is not running (exit code {self._proc.returncode})")
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps(cmd) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                raise FrontError(f"the C++ front is not running: {e}") from None
            answer = self._read()
        if not answer.get("ok"):
            raise FrontError(answer.get("error", "the C++ front refused the command"))
        return answer

    def load(self, name: str, version: int, path: Path, model_format: str, settings: Optional[Dict[str, Any]] = None,
             manifest_sha256: Optional[str] = None) -> str:
        """Loads (verified as a unit, self-checked) a version in the front and routes ``name`` to it; returns the format it runs.

        ``settings``: the model's own batching (max_batch_size, max_delay_ms, batching, max_queue, torch_threads);
        what it leaves out is the server's flags. ``manifest_sha256``: the manifest the front may load (the one
        this process verified; the C++ loader's LoadOptions::trusted), None: any.
        """
        extra = {"manifest_sha256": manifest_sha256} if manifest_sha256 is not None else {}
        return self.command(op="load", model=name, version=version, path=str(path), format=model_format,
                            settings=settings or {}, **extra)["format"]

    def unload(self, name: str) -> None:
        self.command(op="unload", model=name)

    def stats(self) -> Dict[str, Any]:
        return self.command(op="stats")["stats"]

    def tables(self) -> Dict[str, Any]:
        """The tables the front took at start (``front_tables()``'s, as it holds them)."""
        return self.command(op="tables")["tables"]

    def message_kind(self, message: str) -> str:
        """The front's sampled log's kind of ``message`` (log.cpp); ``inference.message_kind`` is the same rule."""
        return self.command(op="message_kind", message=message)["kind"]

    def stop(self, grace: float = 5.0) -> None:
        """Stops taking calls, lets those in flight finish (up to ``grace`` s), unloads and exits."""
        self._stopping = True
        try:
            self.command(op="stop", grace_s=grace)
        except FrontError:
            pass
        try:
            self._proc.wait(timeout=grace + 30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stderr.join(timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)

    def model_stats(self) -> Dict[Tuple[str, str], "ModelStats"]:
        """The front's Triton statistics by (model, version) (serving/metrics.py ModelStats)."""
        out = {}
        for m in self.stats()["models"]:
            if m["model"] == rules.UNROUTED:  # requests that reached no version: in no version's statistics
                continue
            out[(m["model"], str(m["version"]))] = ModelStats(
                list(m["success"]), list(m["fail"]), list(m["queued"]), list(m["computed"]), m["inference_count"],
                m["execution_count"], m["last_inference_ms"], {size: [n, ns] for size, n, ns in m["batches"]})
        return out

    def samples(self) -> Dict[str, List[Tuple[str, Dict[str, str], float]]]:
        """The front's counts as Prometheus samples by family name (serving/metrics.py's families)."""
        stats = self.stats()
        out: Dict[str, List[Tuple[str, Dict[str, str], float]]] = {}
        for r in stats["requests"]:
            labels = {"method": "Predict", "model": r["model"], "version": str(r["version"]), "status": r["status"]}
            out.setdefault("recship_requests", []).append(("recship_requests_total", labels, float(r["count"])))
        families = {"latency": "recship_request_seconds", "queue": "recship_queue_seconds",
                    "compute": "recship_compute_seconds", "batch": "recship_batch_examples"}
        ids: Dict[str, float] = {}
        for m in stats["models"]:
            model, version = m["model"], str(m["version"])
            if model != rules.UNROUTED:
                ids[model] = ids.get(model, 0.0) + m["ids"]
            for key, family in families.items():
                if model == rules.UNROUTED and key != "latency":  # refused before a version: only its latency, as in Python
                    continue
                h, total = m[key], 0
                samples = out.setdefault(family, [])
                for bound, count in zip(h["bounds"] + [float("inf")], h["counts"]):
                    total += count
                    samples.append((f"{family}_bucket", {"model": model, "version": version, "le": floatToGoString(bound)}, float(total)))
                samples.append((f"{family}_count", {"model": model, "version": version}, float(total)))
                samples.append((f"{family}_sum", {"model": model, "version": version}, float(h["sum"])))
        for model, n in ids.items():
            out.setdefault("recship_ids", []).append(("recship_ids_total", {"model": model}, n))
        gauges = stats.get("gauges", {})
        for g in gauges.get("pending", []):  # added to the Python process's own gauges of the same name
            labels = {"model": g["model"], "version": str(g["version"])}
            out.setdefault("recship_queue_depth", []).append(("recship_queue_depth", labels, float(g["pending"])))
        if "inflight_bytes" in gauges:
            out.setdefault("recship_inflight_bytes", []).append(("recship_inflight_bytes", {}, float(gauges["inflight_bytes"])))
        return out


class FrontMirror:
    """Keeps the C++ front serving what the model repository serves: each model's newest served version, with
    its settings. The front serves one version per model; requests for the model's other versions (and for a
    model it could not load) it forwards to the Python server."""

    def __init__(self, front: CppFront, model_format: str) -> None:
        self.front = front
        self._format = model_format
        self._serves: Dict[str, Optional["ServedVersion"]] = {}  # model -> the version the front was told to serve

    def sync(self, name: str, newest: Optional["ServedVersion"]) -> None:
        """Has the front serve ``newest`` (the model's newest served version; None: none)."""
        if self._serves.get(name) is newest:
            return
        had = self._serves.get(name) is not None
        self._serves[name] = newest
        if newest is not None:
            skip = newest.python_only()
            if skip is None:
                self._load(newest)
                return
            log.info("%s version %d is served by Python only: %s", name, newest.version, skip,
                     extra={"model": name, "version": newest.version})
        elif not had:
            return
        try:
            self.front.unload(name)  # never leave it serving another version's or settings' answers
        except Exception as e:
            log.error("the C++ front did not unload %s: %s", name, e, extra={"model": name})

    def _load(self, served: "ServedVersion") -> None:
        """Loads ``served`` in the front; where it cannot, the front forwards the model's requests to Python."""
        try:
            # the front loads the manifest this process verified (its sha256), or nothing: a version whose
            # files change meanwhile is refused there and served here until the next scan loads it again
            fmt = self.front.load(served.name, served.version, served.path, self._format,
                                  settings=served.settings.front_settings(), manifest_sha256=served.manifest.sha256)
            log.info("C++ front serves %s version %d (%s)", served.name, served.version, fmt,
                     extra={"model": served.name, "version": served.version})
        except Exception as e:
            log.error("the C++ front could not load %s version %d (%s); its requests are served by Python", served.name,
                      served.version, e, extra={"model": served.name, "version": served.version})
            try:
                self.front.unload(served.name)  # never leave it serving an older version
            except Exception:
                pass
