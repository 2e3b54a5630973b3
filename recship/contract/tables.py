"""The tables file's description, as the manifest's ``tables`` records it: ``TablesSpec`` (the file and its tensors),
``TableTensor`` (one tensor: its dtype, shape, stride and place in the file), ``Segment`` (one table's rows, or a
whole dense constant, with its sha256), the copy each model file carries (``pinned``, ``check_pinned``), and how a
table is named. Writing tables.bin and mapping it are export's (recship.export.tables: they need torch).

Layout: each tensor's bytes at an offset that is a multiple of ``ALIGN`` (4096), in the order of ``tensors``; zeros
between them. Each tensor is split into segments, one per table of a TBE (or the whole tensor for a dense constant),
each with its sha256, so a corrupt or swapped file is refused with the table named. The field rules are
manifest.schema.json's; the rules between fields are rules.py's tables-layout.

A table's names: a feature's ``table`` is ``<module path>.<table>`` (``table_name``); a block of a sharded table is
``<table>@<index>`` in its TBE (``shard_name``); ``split_table_name`` and ``split_shard`` read them back.
"""

import io
import json
import re
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

TABLES_FILE = "tables.bin"
ALIGN = 4096
PINNED_NAME = "recship/tables.json"  # inside model.pt (an extra file) and model.pt2 (an extra archive entry)
# bytes per element of each dtype a tensor may have (manifest.schema.json lists the same names)
DTYPE_SIZES = {"uint8": 1, "int8": 1, "int32": 4, "int64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "bool": 1}


class TablesError(ValueError):
    """A missing, truncated or corrupt tables file; the message names the table."""


def table_name(path: str, table: str) -> str:
    """A feature's table as the manifest names it: ``<module path>.<table>`` (the table alone at the model's root)."""
    return f"{path}.{table}" if path else table


def split_table_name(name: str) -> Tuple[str, str]:
    """(module path, table) of ``table_name``'s spelling."""
    path, _, table = name.rpartition(".")
    return path, table


def shard_name(table: str, index: int) -> str:
    """The TBE table of block ``index`` of a sharded ``table``."""
    return f"{table}@{index}"


def split_shard(name: str) -> Tuple[str, Optional[int]]:
    """(table, block index) of a TBE table's name; index None for a whole table (no "@" and 1-18 digits at its end)."""
    table, at, index = name.rpartition("@")
    if at and re.fullmatch(r"[0-9]{1,18}", index):
        return table, int(index)
    return name, None


def span(shape: List[int], stride: List[int]) -> int:
    """Elements a tensor of ``shape`` and ``stride`` reaches (0 if empty)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride))


@dataclass
class Segment:
    """Bytes [offset, offset + bytes) of one tensor (offset relative to the tensor): one table's
    rows (``rows`` of ``row_bytes``, padding included) or a whole dense constant."""

    name: str
    offset: int
    bytes: int
    sha256: str
    rows: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"name": self.name, "offset": self.offset, "bytes": self.bytes, "sha256": self.sha256}
        if self.rows is not None:
            out["rows"] = self.rows
        return out


@dataclass
class TableTensor:
    """One tensor of the tables file: at byte ``offset`` of the file, ``dtype`` [``shape``] with ``stride``.
    ``torchscript``: the model.pt buffer it fills (a dotted module path), ``aoti``: the model.pt2
    constant it is (its fqn); either may be None."""

    name: str
    dtype: str
    shape: List[int]
    stride: List[int]
    offset: int
    bytes: int
    segments: List[Segment]
    torchscript: Optional[str] = None
    aoti: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "stride": list(self.stride),
                "offset": self.offset, "bytes": self.bytes, "torchscript": self.torchscript, "aoti": self.aoti,
                "segments": [s.to_dict() for s in self.segments]}

    def key(self) -> Tuple[Any, ...]:
        """What makes two tensors interchangeable: their layout and every segment's checksum."""
        return (self.dtype, tuple(self.shape), tuple(self.stride), tuple((s.offset, s.bytes, s.sha256) for s in self.segments))


@dataclass
class TablesSpec:
    """The manifest's ``tables``: the file and its tensors."""

    file: str
    bytes: int
    tensors: List[TableTensor] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "tensors": [t.to_dict() for t in self.tensors]}

    def pinned(self) -> str:
        """The copy model.pt / model.pt2 carry (canonical JSON)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "TablesSpec":
        """The typed ``tables`` of a manifest the contract accepted (``check_manifest``)."""
        return TablesSpec(d["file"], d["bytes"], [
            TableTensor(t["name"], t["dtype"], list(t["shape"]), list(t["stride"]), t["offset"], t["bytes"],
                        [Segment(s["name"], s["offset"], s["bytes"], s["sha256"], s.get("rows")) for s in t["segments"]],
                        t.get("torchscript"), t.get("aoti"))
            for t in d["tensors"]
        ])


def pt2_pinned(data: bytes) -> Optional[str]:
    """The tables spec a model file's bytes carry, or None: model.pt2's entry (export's ``pin_pt2``), or model.pt's
    extra file (torch.jit.save stores it as ``<root>/extra/PINNED_NAME`` too)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            name = next((n for n in z.namelist() if n.endswith("/extra/" + PINNED_NAME)), None)
            return None if name is None else z.read(name).decode()
    except (zipfile.BadZipFile, UnicodeDecodeError):
        return None


def check_pinned(pinned: Optional[str], spec: TablesSpec, file: str) -> None:
    """The model file's copy of the tables spec must equal the manifest's (so a trusted model file pins the tables)."""
    if pinned is None or not pinned.strip():
        raise TablesError(f"{file} does not say which tables it was exported with ({PINNED_NAME} is missing)")
    try:
        theirs = json.loads(pinned)
    except ValueError:
        raise TablesError(f"{file}: its {PINNED_NAME} is not valid JSON") from None
    if theirs != json.loads(spec.pinned()):
        raise TablesError(f"{file} was exported with other tables than manifest.json describes: "
                          "the manifest or tables.bin belongs to another artifact")
