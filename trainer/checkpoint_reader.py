"""Reading recship checkpoints: their on-disk format and the single-process reader export uses.

``read_metadata`` checks a checkpoint folder (``recship.json`` + DCP's files) and
``CheckpointReader`` reads it back in one process without a process group, one
table at a time, so peak memory stays near the largest table. The collective
save and load of a running job are in ``recship.trainer.checkpoint``.

``CheckpointReader`` also reads a checkpoint TorchRec's DistributedModelParallel wrote:
DCP's files only, saved as ``dcp.save({"model": dmp.state_dict(), ...})`` (or
``dcp.save(dmp.state_dict())``), every table under ``<path>.embedding_bags.<table>.weight``
(see ``torchrec_metadata``). Such a checkpoint records no model: export names it (--model).
"""

import io
import json
import mmap
import os
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import IO, Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar, Union, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from recship.names import DLRM_ENTRY, EARLIER_DLRM_ENTRY
from recship.modules.embedding_configs import EmbeddingBagConfig
from recship.modules.types import DataType, PoolingType
from recship.trainer.planner.types import ShardingPlan

FORMAT = "recship.checkpoint/1"
META_FILE = "recship.json"
T = TypeVar("T")

# ShardedTensor (arbitrary shard offsets, which DTensor cannot express for our column
# blocks and single-rank table-wise shards) is marked for deprecation; DCP warns on every use.
_SHARDED_TENSOR_WARNING = "Please use DTensor instead and we are deprecating ShardedTensor"


def quiet_dcp(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` (a DCP call) without DCP's deprecation and no-process-group warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SHARDED_TENSOR_WARNING, category=FutureWarning)
        # single-process reads pass no_dist=True on purpose; DCP still warns about it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


class CheckpointError(ValueError):
    """A checkpoint that is missing, partial or corrupt; the message names the missing piece."""


def latest_checkpoint(root: Union[str, Path]) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (temporary directories are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = complete_checkpoints(root)
    return done[-1] if done else None


def complete_checkpoints(root: Union[str, Path]) -> List[Path]:
    """The complete checkpoints under ``root``, oldest first (saves in progress and killed ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir() and ".tmp-" not in p.name and (p / META_FILE).is_file()),
                  key=lambda p: p.name)


def read_metadata(path: Union[str, Path]) -> Dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise _without_meta(path)
    if not (path / ".metadata").is_file():
        raise _unfinished(path, "DCP's .metadata file is missing")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file} is corrupt: {e}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file}: unknown format {meta.get('format')!r}, expected {FORMAT!r}")
    entry = ((meta.get("config") or {}).get("entry_point") or {}).get("model")
    if entry == EARLIER_DLRM_ENTRY:
        raise CheckpointError(f"{path} holds the built-in DLRM of an earlier recship ({EARLIER_DLRM_ENTRY}), whose parameters "
                              f"had other names than today's ({DLRM_ENTRY}, TorchRec's DLRM): train it again with this version")
    return meta


_RECSHIP_KEYS = ("tables/", "dense/")  # the DCP keys of recship's state (TorchRec's are its modules' paths)
_WRITTEN_LAST = f"{META_FILE} is missing (a save writes it last, after DCP's files)"


def _unfinished(path: Path, missing: str) -> CheckpointError:
    """The error of a folder that looks like a checkpoint still being written, or a save or copy cut short."""
    save = " (a save writes step_N.tmp-<id> and renames it step_N once complete)" if ".tmp-" in path.name else ""
    return CheckpointError(f"{path} looks incomplete or still being written{save}: {missing}")


def _without_meta(path: Path) -> CheckpointError:
    """Why ``path``, a folder without recship.json, is no checkpoint to read: one being written (what it has, what
    is missing), or no checkpoint at all."""
    data = sorted(p.name for p in path.glob("*.distcp"))
    shown = ", ".join(data[:3]) + (f" and {len(data) - 3} more" if len(data) > 3 else "")
    if (path / ".metadata").is_file():
        if _recship_layout(path):
            return _unfinished(path, _WRITTEN_LAST)
        return CheckpointError(f"{path} is not a complete recship checkpoint: {META_FILE} is missing")
    if data:
        return _unfinished(path, f"it has DCP's data files ({shown}) but not DCP's .metadata, written after them, nor {META_FILE}")
    if ".tmp-" in path.name:
        return _unfinished(path, f"nothing of it is written yet: no DCP data file (*.distcp), no .metadata, no {META_FILE}")
    what = "it is empty" if not any(path.iterdir()) else f"it has no {META_FILE}, no DCP .metadata and no DCP data file (*.distcp)"
    return CheckpointError(f"{path} is not a checkpoint: {what}")


def _recship_layout(path: Path) -> bool:
    """Whether the DCP files in ``path`` hold recship's state (tables/... and dense/... keys), not TorchRec's."""
    try:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # a corrupt .metadata: what it holds is unknown
        return False
    return any(k.startswith(_RECSHIP_KEYS) for k in keys)


def load_tensors(state: Dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """Fills ``state`` (DCP key -> tensor) from the checkpoint at ``path``; CheckpointError if it cannot."""
    check_data_files(path)
    try:
        quiet_dcp(dcp.load, state, checkpoint_id=str(path), no_dist=no_dist)
    except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
        last = [line for line in str(e).strip().splitlines() if line.strip()][-1:]  # DCP's message carries each rank's traceback
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {last[0] if last else ''}") from e


def check_data_files(path: Path) -> None:
    """CheckpointError naming the first data file DCP's metadata refers to that is missing, or shorter than the
    bytes the metadata places in it (a copy cut short, a disk that filled up)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    ends: Dict[str, int] = {}
    for item in (md.storage_data or {}).values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name in sorted(ends):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path} is incomplete: data file {name} is missing")
        size = file.stat().st_size
        if size < ends[name]:
            raise CheckpointError(f"{file} is truncated: {size:,} bytes, the checkpoint's metadata places {ends[name]:,} bytes in it")


class CheckpointReader:
    """Reads a checkpoint in one process without a process group, one table at a time.

    ``tables()`` yields (module path, EmbeddingBagConfig, full float weight) so that
    peak memory stays near the largest table; ``dense_state_dict()`` returns the
    dense parameters; ``config`` and ``plan`` are what training stored.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        if not (self.path / META_FILE).is_file() and (self.path / ".metadata").is_file():
            self.meta = torchrec_metadata(self.path)
        else:
            self.meta = read_metadata(self.path)
        check_data_files(self.path)  # tables are mapped from the data files: one cut short would fault at the first read
        self._dense_prefix = self.meta.get("dense_prefix", "dense/")
        self.config = self.meta.get("config")
        self.plan = ShardingPlan.from_json(json.dumps(self.meta["plan"])) if self.meta.get("plan") else None
        self.step = self.meta["step"]
        self._metadata: Any = None  # DCP's .metadata, read on the first table
        self._reused = torch.empty(0)  # tables read with reuse=True that cannot be mapped as they are

    def table_configs(self) -> List[Tuple[str, EmbeddingBagConfig]]:
        """(module path, config) of every pooled table; an EmbeddingCollection's sharded tables come with the dense
        state (``dense_state_dict``), whole, as its replicated ones do."""
        out = []
        for key, t in self._pooled_tables():
            c = dict(t["config"])
            c["data_type"] = DataType(c["data_type"])
            c["pooling"] = PoolingType(c["pooling"])
            out.append((key.rpartition("/")[0], EmbeddingBagConfig(**c)))
        return out

    def _pooled_tables(self) -> List[Tuple[str, Dict[str, Any]]]:
        return [(key, t) for key, t in self.meta["tables"].items() if t.get("collection", "embedding_bags") == "embedding_bags"]

    def _sequence_tables(self) -> List[Tuple[str, Dict[str, Any]]]:
        """The sharded tables of EmbeddingCollections (their data-parallel ones are dense entries already)."""
        return [(key, t) for key, t in self.meta["tables"].items() if t.get("collection") == "embeddings" and not t["data_parallel"]]

    def tables(self) -> Iterator[Tuple[str, EmbeddingBagConfig, torch.Tensor]]:
        for (mpath, cfg), (key, t) in zip(self.table_configs(), self._pooled_tables()):
            yield mpath, cfg, self._load_table(mpath, cfg, key, t)

    def table(self, mpath: str, name: str, reuse: bool = False) -> torch.Tensor:
        """One table's full float weight: table ``name`` of the collection at module path ``mpath``.

        ``reuse``: the table may come back in a buffer that the next ``reuse=True`` call
        overwrites (for a caller that streams one table at a time: no new memory per table).
        """
        for (path, cfg), (key, t) in zip(self.table_configs(), self._pooled_tables()):
            if path == mpath and cfg.name == name:
                return self._load_table(mpath, cfg, key, t, reuse)
        raise CheckpointError(f"{self.path} has no table {mpath}/{name}")

    def _load_table(self, mpath: str, cfg: EmbeddingBagConfig, key: str, t: Dict[str, Any], reuse: bool = False) -> torch.Tensor:
        if "dcp_key" in t:
            name = t["dcp_key"]
        elif t["data_parallel"]:
            name = f"dense/{data_parallel_key(self.meta, mpath, cfg.name)}"
        else:
            name = f"tables/{key}/weight"
        shape = (cfg.num_embeddings, cfg.embedding_dim)
        mapped = _mapped_tensor(self.path, self._dcp_metadata(), name, shape, self._buffer if reuse else torch.empty)
        if mapped is not None:
            return mapped
        weight = torch.empty(shape)
        load_tensors({name: weight}, self.path, no_dist=True)
        return weight

    def _buffer(self, shape: Tuple[int, int]) -> torch.Tensor:
        """A float32 tensor [shape] in this reader's reused buffer (grown when too small)."""
        n = shape[0] * shape[1]
        if self._reused.numel() < n:
            self._reused = torch.empty(0)  # freed before the larger one is allocated
            self._reused = torch.empty(n)
        return self._reused[:n].view(shape)

    def _dcp_metadata(self) -> Any:
        if self._metadata is None:
            self._metadata = dcp.FileSystemReader(str(self.path)).read_metadata()
        return self._metadata

    def dense_state_dict(self) -> Dict[str, torch.Tensor]:
        tables = {data_parallel_key(self.meta, key.rpartition("/")[0], key.rpartition("/")[2])
                  for key, t in self.meta["tables"].items() if t["data_parallel"]}
        keys = [k for k in self.meta["dense_keys"] if k not in tables]
        shapes = _dcp_shapes(self.path)
        prefix = self._dense_prefix
        state = {f"{prefix}{k}": torch.empty(shapes[f"{prefix}{k}"][0], dtype=shapes[f"{prefix}{k}"][1]) for k in keys}
        load_tensors(state, self.path, no_dist=True)
        out = {k[len(prefix) :]: v for k, v in state.items()}
        for key, t in self._sequence_tables():  # whole, under the EmbeddingCollection's own key
            mpath, _, name = key.rpartition("/")
            weight = torch.empty(t["config"]["num_embeddings"], t["config"]["embedding_dim"])
            load_tensors({f"tables/{key}/weight": weight}, self.path, no_dist=True)
            out[f"{mpath}.embeddings.{name}.weight" if mpath else f"embeddings.{name}.weight"] = weight
        return out


_TORCHREC_TABLE = re.compile(r"^(?:(?P<module>.+)\.)?embedding_bags\.(?P<table>[^.]+)\.weight$")


def torchrec_metadata(path: Union[str, Path]) -> Dict[str, Any]:
    """What ``recship.json`` says, for a DCP checkpoint of TorchRec's layout (no recship.json).

    The model's state is the entries under "model." when there are any (``dcp.save({"model":
    dmp.state_dict(), "optim": ...})``), else every entry; in it each
    ``<module path>.embedding_bags.<table>.weight`` [rows, dim] is a table (sharded or not) and
    the other tensors are the dense state. The checkpoint holds no features, pooling or model:
    the tables' configs carry the name and shape only; the model that loads it has the rest.
    """
    path = Path(path)
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a corrupt .metadata: DCP raises what unpickling raises
        raise CheckpointError(f"cannot read {path}/.metadata: {type(e).__name__}: {e}") from None
    tensors = {k: item for k, item in md.state_dict_metadata.items() if hasattr(item, "size") and hasattr(item, "chunks")}
    root = "model." if any(k.startswith("model.") for k in tensors) else ""
    tables: Dict[str, Any] = {}
    dense: List[str] = []
    for key, item in tensors.items():
        if not key.startswith(root):
            continue
        name = key[len(root) :]
        m = _TORCHREC_TABLE.match(name)
        if m is None or len(item.size) != 2:
            dense.append(name)
            continue
        rows, dim = (int(n) for n in item.size)
        config = {"name": m["table"], "num_embeddings": rows, "embedding_dim": dim, "data_type": "FP32", "pooling": "SUM"}
        tables[f"{m['module'] or ''}/{m['table']}"] = {"config": config, "data_parallel": False, "dcp_key": key}
    if not tables:
        if any(k.startswith(_RECSHIP_KEYS) for k in tensors):  # recship's own layout, its metadata file not there yet
            raise _unfinished(path, _WRITTEN_LAST)
        raise CheckpointError(f"{path} has no {META_FILE} and no TorchRec table (<module>.embedding_bags.<table>.weight) in its DCP files")
    return {"format": "torchrec", "step": None, "config": None, "plan": None, "tables": tables,
            "dense_keys": sorted(dense), "dense_prefix": root}


def data_parallel_key(meta: Dict[str, Any], mpath: str, table: str) -> str:
    """The dense key of a data-parallel table: ``<module>.embedding_bags.<table>.weight`` (TorchRec's name), or
    ``<module>.data_parallel.<table>`` in checkpoints written before the sharded state_dict was TorchRec's."""
    prefix = f"{mpath}." if mpath else ""
    key = f"{prefix}embedding_bags.{table}.weight"
    return key if key in meta["dense_keys"] else f"{prefix}data_parallel.{table}"


def _dcp_shapes(path: Path) -> Dict[str, Tuple[torch.Size, torch.dtype]]:
    reader = dcp.FileSystemReader(str(path))
    md = reader.read_metadata()
    out = {}
    for key, item in md.state_dict_metadata.items():
        props = getattr(item, "properties", None)
        if hasattr(item, "size") and props is not None:
            out[key] = (item.size, props.dtype)
    return out


# ---------------------------------------------------------------------------
# tables mapped from DCP's files
# ---------------------------------------------------------------------------
#
# DCP's FileSystemWriter stores each tensor chunk as a torch.save zip at (offset, length) of a
# data file, its storage bytes uncompressed. dcp.load reads each chunk into a new buffer and
# then copies it into the destination: two copies of every float table.
# Mapping the storage bytes from the page cache instead costs a page table entry per page.


class _FileSlice(io.RawIOBase):
    """The bytes [offset, offset + length) of an open file, as a seekable read-only file (pread)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence] + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        data = os.pread(self._fd, n, self._offset + self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def _chunk_location(fd: int, offset: int, length: int) -> Optional[Tuple[int, torch.Tensor]]:
    """(file offset of the first element, an unfilled tensor of the chunk's shape/dtype/strides)
    for a chunk saved by torch.save at ``offset``; None for anything but one plain storage stored
    uncompressed (then dcp.load reads it)."""
    with torch.serialization.skip_data():  # the tensor's metadata, its storage left unread
        t = torch.load(cast(IO[bytes], _FileSlice(fd, offset, length)), map_location="cpu", weights_only=True)
    if not isinstance(t, torch.Tensor) or not t.is_contiguous():
        return None
    records = [z for z in zipfile.ZipFile(_FileSlice(fd, offset, length)).infolist() if "/data/" in z.filename]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    record = records[0]
    if record.file_size != t.untyped_storage().nbytes():
        return None
    header = os.pread(fd, 30, offset + record.header_offset)  # the local file header: its name and extra field lengths
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    data = offset + record.header_offset + 30 + name_len + extra_len
    return data + t.storage_offset() * t.element_size(), t


def _mapped_tensor(
    path: Path, metadata: Any, name: str, shape: Tuple[int, int], allocate: Callable[[Tuple[int, int]], torch.Tensor]
) -> Optional[torch.Tensor]:
    """DCP tensor ``name`` [shape] float32 mapped copy-on-write from the page cache (no read, no
    copy) when it is one chunk whose first element is 4-byte aligned, else copied once from the
    mapped chunks into ``allocate(shape)``; None when its chunks are not plain torch.save records
    (dcp.load reads it then)."""
    md = metadata.state_dict_metadata.get(name)
    if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != torch.float32 or tuple(md.size) != shape:
        return None
    pieces = []
    for chunk in md.chunks:
        info = metadata.storage_data.get(MetadataIndex(name, chunk.offsets))
        if info is None or info.transform_descriptors:
            return None
        try:
            fd = os.open(path / info.relative_path, os.O_RDONLY)
        except FileNotFoundError:
            return None  # dcp.load's path says which file is missing
        try:
            found = _chunk_location(fd, info.offset, info.length)
            if found is None or found[1].dtype != torch.float32 or tuple(found[1].shape) != tuple(chunk.sizes):
                return None
            start, like = found
            nbytes = like.numel() * 4
            page = start - start % mmap.ALLOCATIONGRANULARITY
            if nbytes == 0:
                view = torch.empty(like.shape)
            else:
                mapped = mmap.mmap(fd, start - page + nbytes, offset=page, access=mmap.ACCESS_COPY)  # keeps its own fd
                view = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=start - page)
        finally:
            os.close(fd)
        pieces.append((chunk, start, view))
    if len(pieces) == 1 and pieces[0][1] % 4 == 0 and pieces[0][2].numel():
        return pieces[0][2].view(torch.float32).view(shape)  # the mapping lives as long as the tensor
    weight = allocate(shape)  # misaligned floats would break vectorised kernels; several chunks are joined
    for chunk, _, view in pieces:
        rows, cols = (slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        weight[rows, cols].view(torch.uint8).copy_(view.view(len(range(rows.start, rows.stop)), -1))
    return weight
