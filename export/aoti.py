"""The AOTInductor artifact: ``model.pt2`` beside the TorchScript ``model.pt``; what loading it needs (its
compilation is ``recship.export.aoti_compile``'s, so a server imports no quantizer or trainer through this module).

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
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import fbgemm_gpu  # noqa: F401  (registers the fbgemm ops the packages call)
import torch
import torch.utils._pytree as pytree

from recship.export.tables import unowned

PORTABLE_ISA = "x86-64-v3"  # -march: AVX2 + FMA + BMI2
ISA_VECTOR_BITS = {"x86-64-v2": 128, "x86-64-v3": 256, "x86-64-v4": 512}  # -march: its vector width (cpp.simdlen)
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


def cpu_flags() -> Optional[set]:
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
    flags = cpu_flags() if needed is not None else None
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


@contextmanager
def quiet() -> Iterator[None]:
    """torch 2.13's own pytree deprecation warning (its treespec pickling), not the user's business."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        yield


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
    compiled = load(source)
    if constants is not None:
        try:
            compiled.load_constants(unowned(constants), check_full_update=True, user_managed=True)
        except RuntimeError as e:
            raise AotiError(f"{name}: its constants do not fit: {str(e).splitlines()[0]}") from e
    return compiled


def load(source: Union[Path, bytes]) -> Any:
    """torch's compiled model of a package, extracted into this process's folder and loaded from there.

    Not ``torch._inductor.aoti_load_package``: that extracts into a folder of its own in the system
    temp folder, kept while the model lives and left behind by a SIGKILL, and warns of an "AOTI_CPU_ISA
    mismatch" whenever the package targets less than the host's best ISA (the portable x86-64-v3
    on purpose; ``load_package`` has checked that this CPU runs it). torch's loader also takes an
    extracted package folder and leaves it to its owner; the shared library is mapped once loaded,
    so the folder is removed at once (a SIGKILL mid-load leaves it in ``process_folder``)."""
    folder = Path(tempfile.mkdtemp(prefix="aoti-", dir=process_folder()))
    try:
        try:
            with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source) as archive:
                archive.extractall(folder)
        except zipfile.BadZipFile as e:
            raise AotiError(f"{'the model.pt2 bytes' if isinstance(source, bytes) else source}: not a model.pt2 package: {e}") from None
        with quiet():
            return CompiledPackage(torch._C._aoti.AOTIModelPackageLoader(str(folder), "model", False, 1, -1))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class CompiledPackage:
    """A loaded package (``loader``: torch's AOTIModelPackageLoader), called with positional tensors as the module
    it was compiled from. torch's own wrapper (torch.export.pt2_archive._package.AOTICompiledModel) does the same,
    but importing its module imports torch._dynamo and sympy: 1.1 to 2 s of a server's start on 2 cores."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __call__(self, *args: Any) -> Any:
        out_spec = pytree.treespec_loads(self.loader.get_call_spec()[1])
        flat = [x for x in pytree.tree_flatten((args, {}))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), out_spec)

    def load_constants(self, constants: Dict[str, torch.Tensor], *, check_full_update: bool, user_managed: bool = False) -> None:
        """Takes ``constants`` (fqn -> tensor); ``user_managed``: their memory itself, which the caller keeps alive."""
        self.loader.load_constants(constants, False, check_full_update, user_managed)

    def get_constant_fqns(self) -> List[str]:
        return self.loader.get_constant_fqns()
