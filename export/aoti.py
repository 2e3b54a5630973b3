"""The AOTInductor artifact: ``model.pt2`` beside the TorchScript ``model.pt``.

torch.export captures the exported module (a ``FlatPooledLookup`` and the model's dense
layers: no TorchBind state, no KeyedJaggedTensor) with the batch size and the number of
ids dynamic, and AOTInductor compiles it into a package that runs from Python and from C++
(torch's ``AOTIModelPackageLoader``) with the same op libraries as TorchScript.

Traps this module handles:

- compiled kernels target one CPU: by default the portable ``x86-64-v3`` (AVX2, FMA;
  every x86 server since about 2015) with 256-bit vectors, not the build machine's
  ``-march=native``; the manifest records it and loaders refuse a package their CPU
  cannot run (``cpu_supports``), instead of dying of SIGILL;
- AOTI does not check input shapes or dtypes: callers validate requests before the model
  (the server and the C++ loader do; ``AotiModel`` does for Python callers);
- ids are checked inside by a tensor assert (the server and C++ loader validate first);
- torch's loader extracts each package into a temp folder of its own that a SIGKILLed process
  leaves behind, and warns "Device information mismatch for AOTI_CPU_ISA" whenever the package's
  ISA is not the host's best (x86-64-v3 on purpose): ``load_package`` extracts into this
  process's own folder (``process_folder``), removes the copy once loaded, and says in its own
  words, once, only what matters (``cpu_supports``: a package this CPU cannot run).
"""

import atexit
import fcntl
import io
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from recship.oserrors import write_bytes

PORTABLE_ISA = "x86-64-v3"  # -march: AVX2 + FMA + BMI2
_ISA_VECTOR_BITS = {"x86-64-v2": 128, "x86-64-v3": 256, "x86-64-v4": 512}
# CPU flags (/proc/cpuinfo) each -march level needs beyond the previous one
_ISA_FLAGS = {
    "x86-64-v2": ["sse4_2", "popcnt", "ssse3"],
    "x86-64-v3": ["sse4_2", "popcnt", "ssse3", "avx", "avx2", "bmi1", "bmi2", "fma", "movbe"],
    "x86-64-v4": ["sse4_2", "popcnt", "ssse3", "avx", "avx2", "bmi1", "bmi2", "fma", "movbe", "avx512f", "avx512bw", "avx512cd",
                  "avx512dq", "avx512vl"],
}


log = logging.getLogger(__name__)

_FOLDER_PREFIX = "recship-"  # process folders: recship-<pid>-<random> in the system temp folder
_folder_lock = threading.Lock()
_folder: Optional[Tuple[int, Path]] = None  # (pid, folder) of this process's folder, once made
_said_unsupported: set = set()  # the ISAs cpu_supports has already logged as unsupported


class AotiError(RuntimeError):
    """The AOTInductor package cannot be built or run here; the message says why."""


def compiler_available() -> bool:
    """Whether ``--format auto`` compiles model.pt2: a C++ compiler for AOTInductor is on PATH
    (``$CXX`` or g++) and the environment does not say ``RECSHIP_AOTI=0``."""
    import shutil

    if os.environ.get("RECSHIP_AOTI", "1") == "0":
        return False
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _cpu_flags() -> Optional[set]:
    """This CPU's flags (/proc/cpuinfo), or None where there is no /proc/cpuinfo."""
    if not Path("/proc/cpuinfo").exists():
        return None
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_supports(isa: str) -> Tuple[bool, str]:
    """(whether this CPU runs code built with -march=``isa``, the missing flags); unknown ISAs and
    non-Linux hosts are taken on trust. An unsupported ISA is logged once per process: model.pt2
    packages built for it do not run here (``--model-format auto`` serves model.pt instead)."""
    needed = _ISA_FLAGS.get(isa)
    flags = _cpu_flags() if needed is not None else None
    if needed is None or flags is None:
        return True, ""
    missing = " ".join(f for f in needed if f not in flags and not (f == "bmi1" and "bmi1" not in flags and "bmi2" in flags))
    if missing and isa not in _said_unsupported:
        _said_unsupported.add(isa)
        log.warning("this CPU lacks %s, which model.pt2 compiled for %s needs: such artifacts run from model.pt "
                    "(TorchScript) where the model format is auto, and are refused where it is aoti", missing, isa)
    return not missing, missing


def process_folder() -> Path:
    """This process's private folder (mode 0700), ``recship-<pid>-<random>`` in the system temp folder:
    model.pt2 packages are extracted there (``load_package``), and the server keeps the C++ front's
    files there. Made on first use, after the folders of processes that are gone are removed
    (``remove_abandoned``); removed at normal exit. A SIGKILLed process leaves it for the next one.

    The process holds a lock on it (flock, released by the kernel however the process ends), so a
    live owner is recognised even where its pid means nothing here (a temp folder shared across
    pid namespaces)."""
    global _folder
    with _folder_lock:
        if _folder is None or _folder[0] != os.getpid():  # (a forked child makes its own)
            remove_abandoned()
            folder = Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-"))
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # close-on-exec: children do not hold the lock
            fcntl.flock(fd, fcntl.LOCK_EX)
            atexit.register(_remove_folder, folder, fd, os.getpid())
            _folder = (os.getpid(), folder)
        return _folder[1]


def _remove_folder(folder: Path, fd: int, pid: int) -> None:
    if os.getpid() == pid:  # (not in a forked child that exits normally)
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


def remove_abandoned() -> List[Path]:
    """Removes the process folders (``process_folder``) of processes that are gone: their pid is not
    running and nobody holds their lock. Returns them. Other users' folders, links and other names
    are left alone."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{_FOLDER_PREFIX}*-*"):
        pid = folder.name[len(_FOLDER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, a link, not a folder
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner lives (in another pid namespace)
            continue
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        log.info("removed %s, left by process %s that did not exit normally", folder, pid)
        removed.append(folder)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@dataclass
class AotiPackage:
    """What ``compile_package`` built: the file, its dynamic ranges and how long it took."""

    path: Path
    target_isa: str
    dynamic: Dict[str, List[int]]  # input dim -> [min, max]
    compile_seconds: float
    size_bytes: int
    # fqn -> tensor of each constant the package takes at load (it was compiled without them)
    constants: Dict[str, torch.Tensor]


@contextmanager
def _quiet() -> Iterator[None]:
    """torch 2.13's own pytree deprecation warning (its treespec pickling), not the user's business."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        yield


@contextmanager
def _export_mode(module: nn.Module) -> Iterator[None]:
    """Flat lookups check ids with tensor asserts (not Python errors) while torch.export traces ``module``."""
    from recship.quantize.flat import IdCheck  # here: a server imports this module (loading model.pt2) without the quantizer

    lookups = [m for m in module.modules() if isinstance(m, IdCheck)]
    saved = [m.asserts for m in lookups]
    for m in lookups:
        m.asserts = True
    try:
        yield
    finally:
        for m, a in zip(lookups, saved):
            m.asserts = a


def compile_package(
    module: nn.Module,
    example: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
    num_features: int,
    path: Path,
    target_isa: Optional[str] = PORTABLE_ISA,
    max_batch: int = 1 << 16,
    max_ids: int = 1 << 30,
) -> AotiPackage:
    """torch.export + AOTInductor of ``module``'s forward(dense, lengths, values, weights) into ``path``.

    Args:
        example: one request (dense [B, num_dense], lengths [F*B] int32, values [N] int64,
            weights [N] float32 or None); B and N are dynamic in the package (any B in
            [1, max_batch], N in [0, max_ids]); whether weights are given is fixed.
        target_isa: -march of the compiled kernels (None: the build machine's, ``native``).

    The package holds no constants (``aot_inductor.package_constants_in_so`` off): the tables and
    the dense weights go into the artifact's tables file, and ``load_package`` takes them back.
    """
    from torch.export import Dim

    dense, lengths, values, weights = example
    if dense.shape[0] < 2 or values.shape[0] < 2:
        raise AotiError("the example request needs a batch of >= 2 and >= 2 ids (sizes 0 and 1 would be specialised)")
    batch = Dim("batch", min=1, max=max_batch)
    ids = Dim("ids", min=0, max=max_ids)
    dynamic = {
        "dense": {0: batch},
        "lengths": {0: num_features * batch},
        "values": {0: ids},
        "weights": None if weights is None else {0: ids},
    }
    start = time.perf_counter()
    module.eval()
    try:
        with _export_mode(module), torch.no_grad(), _quiet():
            program = torch.export.export(module, (dense, lengths, values, weights), dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # any capture failure ends with its reason, and the line of the user's code it came from
        from recship.trainer.entry_point import user_files, user_line

        where = user_line(e, user_files(module))
        raise AotiError(f"torch.export failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        + (f" (at {where})" if where else "")) from e
    # cpp.threads 1: inductor's own kernels run on one thread, their loops never split across threads. Left at its
    # default (the exporting machine's torch.get_num_threads()), a parallel reduction keeps one partial result per
    # thread in an array of that size, indexed by the running thread: a model exported on a 2-core machine wrote
    # past it and crashed any process that ran it with more intra-op threads (seen: the two-tower at 3 and 4), and
    # a float reduction's bits depended on the thread count. GEMMs (extern kernels) still use the caller's threads.
    options: Dict[str, object] = {"aot_inductor.package_constants_in_so": False, "cpp.threads": 1}
    if target_isa is not None:
        options["cpp.march"] = target_isa
        if target_isa in _ISA_VECTOR_BITS:
            options["cpp.simdlen"] = _ISA_VECTOR_BITS[target_isa]
    path.parent.mkdir(parents=True, exist_ok=True)
    # packaged into memory, then written: torch's zip writer aborts the process (std::terminate in a destructor)
    # when the disk fills under it, where Python's write raises ENOSPC
    package = io.BytesIO()
    try:
        with _quiet():
            torch._inductor.aoti_compile_and_package(program, package_path=package, inductor_configs=options)
    except OSError:  # the disk's (full, read-only), not the compiler's: said as such
        raise
    except Exception as e:
        raise AotiError(f"AOTInductor compilation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    write_bytes(path, package.getbuffer(), f"writing {path.name}")
    built = path
    seconds = time.perf_counter() - start
    return AotiPackage(
        Path(built), target_isa or "native",
        {"dense.0": [1, max_batch], "lengths.0": [num_features, num_features * max_batch], "values.0": [0, max_ids]},
        seconds, Path(built).stat().st_size, _needed_constants(Path(built), program),
    )


def _needed_constants(path: Path, program: Any) -> Dict[str, torch.Tensor]:
    """fqn -> tensor of the constants the compiled package at ``path`` asks for, from the exported program."""
    import fbgemm_gpu  # noqa: F401  (registers the fbgemm ops the package calls)

    available = {**program.state_dict, **program.constants}
    fqns = _load(path).get_constant_fqns()
    missing = [f for f in fqns if not isinstance(available.get(f), torch.Tensor)]
    if missing:
        raise AotiError(f"AOTInductor asks for constants the exported program lacks: {missing[:5]}")
    return {f: available[f] for f in fqns}


def load_package(source: Union[Path, bytes], target_isa: str, constants: Optional[Dict[str, torch.Tensor]] = None) -> Any:
    """The compiled model of the package ``source`` (its path, or its bytes), callable like the
    TorchScript one, positional tensors in, Dict[str, Tensor] out; AotiError if this CPU cannot
    run ``target_isa``.

    ``constants``: fqn -> tensor for a package compiled without its constants (every one it asks
    for). The package uses their memory, not copies (mapped tables stay mapped), through aliases
    that do not own it (``unowned``): the caller keeps ``constants`` alive as long as the model."""
    name = "the model.pt2 bytes" if isinstance(source, bytes) else str(source)
    ok, missing = cpu_supports(target_isa)
    if not ok:
        raise AotiError(f"{name} was compiled for {target_isa}; this CPU lacks {missing}: use model.pt (TorchScript)")
    compiled = _load(source)
    if constants is not None:
        from recship.export.tables import unowned

        try:
            compiled.load_constants(unowned(constants), check_full_update=True, user_managed=True)
        except RuntimeError as e:
            raise AotiError(f"{name}: its constants do not fit: {str(e).splitlines()[0]}") from e
    return compiled


def _load(source: Union[Path, bytes]) -> Any:
    """torch's compiled model of a package, extracted into this process's folder and loaded from there.

    Not ``torch._inductor.aoti_load_package``: that extracts into a folder of its own in the system
    temp folder, kept while the model lives and left behind by a SIGKILL, and warns of an "AOTI_CPU_ISA
    mismatch" whenever the package targets less than the host's best ISA (the portable x86-64-v3
    on purpose; ``load_package`` has checked that this CPU runs it). torch's loader also takes an
    extracted package folder and leaves it to its owner; the shared library is mapped once loaded,
    so the folder is removed at once (a SIGKILL mid-load leaves it in ``process_folder``)."""
    import fbgemm_gpu  # noqa: F401  (registers the fbgemm ops the package calls)
    from torch.export.pt2_archive._package import AOTICompiledModel

    folder = Path(tempfile.mkdtemp(prefix="aoti-", dir=process_folder()))
    try:
        try:
            with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source) as archive:
                archive.extractall(folder)
        except zipfile.BadZipFile as e:
            raise AotiError(f"{'the model.pt2 bytes' if isinstance(source, bytes) else source}: not a model.pt2 package: {e}") from None
        with _quiet():
            return AOTICompiledModel(torch._C._aoti.AOTIModelPackageLoader(str(folder), "model", False, 1, -1))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
