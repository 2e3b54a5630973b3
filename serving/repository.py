"""The model repository: ``DIR/<model>/<version>/`` artifacts, loaded, hot-swapped, rolled back.

The newest loadable version of each model serves. A watcher thread rescans every
``poll_interval_s``: a newer version is loaded and self-checked off the request path,
then routed to (requests already queued finish on the old one); a version whose folder
is removed is unloaded and the newest remaining version takes over (rollback).

Nothing in the repository can stop the others from loading: every model is scanned on
its own, and a version that fails for any reason (a bad folder name, a manifest of the
wrong shape, a checksum, a self-check, a model.pt not on the ``trusted`` list) is
refused with one logged line and listed as UNAVAILABLE with its reason; it is retried
when its files (or the trusted list) change.
"""

import functools
import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Tuple

from recship.export.artifact import ArtifactError, Manifest, open_artifact
from recship.serving.batcher import Batcher
from recship.serving.metrics import Metrics
from recship.serving.requests import ModelSpec, shown

if TYPE_CHECKING:
    from recship.serving.front import CppFront

log = logging.getLogger("recship.serving")

# Model names appear in URLs (/v2/models/<name>) and metric labels: a safe, short alphabet.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# Versions are ASCII digits ("²".isdigit() is true, but int("²") fails); 18 digits fit int64.
VERSION_NAME = re.compile(r"[0-9]{1,18}")


class ModelNotFound(LookupError):
    """No such model or version is served (ErrorKind.NOT_FOUND)."""


@dataclass
class Unavailable:
    """A version (or folder) that was refused, and why; listed by the repository index."""

    model: str
    version: str
    reason: str
    signature: Optional[Tuple] = None  # the state of its files (and trusted list) when refused


class ServedVersion:
    """One loaded version: its model (TorchScript or AOTInductor), Manifest, validation spec and batcher."""

    def __init__(self, name: str, version: int, path: Path, repo: "ModelRepository", trusted: Optional[FrozenSet[str]]) -> None:
        config = repo.config
        self.name, self.version, self.path = name, version, path
        built_for = Manifest.read(path).sharding.device
        if built_for != config.device:
            raise ArtifactError(f"{path}: exported for {built_for}, but this server runs on {config.device} (--device)")
        # checksum + sample self-check; model.pt2 (AOTInductor) or model.pt as --model-format says
        self.model, self.manifest = open_artifact(path, check=True, trusted=trusted, format=config.model_format)
        self.format = getattr(self.model, "format", "torchscript")
        self.spec = ModelSpec.from_manifest(self.manifest, config.max_batch_size)
        self._repo = repo
        self.batcher = self.start_batcher()

    def start_batcher(self) -> Batcher:
        config, metrics, name, version = self._repo.config, self._repo.metrics, self.name, self.version
        return Batcher(
            self.model, config.max_batch_size, config.max_delay_ms / 1000.0, config.max_queue,
            observe=functools.partial(metrics.observe_batch, name), name=f"{name}-{version}",
            device="cuda:0" if config.device == "cuda" else "cpu",  # a CUDA artifact takes its inputs on its first device
            device_lock=self._repo.device_lock, threads=config.torch_threads or default_torch_threads(),
            on_death=lambda e: self._repo.worker_died(self), batching=config.batching,
        )


def default_torch_threads() -> int:
    """Intra-op threads for the forwards: every core but one (left to the request path), from 3 cores up.

    On 2 cores that split would halve the forward: a 512-example forward of the MLPerf-shaped
    bench model served at p50 46 ms with 1 thread against 35 ms with 2 (bench/serve_bench.py).
    """
    cores = os.cpu_count() or 1
    return cores - 1 if cores > 2 else cores


def read_trusted(path: str) -> FrozenSet[str]:
    """The allow-list file: one sha256 per line (``sha256sum`` output works: the first word counts); # comments."""
    digests = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        word = line.split("#", 1)[0].split()[:1]
        if not word:
            continue
        if not re.fullmatch(r"[0-9a-fA-F]{64}", word[0]):
            raise ValueError(f"{path}:{number}: not a sha256: {shown(word[0])}")
        digests.add(word[0].lower())
    return frozenset(digests)


class ModelRepository:
    """Loads, serves, hot-swaps and rolls back the versions under ``config.model_repo``.

    ``on_change(model, ready)`` is called (from the scanning thread) when a model starts or
    stops serving; the server turns it into gRPC health.
    """

    def __init__(self, config, metrics: Metrics, on_change: Optional[Callable[[str, bool], None]] = None) -> None:
        self.config = config
        self.root = Path(config.model_repo)
        if not self.root.is_dir():
            raise FileNotFoundError(f"model repository not found: {self.root}")
        if config.trusted_sha256 is not None:
            read_trusted(config.trusted_sha256)  # a bad allow-list is an error at start, not a silent refusal of everything
        self.metrics = metrics
        self.device_lock = threading.Lock()  # one forward at a time on the server's device, across models
        self._lock = threading.Lock()  # guards _serving and _unavailable (read by request threads)
        self._scanning = threading.Lock()  # one scan at a time
        self._serving: Dict[str, ServedVersion] = {}
        self._unavailable: Dict[Tuple[str, str], Unavailable] = {}
        self._on_change = on_change or (lambda name, ready: None)
        self._stop = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self.front: Optional["CppFront"] = None  # the C++ front (serving/front.py), told of every version that starts or stops serving

    # -- reading (any thread) ------------------------------------------------

    def get(self, name: str, version: int = 0) -> ServedVersion:
        with self._lock:
            served = self._serving.get(name)
            names = sorted(self._serving)
        if served is None:
            raise ModelNotFound(f"model {shown(name)} is not served; served: {names}")
        if version and version != served.version:
            raise ModelNotFound(f"model {name!r} version {version} is not served (serving version {served.version})")
        return served

    def models(self) -> List[ServedVersion]:
        with self._lock:
            return list(self._serving.values())

    def unavailable(self) -> List[Unavailable]:
        with self._lock:
            return sorted(self._unavailable.values(), key=lambda u: (u.model, u.version))

    # -- scanning (the watcher thread, or start-up) ----------------------------

    def scan(self) -> None:
        """One pass over the repository: load newer versions, roll back removed ones, restart dead workers."""
        with self._scanning:
            trusted = read_trusted(self.config.trusted_sha256) if self.config.trusted_sha256 is not None else None
            present = set()
            for entry in sorted(self.root.iterdir()):
                if not entry.is_dir():
                    continue
                if not MODEL_NAME.fullmatch(entry.name):
                    self._refuse(entry.name, "", None, "model folder names are 1-128 of A-Z a-z 0-9 _ . - (not starting with _ . -)")
                    continue
                present.add(entry.name)
                try:
                    self._scan_model(entry.name, entry, trusted)
                except Exception as e:  # e.g. a folder removed mid-scan: this model waits for the next pass
                    log.error("scanning model %s failed: %s: %s", entry.name, type(e).__name__, e, extra={"model": entry.name})
            for name in [n for n in self._serving if n not in present]:
                self._unload(name, "its folder was removed")
            with self._lock:  # forget refusals whose folders are gone
                for key, u in list(self._unavailable.items()):
                    if not (self.root / u.model / u.version).exists():
                        del self._unavailable[key]
            for served in self.models():
                if served.batcher.died is not None:
                    served.batcher = served.start_batcher()
                    log.warning("restarted the worker of %s version %d", served.name, served.version,
                                extra={"model": served.name, "version": served.version})
                    self._on_change(served.name, True)

    def _scan_model(self, name: str, model_dir: Path, trusted: Optional[FrozenSet[str]]) -> None:
        versions = []
        for entry in model_dir.iterdir():
            if not entry.is_dir() or entry.name.startswith("."):  # hidden: a version being written (recship export --repo)
                continue
            if VERSION_NAME.fullmatch(entry.name):
                versions.append((int(entry.name), entry))
            else:
                self._refuse(name, entry.name, None, "version folders are named by a number (ASCII digits)")
        versions.sort(reverse=True)
        current = self._serving.get(name)
        removed = current is not None and current.version not in {v for v, _ in versions}
        if current is not None and removed:
            log.warning("%s version %d was removed from the repository; falling back to the newest remaining version",
                        name, current.version, extra={"model": name, "version": current.version})
            current = None
        trust = hashlib.sha256(",".join(sorted(trusted)).encode()).hexdigest() if trusted is not None else None
        for version, path in versions:
            if current is not None and current.version >= version:
                return
            signature = (_signature(path), trust)
            refused = self._unavailable.get((name, str(version)))
            if refused is not None and refused.signature == signature:
                continue  # refused before and unchanged since
            try:
                served = ServedVersion(name, version, path, self, trusted)
            except Exception as e:  # anything a bad artifact can raise: refuse it, keep going
                reason = str(e) if isinstance(e, ArtifactError) else f"{type(e).__name__}: {e}"
                self._refuse(name, str(version), signature, reason)
                continue
            self._swap(name, served)
            return
        if removed:
            self._unload(name, "no other version could be loaded")

    def _swap(self, name: str, served: ServedVersion) -> None:
        self._front_load(served)  # first, so the front never serves an older version than this process
        with self._lock:
            old = self._serving.get(name)
            self._serving[name] = served
            self._unavailable.pop((name, str(served.version)), None)
        log.info("serving %s version %d from %s (%s)", name, served.version, served.path, served.format,
                 extra={"model": name, "version": served.version})
        self._on_change(name, True)
        if old is not None:  # queued requests finish on the old version, then it goes
            threading.Thread(target=old.batcher.stop, daemon=True, name=f"unload-{name}-{old.version}").start()

    def _unload(self, name: str, why: str) -> None:
        with self._lock:
            old = self._serving.pop(name, None)
        if old is None:
            return
        if self.front is not None:
            try:
                self.front.unload(name)
            except Exception as e:
                log.error("the C++ front did not unload %s: %s", name, e, extra={"model": name})
        log.warning("unloaded %s version %d: %s", name, old.version, why, extra={"model": name, "version": old.version})
        self._on_change(name, False)
        threading.Thread(target=old.batcher.stop, daemon=True, name=f"unload-{name}-{old.version}").start()

    def attach_front(self, front: "CppFront") -> None:
        """From now on ``front`` (serving/front.py CppFront) serves what this repository serves, starting now."""
        with self._scanning:
            self.front = front
            for served in self.models():
                self._front_load(served)

    def _front_load(self, served: ServedVersion) -> None:
        """Loads ``served`` in the C++ front; where it cannot, the front forwards the model's requests here."""
        if self.front is None:
            return
        try:
            fmt = self.front.load(served.name, served.version, served.path, self.config.model_format)
            log.info("C++ front serves %s version %d (%s)", served.name, served.version, fmt,
                     extra={"model": served.name, "version": served.version})
        except Exception as e:
            log.error("the C++ front could not load %s version %d (%s); its requests are served by Python", served.name,
                      served.version, e, extra={"model": served.name, "version": served.version})
            try:
                self.front.unload(served.name)  # never leave it serving an older version
            except Exception:
                pass

    def _refuse(self, model: str, version: str, signature: Optional[Tuple], reason: str) -> None:
        key = (model, version)
        with self._lock:
            known = self._unavailable.get(key)
            self._unavailable[key] = Unavailable(model, version, reason, signature)
        if known is None or known.signature != signature:  # one line per refusal, not one per scan
            where = f"{shown(model)} version {shown(version)}" if version else shown(model)
            log.error("refusing %s: %s", where, reason, extra={"model": model[:128], "version": version[:32]})

    def worker_died(self, served: ServedVersion) -> None:
        """A version's batcher died (its on_death): not ready until the next scan restarts it."""
        log.error("%s version %d is not serving until its worker is restarted (next repository scan)", served.name, served.version,
                  extra={"model": served.name, "version": served.version})
        self._on_change(served.name, False)

    def start_watching(self) -> None:
        def watch() -> None:
            while not self._stop.wait(self.config.poll_interval_s):
                try:
                    self.scan()
                except Exception as e:  # the watcher outlives anything a scan meets
                    log.error("scanning %s failed: %s: %s", self.root, type(e).__name__, e)

        self._watcher = threading.Thread(target=watch, name="model-watcher", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Stops watching and unloads every version, refusing what is still queued (the fronts have drained)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=60)
        for served in self.models():
            served.batcher.stop(drain=False)


def _signature(path: Path) -> Tuple:
    """(name, size, mtime) of every file of an artifact: tells a half-copied version from a finished one."""
    return tuple(sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()))
