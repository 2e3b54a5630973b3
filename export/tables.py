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

Loading maps the file read-only and copy-on-write (``torch.from_file(shared=False)``:
MAP_PRIVATE): the rows live in the page cache, one copy shared by every process that maps
the file, and never on the heap; verifying reads each segment once, in parallel, and a
process does not verify the same file (device, inode, size, mtime) twice. A tensor whose
segments' sha256s equal those of a tensor another loaded version already uses is taken from
that version once this version's own file has verified: two versions with equal tables share
their pages.

model.pt and model.pt2 each carry a copy of the tensor list with its checksums
(``PINNED_NAME``), so an allow-listed model file pins the tables as it did when they were
inside it.
"""

import errno
import hashlib
import json
import math
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from recship.contract.tables import ALIGN, PINNED_NAME, TABLES_FILE, Segment, TableTensor, TablesError, TablesSpec, span
from recship.oserrors import label, no_space

# the dtypes' torch types (the contract names them, with their sizes: recship.contract.tables.DTYPE_SIZES)
DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "float32": torch.float32,
          "float16": torch.float16, "bfloat16": torch.bfloat16, "bool": torch.bool}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# fbgemm's EmbeddingLocation: DEVICE 0 and HOST 3 rows live in ``weights``, MANAGED 1 / MANAGED_CACHING 2 in ``weights_uvm``
_UVM_PLACEMENTS = (1, 2)


def _flat_tbes(module: torch.nn.Module) -> Iterable[Tuple[str, Any]]:
    """(path, module) of each FlatTBE in an nn.Module or a TorchScript module."""
    from recship.quantize.flat import FlatTBE

    for path, m in module.named_modules():
        if isinstance(m, FlatTBE) or getattr(m, "original_name", None) == "FlatTBE":
            yield path, m


def _tbe_segments(tbe: Any, uvm: bool, total: int) -> List[Tuple[str, int, int, int]]:
    """(table name, start, end, rows) of each table whose rows live in the TBE's ``weights``
    (``uvm`` False) or ``weights_uvm``, in offset order; together they cover [0, total)."""
    # weights_offsets and weights_placements have one entry per feature (a table looked up by two features has
    # two): a table's are its first feature's
    placements = [int(p) for p in tbe.weights_placements.tolist()]
    offsets = [int(o) for o in tbe.weights_offsets.tolist()]
    names, rows, first = list(tbe.table_names), list(tbe.table_rows), list(tbe.table_first_feature)
    # at one offset, the table with fewer rows first: a table of no rows has its next one's offset, and must not
    # take that table's bytes
    mine = sorted((offsets[first[t]], rows[t], names[t]) for t in range(len(names)) if (placements[first[t]] in _UVM_PLACEMENTS) == uvm)
    out = []
    for k, (start, n, name) in enumerate(mine):
        end = mine[k + 1][0] if k + 1 < len(mine) else total
        out.append((name, start, end, n))
    if out and out[0][1] != 0:  # bytes before the first table: its own segment, still checked
        out.insert(0, ("(padding)", 0, out[0][1], 0))
    return out


def _hash(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()  # hashlib releases the GIL for large buffers: threads hash in parallel


def _threads() -> int:
    from recship.cpus import usable_cpus  # the affinity mask, capped by the cgroup CPU quota

    return usable_cpus()


class StagedTables:
    """tables.bin while export fills it: TBE rows are allocated in it (``allocate``, for
    ``recship.quantize.HostRows``, which export_any_model hands the quantizer), each a writable shared mapping of a page-aligned
    region, so rows are quantized straight into the page cache and never copied into the file.
    ``TablesWriter.write`` then only appends the tensors not already in it."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.size = 0
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._regions: List[Tuple[int, int, int]] = []  # (address, bytes, offset in the file)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A zero-filled uint8 tensor [nbytes] whose bytes are the file's at a new aligned offset."""
        offset = _align(self.size)
        # the disk space is taken now: a full disk fails here (OSError ENOSPC, saying the bytes needed and
        # free), not with a SIGBUS when a mapped page is first written; the new bytes read as zeros
        _reserve(self._fd, self.path, self.size, offset + nbytes - self.size, "quantizing the tables into it")
        self.size = offset + nbytes
        region = torch.frombuffer(mmap.mmap(self._fd, nbytes, offset=offset), dtype=torch.uint8)  # lives as long as the tensor
        self._regions.append((region.data_ptr(), nbytes, offset))
        return region

    def offset_of(self, t: torch.Tensor) -> Optional[int]:
        """The file offset of a CPU tensor that spans exactly one whole region, else None."""
        if t.device.type != "cpu":
            return None
        nbytes = t.element_size() * span(list(t.shape), list(t.stride()))
        for address, size, offset in self._regions:
            if t.data_ptr() == address and nbytes == size:
                return offset
        return None

    def regions(self) -> List[int]:
        return [offset for _, _, offset in self._regions]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _reserve(fd: int, path: Path, start: int, nbytes: int, what: str) -> None:
    """Takes the disk space of ``nbytes`` from ``start`` in the open file ``path`` now, so that a full disk fails at
    once with the bytes needed and free (``recship.oserrors.no_space``), not part way through the writes."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, start, nbytes)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise label(e, what, path)
        raise label(no_space(path, nbytes), what) from None


class TablesWriter:
    """Collects an artifact's table tensors, then writes tables.bin and returns its ``TablesSpec``.

    ``add_tables(module, torchscript)`` takes every FlatTBE's rows from a TorchScript module (which
    shares them with the nn.Module it was scripted from) or the nn.Module torch.export takes; ``add_aoti(constants)`` the constants
    a model.pt2 compiled without them needs (a tensor already added is referenced, not added
    twice); ``write(folder)`` writes tables.bin and returns its spec; ``emptied(scripted)`` swaps the TorchScript buffers for empty
    placeholders while model.pt is saved.
    """

    def __init__(self) -> None:
        self._tensors: List[Tuple[TableTensor, torch.Tensor, List[Tuple[str, int, int, Optional[int]]]]] = []
        self._by_storage: Dict[Tuple[int, int, Tuple[int, ...], torch.dtype], TableTensor] = {}

    @staticmethod
    def _identity(t: torch.Tensor) -> Tuple[int, int, Tuple[int, ...], torch.dtype]:
        return (t.data_ptr(), t.numel(), tuple(t.stride()), t.dtype)

    def _add(self, name: str, t: torch.Tensor, parts: List[Tuple[str, int, int, Optional[int]]]) -> TableTensor:
        if t.dtype not in _DTYPE_NAMES:
            raise TablesError(f"{name}: dtype {t.dtype} cannot go into the tables file")
        entry = TableTensor(name, _DTYPE_NAMES[t.dtype], list(t.shape), list(t.stride()), 0,
                            t.element_size() * span(list(t.shape), list(t.stride())), [])
        self._tensors.append((entry, t, parts))
        self._by_storage[self._identity(t)] = entry
        return entry

    def add_tables(self, module: torch.nn.Module, torchscript: bool) -> None:
        """Every FlatTBE's rows of ``module`` (TorchScript, or the nn.Module torch.export takes), each table a
        segment; ``torchscript``: model.pt holds them as placeholders, filled from the file at load."""
        for path, tbe in _flat_tbes(module):
            for buffer, uvm in (("weights", False), ("weights_uvm", True)):
                t = getattr(tbe, buffer)
                if t.numel() == 0:
                    continue
                parts: List[Tuple[str, int, int, Optional[int]]] = [
                    (name, start, end, rows) for name, start, end, rows in _tbe_segments(tbe, uvm, t.numel())]
                entry = self._add(f"{path}.{buffer}", t, parts)
                if torchscript:
                    entry.torchscript = f"{path}.{buffer}"

    def add_aoti(self, constants: Dict[str, torch.Tensor]) -> None:
        """``constants``: fqn -> tensor, exactly those the compiled package asks for."""
        for fqn, t in constants.items():
            entry = self._by_storage.get(self._identity(t))
            if entry is None:
                entry = self._add(fqn, t, [(fqn, 0, t.element_size() * span(list(t.shape), list(t.stride())), None)])
            if entry.aoti is not None:  # one tensor serving as two constants: store it again under the second name
                entry = self._add(fqn, t.clone(), [(fqn, 0, t.element_size() * span(list(t.shape), list(t.stride())), None)])
            entry.aoti = fqn

    def write(self, folder: Path, staged: Optional[StagedTables] = None) -> TablesSpec:
        """Writes ``folder``/tables.bin and returns its spec: one pass over the tables, each tensor's
        segments hashed on worker threads while the next tensor is written.

        ``staged``: that file as export filled it. Tensors that are its regions stay where they
        are and the others are appended; if a region is left that no tensor uses (a module
        copied after quantizing), the file is written anew instead.
        """
        path = Path(folder) / TABLES_FILE
        placed: Dict[int, int] = {}  # id(entry) -> its offset in the staged file
        if staged is not None and staged.path == path:
            for entry, t, _ in self._tensors:
                offset = staged.offset_of(t)
                if offset is not None:
                    placed[id(entry)] = offset
            if sorted(placed.values()) != staged.regions():
                placed = {}
            staged.close()
            if not placed:
                path.unlink()  # regions still mapped keep their bytes until they are freed
        offset = staged.size if placed and staged is not None else 0
        hashing = []
        end = offset
        for entry, _, _ in self._tensors:
            if id(entry) not in placed:
                end = _align(end) + entry.bytes
        with ThreadPoolExecutor(_threads()) as pool, open(path, "r+b" if placed else "wb") as f:
            _reserve(f.fileno(), path, offset, end - offset, "writing the tables")
            f.seek(offset)
            for entry, t, parts in self._tensors:
                raw = _raw(t)
                if id(entry) in placed:
                    entry.offset = placed[id(entry)]
                else:
                    entry.offset = _align(offset)
                    f.write(b"\0" * (entry.offset - offset))
                    f.write(raw)
                    offset = entry.offset + entry.bytes
                entry.segments = [Segment(name, start, end - start, "", rows) for name, start, end, rows in parts]
                hashing += [(seg, pool.submit(_hash, raw[seg.offset: seg.offset + seg.bytes])) for seg in entry.segments]
            for seg, digest in hashing:
                seg.sha256 = digest.result()
        size = path.stat().st_size
        return TablesSpec(TABLES_FILE, size, sorted((entry for entry, _, _ in self._tensors), key=lambda e: e.offset))

    def emptied(self, scripted: torch.nn.Module) -> "_Emptied":
        return _Emptied(scripted, [e.torchscript for e, _, _ in self._tensors if e.torchscript])


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes a tensor spans in its storage (on the CPU), without a copy where it is already there."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    reach = span(list(t.shape), list(t.stride()))
    flat = torch.as_strided(t, (reach,), (1,)) if reach else t.reshape(0)
    return flat.contiguous().view(torch.uint8).numpy().data.cast("B")


class _Emptied:
    """Context: the TorchScript module's table buffers are empty placeholders (same dtype and device) inside."""

    def __init__(self, scripted: torch.nn.Module, paths: List[str]) -> None:
        self._scripted = scripted
        self._paths = paths
        self._saved: List[Tuple[Any, str, torch.Tensor]] = []

    def __enter__(self) -> None:
        for path in self._paths:
            owner, leaf = _owner(self._scripted, path)
            t = getattr(owner, leaf)
            self._saved.append((owner, leaf, t))
            setattr(owner, leaf, torch.empty(0, dtype=t.dtype, device=t.device))

    def __exit__(self, *exc: Any) -> None:
        for owner, leaf, t in reversed(self._saved):
            setattr(owner, leaf, t)
        self._saved.clear()


def _owner(module: Any, path: str) -> Tuple[Any, str]:
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
        stat = file.stat()
    except OSError as e:
        raise TablesError(f"{folder}: {spec.file} cannot be read ({e.strerror}): the artifact is incomplete") from None
    size = stat.st_size
    if size != spec.bytes:
        short = next((f"table {s.name!r} of {t.name} needs bytes up to {t.offset + s.offset + s.bytes}"
                      for t in spec.tensors for s in t.segments if t.offset + s.offset + s.bytes > size), None)
        raise TablesError(f"{file}: {size} bytes, the manifest says {spec.bytes}"
                          + (f" (truncated: {short})" if short else "") + "; re-copy or re-export the artifact")
    storage = torch.from_file(str(file), shared=False, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    views = {t.name: storage[t.offset: t.offset + t.bytes] for t in spec.tensors}
    if verify:
        identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with _LIVE_LOCK:
            done = set(_VERIFIED.get(identity, ()))
        jobs = [(t, s) for t in spec.tensors for s in t.segments if (t.offset + s.offset, s.bytes, s.sha256) not in done]

        def check(job: Tuple[TableTensor, Segment]) -> Optional[str]:
            t, s = job
            digest = _hash(views[t.name][s.offset: s.offset + s.bytes].numpy().data)
            if digest != s.sha256:
                what = f"table {s.name!r}" if s.rows is not None else f"constant {s.name!r}"
                return (f"{file}: {what} (bytes {t.offset + s.offset}..{t.offset + s.offset + s.bytes} of {t.name}) "
                        f"has sha256 {digest}, the manifest says {s.sha256}: the file is corrupt or from another artifact")
            return None

        with ThreadPoolExecutor(min(_threads(), len(jobs)) or 1) as pool:
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
            if verify and typed.numel() and typed.data_ptr() == views[t.name].data_ptr():  # a mapped view: shareable
                _LIVE[t.key()] = weakref.ref(typed)
        for key in [k for k, r in _LIVE.items() if r() is None]:
            del _LIVE[key]
    return out


def link_if_unchanged(folder: Path, spec: TablesSpec, previous: Path) -> bool:
    """Replaces ``folder``/tables.bin by a hard link to ``previous``/tables.bin when the previous
    version's manifest describes exactly these tables and its file verifies: a retrain that changed
    only the dense layers then costs no disk, and loaders that verified that file (same inode) do
    not read it again. Returns whether it linked; any problem (no such version, other tables, a
    corrupt file, a filesystem without hard links) keeps the file just written."""
    try:
        theirs = json.loads((previous / "manifest.json").read_bytes()).get("tables")
        if theirs != json.loads(spec.pinned()):
            return False
        map_tables(previous, spec)  # every segment's sha256, on the previous version's bytes
        link = Path(folder) / (TABLES_FILE + ".link")
        os.link(previous / TABLES_FILE, link)
        os.replace(link, Path(folder) / TABLES_FILE)
        return True
    except (OSError, ValueError):  # TablesError is a ValueError
        return False


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
            owner, leaf = _owner(module, t.torchscript)
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
    import ctypes

    import numpy as np

    out = {}
    for name, t in tensors.items():
        if t.device.type != "cpu" or t.numel() == 0:
            out[name] = t
            continue
        nbytes = t.element_size() * span(list(t.shape), list(t.stride()))
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(t.data_ptr()))
        out[name] = torch.as_strided(torch.from_numpy(raw).view(t.dtype), t.shape, t.stride())
    return out


def pin_pt2(path: Path, spec: TablesSpec) -> None:
    """Adds the tables spec to the model.pt2 at ``path`` as ``<root>/extra/PINNED_NAME`` (stored, not
    compressed); torch's loaders read an archive by name, so they ignore the extra entry."""
    import zipfile

    with zipfile.ZipFile(path, "a") as archive:
        root = archive.namelist()[0].split("/", 1)[0]
        archive.writestr(f"{root}/extra/{PINNED_NAME}", spec.pinned())
