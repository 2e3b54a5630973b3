"""The model repository: ``DIR/<model>/<version>/`` artifacts, loaded, hot-swapped, rolled back.

Each model serves the versions its version policy picks (default: the newest loadable
one). A watcher thread rescans every ``poll_interval_s``: a newer version is loaded and
self-checked off the request path, then routed to (requests already queued finish on the
old one); a version whose folder is removed is unloaded and the policy picks again among
the remaining versions (rollback). A served version whose files change on disk (an export
``--overwrite``, a copy over it) is loaded again as a unit, verified, and swapped in with a
log line; while the new files do not load, the loaded version keeps serving and the reason
is logged once (per state of the files).

``DIR/<model>/config.yaml`` (optional) sets the model's own batching, queue, threads,
version policy and id-policy overrides (``ModelSettings``); the server's flags are the
defaults of what it leaves out. It is reread on every scan: a change restarts the model's
served versions with the new settings (new batchers started, then swapped in, the old ones
retired after their queued requests).

With ``--model-control explicit`` nothing loads on its own: ``load(name)`` reads a model
from the repository (again, picking up new versions and config), ``unload(name)`` retires
it (queued requests finish first), and the watcher only restarts dead workers; this is
Triton's RepositoryModelLoad / RepositoryModelUnload.

Nothing in the repository can stop the others from loading: every model is scanned on
its own, and a version that fails for any reason (a bad folder name, a manifest of the
wrong shape, a checksum, a self-check, a manifest.json not on the ``trusted`` list) is
refused with one logged line and listed as UNAVAILABLE with its reason; it is retried
when its files (or the trusted list, or its model's config.yaml) change. A bad
config.yaml refuses its model the same way (listed with an empty version); a model that
was serving keeps its versions and last good settings until the file is fixed.
"""

import copy
import ctypes
import dataclasses
import functools
import gc
import hashlib
import logging
import stat
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Optional, Tuple

from recship.contract.manifest import ArtifactError, Manifest
from recship.contract.repository import MODEL_NAME, VERSION_NAME, parse_version, version_folders  # VERSION_NAME: for serving.kserve
from recship.export.artifact import open_artifact
from recship.serving.batcher import Batcher, DeviceThread
from recship.serving.metrics import Metrics
from recship.serving.requests import ModelSpec, shown
from recship.serving.settings import (MODEL_CONFIG, ConfigError, ModelSettings, config_value, default_torch_threads, read_model_config,
                                      read_trusted)

if TYPE_CHECKING:
    from recship.serving.front import FrontMirror
    from recship.serving.settings import ServerConfig

log = logging.getLogger("recship.serving")



class ModelNotFound(LookupError):
    """No such model or version is served (ErrorKind.NOT_FOUND)."""


class ControlRefused(RuntimeError):
    """A load or unload the server's model control does not allow (polling), or a load that served no version."""


@dataclass
class Unavailable:
    """A version (or folder, or a model's config.yaml: version "") that was refused, and why; listed by the repository index."""

    model: str
    version: str
    reason: str
    signature: Optional[Tuple] = None  # the state of its files (and trusted list, and settings) when refused


class ServedVersion:
    """One loaded version: its model (TorchScript or AOTInductor), Manifest, settings, validation spec and batcher."""

    def __init__(self, name: str, version: int, path: Path, repo: "ModelRepository", trusted: Optional[FrozenSet[str]],
                 settings: Optional[ModelSettings] = None) -> None:
        config = repo.config
        self.name, self.version, self.path = name, version, path
        self.files = _signature(path)  # before loading: files that change during the load are loaded again
        self.refused_files: Optional[Tuple] = None  # the state of its files that last failed to load again
        self.reloaded = False  # loaded again because its files changed (for the log line)

        def on_this_device(manifest: Manifest) -> None:
            if manifest.sharding.device != config.device:
                raise ArtifactError(f"{path}: exported for {manifest.sharding.device}, but this server runs on {config.device} (--device)")

        # verified as a unit (manifest, every file it lists, sample self-check); model.pt2 (AOTInductor) or
        # model.pt as --model-format says; ``trusted``: the allow-list of manifest sha256s
        self.model, self.manifest = open_artifact(path, check=True, trusted=trusted, format=config.model_format, accept=on_this_device)
        self.format = getattr(self.model, "format", "torchscript")
        self._repo = repo
        self._configure(settings or ModelSettings.defaults(config))

    def _configure(self, settings: ModelSettings) -> None:
        self.settings = settings
        spec = ModelSpec.from_manifest(self.manifest, settings.max_batch_size)
        if settings.id_policy:
            unknown = [f for f, _ in settings.id_policy if f not in spec.modulo]
            if unknown:
                raise ConfigError(f"{self.path.parent / MODEL_CONFIG}: id-policy names {config_value(unknown)}, which version "
                                  f"{self.version} does not have; its sparse features are {config_value(spec.features)}")
            spec = dataclasses.replace(spec, modulo={**spec.modulo, **{f: p == "modulo" for f, p in settings.id_policy}})
        self.spec = spec
        self.batcher = self.start_batcher()

    def reconfigured(self, settings: ModelSettings) -> "ServedVersion":
        """This version (the same loaded model) with other settings: a new spec and a new batcher."""
        if settings.runtime() == self.settings.runtime():
            self.settings = settings  # only the version policy changed: nothing to restart
            return self
        new = copy.copy(self)
        new._configure(settings)
        return new

    def python_only(self) -> Optional[str]:
        """Why the C++ front must not serve this version (None: it may). The front validates ids by the
        artifact's own policies: it would hash the ids of a modulo feature overridden to reject."""
        overridden = [f.name for f in self.manifest.sparse_features if f.id_policy == "modulo" and not self.spec.modulo[f.name]]
        if overridden:
            return f"id-policy overrides modulo features {overridden} to reject, which only the Python server applies"
        return None

    def start_batcher(self) -> Batcher:
        config, metrics, name, version, s = self._repo.config, self._repo.metrics, self.name, self.version, self.settings
        me = weakref.ref(self)  # not self: the batcher must not keep its version (and its tables) alive in a cycle

        def died(e: BaseException) -> None:
            served = me()
            if served is not None:
                served._repo.worker_died(served)

        batcher = Batcher(
            self.model, s.max_batch_size, s.max_delay_ms / 1000.0, s.max_queue,
            observe=functools.partial(metrics.observe_batch, name, str(version)), name=f"{name}-{version}",
            device="cuda:0" if config.device == "cuda" else "cpu",  # a CUDA artifact takes its inputs on its first device
            forwards=self._repo.forwards, threads=s.torch_threads or default_torch_threads(),
            on_death=died, batching=s.batching,
        )
        if self._repo.windows_closed:  # loaded while the server stops
            batcher.close_window()
        return batcher


def _retire(versions: List[ServedVersion]) -> None:
    """Stops the batchers of versions no longer served (their queued requests finish first), drops them
    and hands the freed memory back: a replaced version must cost nothing once it is gone."""
    for served in versions:
        served.batcher.stop()
    versions.clear()
    release_memory()


def release_memory() -> None:
    """Collects garbage now and returns free heap to the OS (glibc ``malloc_trim``): glibc keeps what a
    thread freed in that thread's arena, so without it a replaced model's heap stays in RSS."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


def _not_a_version_or_model(root: Path) -> None:
    """ValueError when ``root``, given as the repository, is one artifact (a version folder) or one model's folder:
    the server would find no model (or models named "1", "2"...) and serve nothing."""
    if (root / "manifest.json").is_file():
        raise ValueError(f"--model-repo {root} is an artifact (a version folder: it holds manifest.json); give the repository "
                         f"that holds <model>/<version>/ folders, e.g. --model-repo {root.parent.parent} if {root.parent.name!r} "
                         "is the model")
    try:
        entries = [e for e in root.iterdir() if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return
    if entries and all(parse_version(e.name) is not None and (e / "manifest.json").is_file() for e in entries):
        raise ValueError(f"--model-repo {root} is one model's folder (its versions {sorted(int(e.name) for e in entries)[:5]} hold "
                         f"the artifacts); give the repository that holds it: --model-repo {root.parent}")


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
        _not_a_version_or_model(self.root)
        if config.trusted_sha256 is not None:
            read_trusted(config.trusted_sha256)  # a bad allow-list is an error at start, not a silent refusal of everything
        self.metrics = metrics
        self.defaults = ModelSettings.defaults(config)
        self.forwards = DeviceThread(config.device)  # one forward at a time on the server's device, across models, on one thread
        self._lock = threading.Lock()  # guards _serving and _unavailable (read by request threads)
        self._scanning = threading.Lock()  # one scan at a time
        self._serving: Dict[str, Dict[int, ServedVersion]] = {}  # model -> version -> served
        self._unavailable: Dict[Tuple[str, str], Unavailable] = {}
        self._left_out: Dict[str, Dict[int, str]] = {}  # model -> version on disk neither served nor refused -> why
        self._configs: Dict[str, Tuple[Optional[str], Optional[ModelSettings]]] = {}  # model -> (config.yaml text, its settings)
        self._settings: Dict[str, ModelSettings] = {}  # model -> its last good settings
        self._on_change = on_change or (lambda name, ready: None)
        self._stop = threading.Event()
        self.windows_closed = False  # close_windows: the server is stopping, no request waits for batch company
        self._watcher: Optional[threading.Thread] = None
        self._mirror: Optional["FrontMirror"] = None  # the C++ front, told of every version that starts or stops serving
        self.explicit = getattr(config, "model_control", "poll") == "explicit"
        self._loaded: set = set()  # explicit control: the models asked for (by --load-model or a load request)
        self._unloaded: set = set()  # explicit control: the models unloaded by a request (the index says so)
        metrics.queue_depth = lambda: {(s.name, str(s.version)): s.batcher.pending for s in self.versions()}
        metrics.readiness = self._readiness

    # -- reading (any thread) ------------------------------------------------

    def get(self, name: str, version: int = 0) -> ServedVersion:
        """The served ``version`` of model ``name``; version 0: its newest served version."""
        with self._lock:
            served = self._serving.get(name)
            names = sorted(self._serving)
        if not served:
            raise ModelNotFound(f"model {shown(name)} is not served; served: {names}")
        if not version:
            return served[max(served)]
        if version not in served:
            which = f"version {next(iter(served))}" if len(served) == 1 else f"versions {sorted(served, reverse=True)}"
            raise ModelNotFound(f"model {name!r} version {version} is not served (serving {which})")
        return served[version]

    def models(self) -> List[ServedVersion]:
        """The newest served version of every model, by name."""
        with self._lock:
            return [versions[max(versions)] for _, versions in sorted(self._serving.items())]

    def versions(self, name: Optional[str] = None) -> List[ServedVersion]:
        """Every served version (of model ``name``, or of every model by name), newest first."""
        with self._lock:
            items = sorted(self._serving.items()) if name is None else [(name, self._serving.get(name, {}))]
            return [versions[v] for _, versions in items for v in sorted(versions, reverse=True)]

    def unavailable(self) -> List[Unavailable]:
        with self._lock:
            return sorted(self._unavailable.values(), key=lambda u: (u.model, u.version))

    def left_out(self) -> List[Tuple[str, int, str]]:
        """(model, version, why) of each version on disk that neither serves nor was refused: the version policy
        leaves it out (RepositoryIndex lists it UNAVAILABLE with that reason, as Triton lists every version)."""
        with self._lock:
            return [(name, v, why) for name, versions in sorted(self._left_out.items()) for v, why in sorted(versions.items())]

    # -- scanning (the watcher thread, or start-up) ----------------------------

    def scan(self) -> None:
        """One pass over the repository: apply each model's config and version policy, roll back removed versions,
        restart dead workers. Under explicit model control only the last: models change by ``load`` and ``unload``."""
        with self._scanning:
            if not self.explicit:
                self._scan_all()
            self._restart_dead()

    def start_explicit(self, names: List[str]) -> None:
        """Explicit model control: loads ``names`` at start-up ("*": every model in the repository); a name with
        no folder is a ValueError, a model that does not load is listed UNAVAILABLE with its reason."""
        wanted = set(names)
        if "*" in wanted:
            wanted = {e.name for e in self.root.iterdir() if e.is_dir() and MODEL_NAME.fullmatch(e.name)} | (wanted - {"*"})
        missing = sorted(n for n in wanted if not (MODEL_NAME.fullmatch(n) and (self.root / n).is_dir()))
        if missing:
            raise ValueError(f"--load-model {', '.join(missing)}: no such model folder in {self.root}")
        for name in sorted(wanted):
            try:
                self.load(name)
            except ControlRefused as e:
                log.error("%s", e, extra={"model": name})

    def load(self, name: str) -> None:
        """Explicit model control: (re)loads model ``name`` from the repository, as its config and version policy say.

        ModelNotFound if the repository has no such model; ControlRefused under polling, or if no version of it serves
        (the reasons are in the message and in the index)."""
        if not self.explicit:
            raise ControlRefused("models are loaded by polling the repository; start the server with "
                                 "--model-control explicit to load and unload them on request")
        model_dir = self.root / name
        if not MODEL_NAME.fullmatch(name) or not model_dir.is_dir():
            raise ModelNotFound(f"no model {shown(name)} in the repository {self.root}")
        with self._scanning:
            self._loaded.add(name)
            self._unloaded.discard(name)
            trusted = read_trusted(self.config.trusted_sha256) if self.config.trusted_sha256 is not None else None
            self._scan_model(name, model_dir, trusted)
            if not self.versions(name):
                reasons = [f"version {u.version}: {u.reason}" if u.version else u.reason for u in self.unavailable() if u.model == name]
                raise ControlRefused(f"model {name} did not load: {'; '.join(reasons) or 'it has no version folders'}")

    def unload(self, name: str) -> None:
        """Explicit model control: stops serving model ``name`` (queued requests finish first). Unloading a model
        that is not loaded does nothing; ModelNotFound if neither served nor in the repository."""
        if not self.explicit:
            raise ControlRefused("models are unloaded by removing them from the repository under polling; start the "
                                 "server with --model-control explicit to load and unload them on request")
        with self._scanning:
            served = {s.version: s for s in self.versions(name)}
            if not served and not (MODEL_NAME.fullmatch(name) and (self.root / name).is_dir()):
                raise ModelNotFound(f"no model {shown(name)} is loaded or in the repository {self.root}")
            self._loaded.discard(name)
            self._unloaded.add(name)
            self._configs.pop(name, None)  # a later load reads config.yaml again
            self._settings.pop(name, None)
            with self._lock:
                for key in [k for k in self._unavailable if k[0] == name]:
                    del self._unavailable[key]
                self._left_out.pop(name, None)
            self._install(name, {}, {v: "unloaded by request" for v in served})

    def not_loaded(self) -> List[Tuple[str, str]]:
        """Explicit model control: (model, reason) of the repository's models that do not serve and have no refusal
        listed: "unloaded" (by request), or "" (never asked for)."""
        if not self.explicit:
            return []
        with self._lock:
            listed = set(self._serving) | {u.model for u in self._unavailable.values()}
        names = {e.name for e in self.root.iterdir() if e.is_dir() and MODEL_NAME.fullmatch(e.name)} | self._unloaded
        return [(n, "unloaded" if n in self._unloaded else "") for n in sorted(names - listed)]

    def _readiness(self) -> Dict[Tuple[str, str], int]:
        """(model, version) -> 1 serving / 0 not, for every served and every refused version (the metrics' gauge)."""
        out = {(u.model, u.version): 0 for u in self.unavailable()
               if MODEL_NAME.fullmatch(u.model) and (u.version == "" or parse_version(u.version) is not None)}
        out.update({(s.name, str(s.version)): int(s.batcher.alive) for s in self.versions()})
        return out

    def _scan_all(self) -> None:
        """Polling: every model folder as its config and version policy say; models whose folders are gone unload."""
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
            self._install(name, {}, {v: "its folder was removed" for v in self._serving[name]})
        for name in [n for n in self._configs if n not in present]:
            self._configs.pop(name, None)
            self._settings.pop(name, None)
        with self._lock:  # forget refusals whose folders are gone
            for name in [n for n in self._left_out if n not in present]:
                del self._left_out[name]
            for key, u in list(self._unavailable.items()):
                if not (self.root / u.model / u.version).exists():
                    del self._unavailable[key]

    def _restart_dead(self) -> None:
        for served in self.versions():
            if served.batcher.died is not None:
                served.batcher = served.start_batcher()
                log.warning("restarted the worker of %s version %d", served.name, served.version,
                            extra={"model": served.name, "version": served.version})
                self._on_change(served.name, True)

    def _model_settings(self, name: str, model_dir: Path) -> Optional[ModelSettings]:
        """The model's settings from its config.yaml (the server's flags without one); a bad file is refused
        (model-level UNAVAILABLE) and the model keeps its last good settings (None: it never had any)."""
        path = model_dir / MODEL_CONFIG
        try:
            text: Optional[str] = path.read_text()
        except FileNotFoundError:
            text = None
        except (OSError, UnicodeDecodeError) as e:
            text = f"<unreadable: {e}>"
        cached = self._configs.get(name)
        if cached is None or cached[0] != text:
            settings = None
            if text is None:
                settings = self.defaults
            elif not text.startswith("<unreadable: "):
                try:
                    settings = read_model_config(path, text, self.defaults)
                except ConfigError as e:
                    self._refuse(name, "", (text,), str(e))
            else:
                self._refuse(name, "", (text,), f"{path}: cannot be read: {text[13:-1]}")
            if settings is not None:
                with self._lock:
                    self._unavailable.pop((name, ""), None)
                if cached is not None or text is not None:
                    log.info("%s: settings %s", name, "from " + str(path) if text is not None else "of the server (no config.yaml)",
                             extra={"model": name})
                self._settings[name] = settings
            self._configs[name] = (text, settings)
        return self._settings.get(name)

    def _scan_model(self, name: str, model_dir: Path, trusted: Optional[FrozenSet[str]]) -> None:
        settings = self._model_settings(name, model_dir)
        if settings is None:  # a bad config.yaml and no good one before it: nothing of this model serves
            return
        versions, others = version_folders(model_dir)  # hidden folders (a version being written) are neither
        for other in others:
            self._refuse(name, other, None, "version folders are named by a number (ASCII digits)")
        with self._lock:
            current = dict(self._serving.get(name, {}))
        present = {v for v, _ in versions}
        for version in sorted(set(current) - present, reverse=True):
            log.info("%s version %d was removed from the repository; its version policy picks again among the remaining versions",
                     name, version, extra={"model": name, "version": version})
        trust = hashlib.sha256(",".join(sorted(trusted)).encode()).hexdigest() if trusted is not None else None
        policy = settings.version_policy
        allowed = set(policy.choose([v for v, _ in versions]))
        versions = [(v, p) for v, p in versions if v in allowed]
        limit = policy.limit
        chosen: Dict[int, ServedVersion] = {}
        why: Dict[int, str] = {}
        for version, path in versions:  # newest first
            if limit is not None and len(chosen) >= limit:
                break
            served = current.get(version)
            signature: Optional[Tuple] = None
            if served is None or served.settings.runtime() != settings.runtime():
                signature = (_signature(path), trust, settings)
            if served is not None:
                files = _signature(path)
                if files != served.files:  # changed on disk since it loaded: loaded again as a unit, or kept
                    fresh = self._reload(served, path, trusted, settings, files)
                    if fresh is not None:
                        chosen[version] = fresh
                        continue
                try:
                    chosen[version] = served.reconfigured(settings)
                except Exception as e:
                    why[version] = str(e)
                    self._refuse(name, str(version), signature, str(e))
                continue
            refused = self._unavailable.get((name, str(version)))
            if refused is not None and refused.signature == signature:
                continue  # refused before and unchanged since
            try:
                chosen[version] = ServedVersion(name, version, path, self, trusted, settings)
            except Exception as e:  # anything a bad artifact can raise: refuse it, keep going
                reason = str(e) if isinstance(e, (ArtifactError, ConfigError)) else f"{type(e).__name__}: {e}"
                self._refuse(name, str(version), signature, reason)
        for version in current:
            if version not in chosen and version not in why:
                why[version] = "its folder was removed" if version not in present else f"its version policy {policy} leaves it out"
        with self._lock:
            self._left_out[name] = {v: f"its version policy {policy} leaves it out" for v in present
                                    if v not in chosen and (name, str(v)) not in self._unavailable}
        self._install(name, chosen, why)

    def _reload(self, served: ServedVersion, path: Path, trusted: Optional[FrozenSet[str]], settings: ModelSettings,
                files: Tuple) -> Optional[ServedVersion]:
        """``served`` loaded again from its files, which changed on disk (``files``: their state now), verified as a
        unit; None keeps ``served`` serving (the files do not load: logged once per state of the files)."""
        if served.refused_files == files:
            return None
        where = {"model": served.name, "version": served.version}
        log.info("%s version %d: its files changed on disk; loading them again (the loaded version serves meanwhile)",
                 served.name, served.version, extra=where)
        try:
            fresh = ServedVersion(served.name, served.version, path, self, trusted, settings)
        except Exception as e:  # anything a bad artifact can raise: the loaded version keeps serving
            served.refused_files = files
            reason = str(e) if isinstance(e, (ArtifactError, ConfigError)) else f"{type(e).__name__}: {e}"
            self.metrics.load_failures.labels(served.name).inc()
            log.error("%s version %d keeps serving what it loaded before: its files changed on disk and do not load: %s",
                      served.name, served.version, reason, extra=where)
            return None
        fresh.reloaded = True
        return fresh

    def _install(self, name: str, chosen: Dict[int, ServedVersion], why: Dict[int, str]) -> None:
        """Makes ``chosen`` the served versions of ``name``; the versions it drops or replaces finish their
        queued requests, then go (``why``: the reason of each dropped version, for its log line)."""
        with self._lock:
            old = self._serving.get(name, {})
        if old.keys() == chosen.keys() and all(old[v] is s for v, s in chosen.items()):
            return
        # the front first: it serves the newest version before this process does, and forwards what it lacks here
        if self._mirror is not None:
            self._mirror.sync(name, chosen[max(chosen)] if chosen else None)
        with self._lock:
            if chosen:
                self._serving[name] = dict(chosen)
            else:
                self._serving.pop(name, None)
            for version in chosen:
                self._unavailable.pop((name, str(version)), None)
        for version, served in sorted(chosen.items()):
            if old.get(version) is not served:
                again = ("" if version not in old else " (loaded again: its files changed on disk)" if served.reloaded
                         else " with new settings")
                log.info("serving %s version %d from %s (%s)%s", name, version, served.path, served.format, again,
                         extra={"model": name, "version": version})
        for version, served in old.items():
            if chosen.get(version) is served:
                continue
            if version not in chosen:  # routine (a rollout, a rollback, a request): what needs a person was logged as an error
                log.info("unloaded %s version %d: %s", name, version, why.get(version, "unknown"),
                         extra={"model": name, "version": version})
            # queued requests finish on the old version, then it goes
            threading.Thread(target=_retire, args=([served],), daemon=True, name=f"unload-{name}-{version}").start()
        self._on_change(name, bool(chosen))

    def attach_front(self, mirror: "FrontMirror") -> None:
        """From now on the C++ front serves what this repository serves, starting now (``mirror``: serving/front.py's
        FrontMirror of it)."""
        with self._scanning:
            self._mirror = mirror
            for served in self.models():
                self._mirror.sync(served.name, served)

    def _refuse(self, model: str, version: str, signature: Optional[Tuple], reason: str) -> None:
        key = (model, version)
        with self._lock:
            known = self._unavailable.get(key)
            self._unavailable[key] = Unavailable(model, version, reason, signature)
        if known is None or known.signature != signature:  # one line per refusal, not one per scan
            self.metrics.load_failures.labels(model if MODEL_NAME.fullmatch(model) else "-").inc()
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

    def close_windows(self) -> None:
        """The server stops taking requests: none waits for batch company any more, in the versions served now
        (Batcher.close_window: the batch waiting runs at once) and in any loaded from now on."""
        self.windows_closed = True
        for served in self.versions():
            served.batcher.close_window()

    def stop(self) -> None:
        """Stops watching and unloads every version, refusing what is still queued (the fronts have drained)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=60)
        for served in self.versions():
            served.batcher.stop(drain=False)
        with self._lock:  # nothing keeps a stopped repository's models: they are freed now, not at a later GC
            self._serving.clear()
            self._mirror = None
        self.forwards.stop()
        release_memory()


def _signature(path: Path) -> Tuple:
    """(name, size, mtime, inode) of every file of an artifact: tells a half-copied version from a finished one,
    and a served version's files from those written over them (an export --overwrite, a copy, a rename)."""
    out = []
    for p in path.rglob("*"):
        try:
            st = p.stat()
        except OSError:  # removed meanwhile: the next scan sees the folder as it is then
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((str(p.relative_to(path)), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(out))
