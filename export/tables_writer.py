"""Writing tables.bin (export's side of ``recship.export.tables``, which maps it at load): each table's quantized
rows stored once, page-aligned, in the manifest's order (the layout: recship.contract.tables).

``StagedTables``: the file while export quantizes straight into it (``recship.quantize.HostRows``);
``TablesWriter``: the rest of the tensors appended, each segment hashed, the model files' buffers emptied while
they are saved; ``link_if_unchanged``: a retrain whose tables did not change links the previous version's file;
``pin_pt2``: the tables spec pinned inside model.pt2.
"""

import errno
import json
import mmap
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from recship.contract.tables import ALIGN, PINNED_NAME, TABLES_FILE, Segment, TableTensor, TablesError, TablesSpec, span
from recship.export.tables import DTYPES, hash_threads, map_tables, owner_of, sha256_of
from recship.oserrors import label, no_space
from recship.quantize.flat import FlatTBE

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# fbgemm's EmbeddingLocation: DEVICE 0 and HOST 3 rows live in ``weights``, MANAGED 1 / MANAGED_CACHING 2 in ``weights_uvm``
_UVM_PLACEMENTS = (1, 2)


def _flat_tbes(module: torch.nn.Module) -> Iterable[Tuple[str, Any]]:
    """(path, module) of each FlatTBE in an nn.Module or a TorchScript module."""
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
        with ThreadPoolExecutor(hash_threads()) as pool, open(path, "r+b" if placed else "wb") as f:
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
                hashing += [(seg, pool.submit(sha256_of, raw[seg.offset: seg.offset + seg.bytes])) for seg in entry.segments]
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
            owner, leaf = owner_of(self._scripted, path)
            t = getattr(owner, leaf)
            self._saved.append((owner, leaf, t))
            setattr(owner, leaf, torch.empty(0, dtype=t.dtype, device=t.device))

    def __exit__(self, *exc: Any) -> None:
        for owner, leaf, t in reversed(self._saved):
            setattr(owner, leaf, t)
        self._saved.clear()


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


def pin_pt2(path: Path, spec: TablesSpec) -> None:
    """Adds the tables spec to the model.pt2 at ``path`` as ``<root>/extra/PINNED_NAME`` (stored, not
    compressed); torch's loaders read an archive by name, so they ignore the extra entry."""
    with zipfile.ZipFile(path, "a") as archive:
        root = archive.namelist()[0].split("/", 1)[0]
        archive.writestr(f"{root}/extra/{PINNED_NAME}", spec.pinned())
