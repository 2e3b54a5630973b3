"""The compile cache: model.pt2's compiled program, kept per exported graph, so an export whose program was
compiled before (a retrain of the same architecture) skips AOTInductor's lowering and C++ compile.

A compiled package holds no constants (``aot_inductor.package_constants_in_so`` off, and inductor told to read
no constant's value: ``VALUE_FREE_OPTIONS``): it is a function of the exported graph, not of the weights, and a
cache hit gives the bytes a fresh compile of the same graph gives, the new weights going into tables.bin as ever.

The key (``program_key``) is a sha256 of:

- the exported program: the code of its graph and of every subgraph (ops, their literal arguments, the
  order), its signature (which input is which parameter, buffer or constant, and the outputs), the
  inputs' shapes, strides and dtypes (symbolic: the dynamic batch and id counts), the dynamic ranges
  and the input/output tree specs; every other node's shape follows from these under one torch;
- each constant's name, dtype, shape and strides (not its values: the package reads them at load);
- the compile's settings: the inductor options given, inductor's whole configuration (so an environment
  variable that changes it changes the key), the target ISA;
- what builds and runs the code: torch (version and commit), fbgemm_gpu, Python, the C++ compiler (its
  path and ``--version``), this CPU's flags (inductor picks vector code for the host it compiles on).

That suffices because the package is made by torch's deterministic lowering of exactly these inputs;
values could enter only through constants, and ``VALUE_FREE_OPTIONS`` switch off the two places inductor
(torch 2.13, freezing off as by default) reads them: inlining 0-d and small 1-d constants, and folding
single-element ones. As a check, a package that leaves out a constant the graph uses (one compiled in by
value) is not stored.

Layout: ``<folder>/<key>/`` holding ``model.pt2`` and ``entry.json`` (the key, the package's sha256 and
size, the constants it takes). An entry is written into a hidden temporary folder and renamed into
place, so readers see it whole or not at all; an export that misses while another process compiles the same
program waits for it (``compiling``: a lock per key) and takes its entry. An entry that fails its checks (sha256, size, its key, the
package's own archive) is logged, removed and rebuilt, never loaded. The folder is bounded to
``max_bytes`` (default 1 GiB), least recently used entries removed first (a hit refreshes its time).
A cache that cannot be read or written is logged and skipped: the export goes on without it.
"""

import fcntl
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

import fbgemm_gpu
import torch
import torch._inductor.config
from torch._inductor.cpp_builder import get_cpp_compiler

from recship.export.aoti import cpu_flags

log = logging.getLogger(__name__)

FORMAT = 1  # of an entry (entry.json's "format"); another number is a miss
MAX_BYTES = 1 << 30  # default bound of a cache folder
PACKAGE = "model.pt2"
ENTRY = "entry.json"
# inductor settings under which it reads no constant's value (see the module's docstring): with its defaults, 0-d and
# 1-d <= 8-element constants (a DLRM's last bias) are inlined into the code and single-element ones may be folded,
# so a retrained model would need another compile
VALUE_FREE_OPTIONS: Dict[str, object] = {"always_keep_tensor_constants": True, "joint_graph_constant_folding": False}


def default_folder() -> Path:
    """``$RECSHIP_CACHE_DIR``, else ``$XDG_CACHE_HOME/recship/aoti`` (``~/.cache/recship/aoti``)."""
    if os.environ.get("RECSHIP_CACHE_DIR"):
        return Path(os.environ["RECSHIP_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "recship" / "aoti"


def resolve(setting: Union[bool, str, os.PathLike, None]) -> Optional["CompileCache"]:
    """The cache ``ExportConfig.compile_cache`` names: True the default folder, a path that folder, False none."""
    if setting is False or setting is None:
        return None
    return CompileCache(default_folder() if setting is True else Path(setting))


@dataclass
class Hit:
    """A cache entry that passed its checks: the package's bytes and the constants it takes at load (their names)."""

    package: bytes
    constant_fqns: List[str]
    folder: Path


class CompileCache:
    """Compiled model.pt2 packages in ``folder`` by ``program_key``; see the module's docstring."""

    def __init__(self, folder: Path, max_bytes: int = MAX_BYTES) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes

    def get(self, key: str) -> Optional[Hit]:
        """The entry of ``key``, or None: absent, unreadable, or corrupt (then removed, and logged)."""
        entry = self.folder / key
        try:
            # both files through one handle of the folder: one entry's, even if it is removed and stored again meanwhile
            folder = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._refuse(entry, f"{type(e).__name__}: {e}")
            return None
        try:
            meta = json.loads(_read(ENTRY, folder))
            package = _read(PACKAGE, folder)
        except FileNotFoundError:  # an entry being removed
            return None
        except (OSError, ValueError) as e:  # unreadable, or entry.json is not JSON
            self._refuse(entry, f"{type(e).__name__}: {e}")
            return None
        finally:
            os.close(folder)
        problem = _problem(meta, package, key)
        if problem:
            self._refuse(entry, problem)
            return None
        try:
            os.utime(entry)  # recently used: pruned last
        except OSError:
            pass
        return Hit(package, list(meta["constants"]), entry)

    @contextmanager
    def compiling(self, key: str) -> Iterator[None]:
        """Held while this process compiles ``key``'s program: another export of the same program waits for it
        (then finds it in the cache) instead of compiling it too. An advisory lock (flock) on ``.lock-<key>``, released
        by the kernel however the holder ends; a cache folder that cannot take it is compiled into without it."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / f".lock-{key}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("model.pt2: another export is compiling the same program into %s; waiting for it", self.folder)
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (the lock file stays: removing it would let a third export lock another file of that name)

    def put(self, key: str, package: bytes, constant_fqns: List[str]) -> None:
        """Stores ``package`` under ``key`` (atomically; a racing export's entry is kept), then prunes the folder
        to ``max_bytes``. A cache that cannot be written is logged, not raised: the export does not need it."""
        tmp = self.folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        meta = {"format": FORMAT, "key": key, "sha256": hashlib.sha256(package).hexdigest(), "bytes": len(package),
                "constants": constant_fqns, "torch": torch.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            (tmp / PACKAGE).write_bytes(package)
            (tmp / ENTRY).write_text(json.dumps(meta, indent=1))
            try:
                os.rename(tmp, self.folder / key)  # a folder onto a missing name: atomic, and refused if it exists
            except OSError:
                if not (self.folder / key).is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # another export stored this key first: theirs stays
            self.prune(keep=key)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("compile cache %s not written (%s): the next export of this model compiles again", self.folder, e)

    def prune(self, keep: Optional[str] = None) -> List[str]:
        """Removes the least recently used entries (but ``keep``) until the folder holds at most ``max_bytes``, and
        the temporary folders of exports that are gone; returns the keys removed."""
        entries = []
        for path in self.folder.iterdir():
            if path.name.startswith(".lock-"):
                continue
            if path.name.startswith(".tmp-"):
                pid = path.name.split("-")[1]
                if pid.isdigit() and not _alive(int(pid)):
                    shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                entries.append((path.stat().st_mtime, sum(f.stat().st_size for f in path.iterdir()), path))
            except OSError:  # removed meanwhile
                continue
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path.name == keep:
                continue
            _remove(path)
            total -= size
            removed.append(path.name)
        return removed

    def _refuse(self, entry: Path, problem: str) -> None:
        log.warning("compile cache entry %s refused (%s): removed, model.pt2 is compiled afresh", entry, problem)
        _remove(entry)


def _problem(meta: Any, package: bytes, key: str) -> str:
    """What is wrong with an entry (its entry.json ``meta`` and package bytes) for ``key``, or ''."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"entry.json is not of format {FORMAT}"
    if meta.get("key") != key:
        return f"it holds key {str(meta.get('key'))[:16]}..., not {key[:16]}..."
    if len(package) != meta.get("bytes") or hashlib.sha256(package).hexdigest() != meta.get("sha256"):
        return f"model.pt2 is {len(package)} bytes with another sha256 than the {meta.get('bytes')} bytes stored"
    constants = meta.get("constants")
    if not isinstance(constants, list) or not all(isinstance(c, str) for c in constants):
        return "entry.json lists no constants"
    try:
        with zipfile.ZipFile(io.BytesIO(package)) as archive:
            names = archive.namelist()
            if archive.testzip() is not None or not any(n.endswith(".so") for n in names):
                return "model.pt2 is not a compiled package"
    except zipfile.BadZipFile as e:
        return f"model.pt2 is not a zip archive: {e}"
    return ""


def _read(name: str, folder: int) -> bytes:
    """The bytes of the file ``name`` in the open folder ``folder``."""
    fd = os.open(name, os.O_RDONLY, dir_fd=folder)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _remove(entry: Path) -> None:
    """Removes an entry: renamed away first (readers see it or nothing), then deleted."""
    gone = entry.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, gone)
    except OSError:  # removed by another process already
        return
    shutil.rmtree(gone, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def program_key(program: Any, options: Dict[str, object], target_isa: Optional[str]) -> Optional[str]:
    """The sha256 (hex) that names ``program``'s compiled package (a torch.export ExportedProgram compiled with
    inductor ``options`` for ``target_isa``; see the module's docstring for what it covers), or None for a
    program the cache does not take (a constant that is not a tensor)."""
    h = hashlib.sha256()

    def add(label: str, text: str) -> None:
        h.update(label.encode() + b"\0" + text.encode() + b"\0")

    add("recship compile cache", str(FORMAT))
    add("torch", f"{torch.__version__} {torch.version.git_version}")
    add("fbgemm_gpu", str(getattr(fbgemm_gpu, "__version__", "unknown")))
    add("python", f"{sys.version} {platform.machine()}")
    add("compiler", _compiler())
    add("cpu", " ".join(sorted(cpu_flags() or ())))
    add("target_isa", str(target_isa))
    add("options", repr(sorted(options.items())))
    # aot_inductor.metadata aside: AOTInductor fills that dict in place with the device and CPU it compiled for (each
    # in the key already), so it differs after a process's first compile; it labels the package, it is not code
    inductor = {k: v for k, v in torch._inductor.config.save_config_portable().items() if k != "aot_inductor.metadata"}
    add("inductor", repr(sorted(inductor.items())))
    for name, module in program.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            add(f"code {name}", module.code)
    add("signature", str(program.graph_signature))
    add("ranges", repr(sorted((str(s), str(r)) for s, r in program.range_constraints.items())))
    add("specs", "; ".join(f"{e.fqn} {e.signature.in_spec if e.signature else ''} {e.signature.out_spec if e.signature else ''}"
                           for e in program.module_call_graph))
    for node in program.graph.find_nodes(op="placeholder"):
        add(f"input {node.name}", _describe(node.meta.get("val")))
    constants = {**program.state_dict, **program.constants}
    for fqn in sorted(constants):
        value = constants[fqn]
        if not isinstance(value, torch.Tensor):
            return None
        add(f"constant {fqn}", f"{value.dtype} {tuple(value.shape)} {value.stride()}")
    return h.hexdigest()


def baked_constants(program: Any, taken: List[str]) -> List[str]:
    """The constants ``program``'s graph uses that its compiled package does not take at load (``taken``): compiled
    in by value, which the key does not cover (``program_key``); such a package is not cached. Empty tensors aside:
    they have no value (inductor makes its own, of the shape the key has)."""
    users = {n.name: len(n.users) for n in program.graph.find_nodes(op="placeholder")}
    constants = {**program.state_dict, **program.constants}
    used = {spec.target for spec in program.graph_signature.input_specs
            if spec.target in constants and users.get(spec.arg.name) and constants[spec.target].numel()}
    return sorted(used - set(taken))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {tuple(str(d) for d in value.shape)} {tuple(str(s) for s in value.stride())} {value.device}"
    return f"{type(value).__name__} {value}"


def _compiler() -> str:
    """The C++ compiler inductor runs: its path and the first line of its ``--version``."""
    path = get_cpp_compiler()
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    return f"{shutil.which(path) or path} {' '.join(version)}"
