"""The tables file written and mapped (torch): each table's quantized rows stored once, page-aligned, mapped at load.
Its description in the manifest (``TablesSpec``, its layout rules, the pinned copy) is the contract's:
recship.contract.tables.

An artifact of format ``recship.artifact/2`` keeps its large tensors in ``tables.bin``:
every ``FlatTBE``'s rows (``weights``, and ``weights_uvm`` where tables are placed in
managed memory) and, when it has a model.pt2, the other constants AOTInductor takes at
load (the dense layers' weights: small). model.pt holds those buffers as empty
placeholders and model.pt2 is compiled with its constants kept out of the package; both
take the tensors from the file when they load.

Layout: each tensor's bytes at an offset that is a multiple of ``ALIGN`` (4096), in the
order of the manifest's ``tables.tensors``; zeros between them. Each tensor is split into
segments, one per table of a TBE (or the whole tensor for a dense constant), each with its
sha256, so a corrupt or swapped file is refused with the table named.

Loading maps each tensor's pages of the file on their own, copy-on-write (MAP_PRIVATE, as
``torch.from_file(shared=False)``): the rows live in the page cache, one copy shared by every
process that maps the file, and never on the heap (but tensors smaller than a page, copied);
a tensor's mapping lives as long as the tensor; verifying reads each segment once, in parallel, and a
process does not verify the same file (device, inode, size, mtime) twice. A tensor whose
segments' sha256s equal those of a tensor another loaded version already uses is taken from
that version once this version's own file has verified: two versions with equal tables share
their pages.

model.pt and model.pt2 each carry a copy of the tensor list with its checksums
(``PINNED_NAME``), so an allow-listed model file pins the tables as it did when they were
inside it.
"""

import ctypes
import hashlib
import math
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch

from recship.contract.tables import Segment, TableTensor, TablesError, TablesSpec, span
from recship.cpus import usable_cpus

# the dtypes' torch types (the contract names them, with their sizes: recship.contract.tables.DTYPE_SIZES)
DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "float32": torch.float32,
          "float16": torch.float16, "bfloat16": torch.bfloat16, "bool": torch.bool}


def sha256_of(view: memoryview) -> str:
    """A segment's sha256 (hex)."""
    return hashlib.sha256(view).hexdigest()  # hashlib releases the GIL for large buffers: threads hash in parallel


def hash_threads() -> int:
    """Threads that hash segments: the usable CPUs (the affinity mask, capped by the cgroup CPU quota)."""
    return usable_cpus()


def owner_of(module: Any, path: str) -> Tuple[Any, str]:
    """(the module holding attribute ``path``, the attribute's name)."""
    *parents, leaf = path.split(".")
    for p in parents:
        module = getattr(module, p)
    return module, leaf


# tensors mapped and verified in this process, by TableTensor.key(): a version whose tables equal a live one's shares them
_LIVE: Dict[Tuple[Any, ...], "weakref.ref[torch.Tensor]"] = {}
# segments verified in this process, by the identity of the file that holds them (device, inode, size, mtime):
# the same file (a version loaded again, a tables.bin hard-linked into the next version) is not hashed twice
_VERIFIED: Dict[Tuple[int, int, int, int], set] = {}
_LIVE_LOCK = threading.Lock()


def map_tables(folder: Union[str, Path], spec: TablesSpec, verify: bool = True) -> Dict[str, torch.Tensor]:
    """name -> tensor of each tensor of ``folder``/tables.bin, mapped read-only (copy-on-write).

    With ``verify`` every segment's sha256 is checked (in parallel), unless this process already
    verified the same file (same device, inode, size and mtime). A tensor equal to one a loaded
    version already uses (same layout and checksums) is returned as that tensor, so the two
    share their pages and this file's mapping is dropped once checked.
    TablesError names the table of the first problem: the file missing, shorter or longer
    than the manifest says, or a segment whose bytes differ.
    """
    folder = Path(folder)
    file = folder / spec.file
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise TablesError(f"{folder}: {spec.file} cannot be read ({e.strerror}): the artifact is incomplete") from None
    try:
        return _map_verified(file, fd, os.fstat(fd), spec, verify)
    finally:
        os.close(fd)  # the mappings stay valid without it


def _map_verified(file: Path, fd: int, stat: os.stat_result, spec: TablesSpec, verify: bool) -> Dict[str, torch.Tensor]:
    """``map_tables`` of the open file ``fd`` (``file``, of ``stat``)."""
    size = stat.st_size
    if size != spec.bytes:
        short = next((f"table {s.name!r} of {t.name} needs bytes up to {t.offset + s.offset + s.bytes}"
                      for t in spec.tensors for s in t.segments if t.offset + s.offset + s.bytes > size), None)
        raise TablesError(f"{file}: {size} bytes, the manifest says {spec.bytes}"
                          + (f" (truncated: {short})" if short else "") + "; re-copy or re-export the artifact")
    # one mapping per tensor, not one of the whole file: a tensor another version shares (below) keeps its own pages
    # mapped, not this file's other tables; small ones (a TBE's offsets, equal in every retrain) are copies
    views = {t.name: _map(fd, t.offset, t.bytes) for t in spec.tensors}
    if verify:
        identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with _LIVE_LOCK:
            done = set(_VERIFIED.get(identity, ()))
        jobs = [(t, s) for t in spec.tensors for s in t.segments if (t.offset + s.offset, s.bytes, s.sha256) not in done]

        def check(job: Tuple[TableTensor, Segment]) -> Optional[str]:
            t, s = job
            digest = sha256_of(views[t.name][s.offset: s.offset + s.bytes].numpy().data)
            if digest != s.sha256:
                what = f"table {s.name!r}" if s.rows is not None else f"constant {s.name!r}"
                return (f"{file}: {what} (bytes {t.offset + s.offset}..{t.offset + s.offset + s.bytes} of {t.name}) "
                        f"has sha256 {digest}, the manifest says {s.sha256}: the file is corrupt or from another artifact")
            return None

        with ThreadPoolExecutor(min(hash_threads(), len(jobs)) or 1) as pool:
            problems = [p for p in pool.map(check, jobs) if p]
        if problems:
            raise TablesError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        with _LIVE_LOCK:
            _VERIFIED.setdefault(identity, set()).update((t.offset + s.offset, s.bytes, s.sha256) for t, s in jobs)
    out: Dict[str, torch.Tensor] = {}
    with _LIVE_LOCK:
        for t in spec.tensors:
            ref = _LIVE.get(t.key()) if verify else None
            live = ref() if ref is not None else None
            if live is not None:
                out[t.name] = live
                continue
            typed = _typed(views[t.name], t)
            out[t.name] = typed
            if verify and typed.numel() and typed.data_ptr() == views[t.name].data_ptr():  # not a copy: shareable
                _LIVE[t.key()] = weakref.ref(typed)
        for key in [k for k, r in _LIVE.items() if r() is None]:
            del _LIVE[key]
    return out


def _map(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of the open file ``fd`` from ``offset`` as a uint8 tensor: mapped copy-on-write on their own
    (the mapping goes, munmap, with the last tensor that views it), or read onto the heap where they are less than a
    page: a mapping would hold a page of the page cache for them, and keep the file's blocks on disk after it is
    deleted for as long as a version that shares them lives."""
    if nbytes < mmap.PAGESIZE:
        data = os.pread(fd, nbytes, offset)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts at a page; tensors start at ALIGN (4096)
    mapped = mmap.mmap(fd, offset + nbytes - start, offset=start, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=torch.uint8, offset=offset - start, count=nbytes)


def _typed(raw: torch.Tensor, t: TableTensor) -> torch.Tensor:
    """The uint8 bytes ``raw`` as the tensor ``t`` describes (a view where the layout allows)."""
    dtype = DTYPES[t.dtype]
    if math.prod(t.shape) == 0:
        return torch.empty_strided(t.shape, t.stride, dtype=dtype)
    flat = raw.view(dtype)
    return torch.as_strided(flat, t.shape, t.stride)


def attach_torchscript(module: Any, spec: TablesSpec, tensors: Dict[str, torch.Tensor], where: str) -> None:
    """Fills the empty placeholder buffers of a loaded model.pt with the mapped tensors (copied to the
    placeholder's device when that is not the CPU)."""
    for t in spec.tensors:
        if t.torchscript is None:
            continue
        try:
            owner, leaf = owner_of(module, t.torchscript)
            placeholder = getattr(owner, leaf)
        except AttributeError:
            raise TablesError(f"{where}: model.pt has no buffer {t.torchscript} for {t.name}") from None
        if not isinstance(placeholder, torch.Tensor) or placeholder.numel() != 0 or placeholder.dtype != DTYPES[t.dtype]:
            raise TablesError(f"{where}: model.pt's {t.torchscript} is not an empty {t.dtype} placeholder")
        value = tensors[t.name]
        setattr(owner, leaf, value if placeholder.device.type == "cpu" else value.to(placeholder.device))


def aoti_constants(spec: TablesSpec, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """fqn -> tensor of every constant model.pt2 takes from the tables file."""
    return {t.aoti: tensors[t.name] for t in spec.tensors if t.aoti is not None}


def unowned(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Aliases of CPU ``tensors`` that do not keep their memory alive: what AOTInductor's
    ``load_constants(user_managed=True)`` gets.

    torch 2.13's AOTI runtime takes a new reference to each user-managed constant and never drops
    it (``MaybeOwningAtenTensorHandle``), so handing it the mapped tensors themselves would keep
    every loaded version's tables mapped for the life of the process. The aliases it leaks own
    nothing; the caller keeps ``tensors`` alive exactly as long as the model that uses them.
    """
    out = {}
    for name, t in tensors.items():
        if t.device.type != "cpu" or t.numel() == 0:
            out[name] = t
            continue
        nbytes = t.element_size() * span(list(t.shape), list(t.stride()))
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(t.data_ptr()))
        out[name] = torch.as_strided(torch.from_numpy(raw).view(t.dtype), t.shape, t.stride())
    return out

