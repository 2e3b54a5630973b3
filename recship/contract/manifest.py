"""The artifact's manifest: its typed fields (``Manifest``, ``ModelInfo``, ``SparseFeature``, ``Sharding`` and its
``Shard`` records, ``Sample``, ``AotiSpec``...), the contract's check (``check_manifest``: manifest.schema.json, then the
rules between fields of rules.py; the C++ loader obeys the same file in the same words), reading and writing
manifest.json, and file checksums. What export writes and every loader reads; no torch.
"""

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional, Union

from recship.contract.rules import derived_inputs, first_broken
from recship.contract.schema import problems
from recship.contract.tables import TablesSpec

FORMAT = "recship.artifact/2"  # the tables live in tables.bin (recship/contract/tables.py)
FORMAT_V1 = "recship.artifact/1"  # the tables inside model.pt / model.pt2: still loaded
# What a C++ process must dlopen (from fbgemm_gpu's folder, RTLD_NOW | RTLD_GLOBAL) before torch::jit::load:
# TorchScript resolves every fbgemm op of every method of the scripted TBE, and these libraries register them.
OP_LIBRARIES = ["fbgemm_gpu_tbe_common.so", "fbgemm_gpu_tbe_cache.so", "fbgemm_gpu_tbe_inference.so", "fbgemm_gpu_py.so"]
# The largest id_bound: every int64 id but INT64_MAX (TorchRec's default input_hash_size; its managed-collision
# modules mark an empty slot with INT64_MAX, so that raw id is no valid one)
MAX_ID_BOUND = 2**63 - 1
SAMPLE_DTYPES = ("float32", "int32", "int64")  # what the sample files may hold


class ArtifactError(ValueError):
    """A missing, tampered or inconsistent artifact; the message names the problem."""


@dataclass
class ModelInfo:
    """Which model this is. ``details``: the other keys as the exporter wrote them (``config``
    of a DLRM; ``class``, ``entry_point`` and ``config`` of any other module), kept verbatim."""

    name: str
    version: int
    kind: str  # "module": what every export writes (earlier artifacts may say "dlrm" or "embeddings")
    details: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "version": self.version, "kind": self.kind, **self.details}


@dataclass
class SparseFeature:
    """One input feature: its table (``rows`` x ``dim``, stored as ``weight_type``) and its id policy."""

    name: str
    table: str
    pooling: str  # "SUM" or "MEAN"
    dim: int
    rows: int
    weight_type: str  # INT8, INT4, INT2, FP8, FP16, FP32
    id_policy: str  # "reject": ids outside [0, id_bound) are refused; "modulo": id % rows
    weighted: bool  # whether its ids carry per-id weights
    # requests' ids lie in [0, id_bound) where the model remaps them before its lookup (a managed-collision module:
    # its raw-id range); None: in [0, rows). rows <= id_bound <= MAX_ID_BOUND, id_policy "reject" only
    id_bound: Optional[int] = None

    @property
    def bound(self) -> int:
        """The exclusive upper bound of the ids a request may send (``reject`` features): id_bound, else rows."""
        return self.rows if self.id_bound is None else self.id_bound

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "table": self.table, "pooling": self.pooling, "dim": self.dim, "rows": self.rows,
                "weight_type": self.weight_type, "id_policy": self.id_policy, "weighted": self.weighted,
                **({"id_bound": self.id_bound} if self.id_bound is not None else {})}


@dataclass
class OutputSpec:
    """One output: float32 [B, *dims]."""

    dims: List[int]
    dtype: str = "float32"

    @property
    def shape(self) -> List[Union[str, int]]:
        return ["B", *self.dims]

    def to_dict(self) -> Dict[str, Any]:
        return {"dtype": self.dtype, "shape": self.shape}


@dataclass
class Shard:
    """One block of one table, as ``sharding.shards`` records it: rows [row_offset, +rows), columns
    [col_offset, +cols), on device index ``device``."""

    table: str
    index: int
    device: int
    row_offset: int
    rows: int
    col_offset: int
    cols: int

    def to_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


@dataclass
class Sharding:
    device: str  # "cpu" or "cuda"
    num_devices: int
    row_alignment: int
    shards: List[Shard]

    def to_dict(self) -> Dict[str, Any]:
        return {"device": self.device, "num_devices": self.num_devices, "row_alignment": self.row_alignment,
                "shards": [s.to_dict() for s in self.shards]}


@dataclass
class ModelFields:
    """What an exporter says of the model it exported: the manifest's fields that depend on it (``Manifest.from_fields``
    adds the inputs, outputs, sample, releases, op libraries and checksums)."""

    model: ModelInfo
    num_dense: int
    weighted: bool  # any feature is weighted
    sparse_features: List[SparseFeature]
    sharding: Sharding
    quantization: Dict[str, Any]  # the QuantizationReport's to_dict()
    validation: Dict[str, Any]  # the exporter's validation report


@dataclass
class Versions:
    """The releases the artifact was built with (a loader refuses another torch)."""

    torch: str
    fbgemm_gpu: str
    python: str

    def to_dict(self) -> Dict[str, Any]:
        return {"torch": self.torch, "fbgemm_gpu": self.fbgemm_gpu, "python": self.python}


@dataclass
class SampleTensor:
    """A raw little-endian tensor file inside the artifact."""

    file: str  # relative to the artifact folder
    dtype: str  # float32, int32 or int64
    shape: List[int]

    def to_dict(self) -> Dict[str, Any]:
        return {"file": self.file, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass
class Sample:
    """One request (inputs dense [B, num_dense] float32, lengths [F * B] int32, values [N] int64,
    weights [N] float32 if weighted) and the outputs the exported model gave for it."""

    batch_size: int
    inputs: Dict[str, SampleTensor]
    outputs: Dict[str, SampleTensor]

    def to_dict(self) -> Dict[str, Any]:
        return {"batch_size": self.batch_size, "inputs": {k: v.to_dict() for k, v in self.inputs.items()},
                "outputs": {k: v.to_dict() for k, v in self.outputs.items()}}


@dataclass
class AotiSpec:
    """The manifest's ``aoti``: the AOTInductor package beside model.pt.

    ``target_isa``: the -march its kernels were compiled for (a CPU without it must not
    load it); ``torch``: the torch that compiled it (the only one that may load it);
    ``dynamic``: "<input>.<dim>" -> [min, max] sizes it accepts; ``input_order`` /
    ``output_order``: its flat call signature (weights last, only when weighted).
    """

    file: str
    sha256: str
    target_isa: str
    torch: str
    dynamic: Dict[str, List[int]]
    input_order: List[str]
    output_order: List[str]
    compile_seconds: float

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Manifest:
    """manifest.json, typed. ``quantization`` and ``validation`` are the exporter's reports, kept as written.

    ``Manifest.read(dir)`` / ``.write(dir)`` / ``.validate()``; ``from_dict`` / ``to_dict`` convert
    the JSON object exactly (``Manifest.from_dict(d).to_dict() == d`` for every valid manifest).
    """

    model: ModelInfo
    num_dense: int
    weighted: bool  # any feature is weighted: the model takes a weights tensor
    sparse_features: List[SparseFeature]
    outputs: Dict[str, OutputSpec]
    sharding: Sharding
    versions: Versions
    op_libraries: List[str]
    quantization: Dict[str, Any]
    validation: Dict[str, Any]
    sample: Sample
    model_sha256: Optional[str]  # model.pt's; None: the artifact has model.pt2 alone (TorchScript could not compile it)
    format: str = FORMAT
    aoti: Optional[AotiSpec] = None
    tables: Optional[TablesSpec] = None  # format 2: the tables file (None only in format 1 artifacts)
    # examples per forward (export/blocks.py: batch invariance); None (absent) or 0: whole batches, as artifacts
    # exported before it
    row_block: Optional[int] = None
    # sha256 of the manifest.json bytes this was read from (``Manifest.read``; None when built in memory):
    # what an allow-list names, and what the C++ front is told to load (serving/repository.py)
    sha256: Optional[str] = field(default=None, compare=False)

    @property
    def feature_names(self) -> List[str]:
        return [f.name for f in self.sparse_features]

    def inputs(self) -> Dict[str, Any]:
        """The model's input signature, as the manifest spells it (derived from num_dense and weighted)."""
        return derived_inputs(self.num_dense, self.weighted)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "format": self.format,
            "model": self.model.to_dict(),
            "inputs": self.inputs(),
            "num_dense": self.num_dense,
            "sparse_features": [f.to_dict() for f in self.sparse_features],
            "weighted": self.weighted,
            "outputs": {k: v.to_dict() for k, v in self.outputs.items()},
            "sharding": self.sharding.to_dict(),
            "versions": self.versions.to_dict(),
            "op_libraries": list(self.op_libraries),
            "quantization": self.quantization,
            "validation": self.validation,
            "sample": self.sample.to_dict(),
            **({"model_sha256": self.model_sha256} if self.model_sha256 is not None else {}),
            **({"aoti": self.aoti.to_dict()} if self.aoti is not None else {}),
            **({"tables": self.tables.to_dict()} if self.tables is not None else {}),
            **({"row_block": self.row_block} if self.row_block is not None else {}),
        }

    @staticmethod
    def from_dict(manifest: Any, path: Union[str, Path] = "artifact") -> "Manifest":
        """The typed manifest of a parsed manifest.json; ArtifactError names the first bad field."""
        check_manifest(manifest, path)
        m = manifest
        model = m["model"]
        details = {k: v for k, v in model.items() if k not in ("name", "version", "kind")}

        def tensors(group: Dict[str, Any]) -> Dict[str, SampleTensor]:
            return {k: SampleTensor(v["file"], v["dtype"], list(v["shape"])) for k, v in group.items()}

        return Manifest(
            model=ModelInfo(model["name"], model["version"], model["kind"], details),
            num_dense=m["num_dense"],
            weighted=m["weighted"],
            # a feature without "weighted" (artifacts before it was written per feature) takes the manifest's
            sparse_features=[
                SparseFeature(f["name"], f["table"], f["pooling"], f["dim"], f["rows"], f["weight_type"], f["id_policy"],
                              f.get("weighted", m["weighted"]), f.get("id_bound"))
                for f in m["sparse_features"]
            ],
            outputs={k: OutputSpec(list(v["shape"][1:]), v["dtype"]) for k, v in m["outputs"].items()},
            sharding=Sharding(m["sharding"]["device"], m["sharding"]["num_devices"], m["sharding"]["row_alignment"],
                              [Shard(*(s[f.name] for f in dataclasses.fields(Shard))) for s in m["sharding"]["shards"]]),
            versions=Versions(m["versions"]["torch"], m["versions"]["fbgemm_gpu"], m["versions"]["python"]),
            op_libraries=list(m["op_libraries"]),
            quantization=m["quantization"],
            validation=m["validation"],
            sample=Sample(m["sample"]["batch_size"], tensors(m["sample"]["inputs"]), tensors(m["sample"]["outputs"])),
            model_sha256=m.get("model_sha256"),
            format=m["format"],
            aoti=AotiSpec(**m["aoti"]) if "aoti" in m else None,
            tables=TablesSpec.from_dict(m["tables"]) if "tables" in m else None,
            row_block=m.get("row_block"),
        )

    @staticmethod
    def from_fields(fields: ModelFields, output_dims: Dict[str, List[int]], sample: Sample, model_sha256: Optional[str],
                    versions: Versions, aoti: Optional[AotiSpec] = None,
                    tables: Optional[TablesSpec] = None, row_block: Optional[int] = None) -> "Manifest":
        """The manifest an exporter writes, checked as a loader would check it. ``fields``: what the exporter says
        of the model; ``output_dims``: output -> its shape after the batch dimension; ``versions``: the torch,
        fbgemm_gpu and python it was built with."""
        manifest = {
            "format": FORMAT,
            "model": fields.model.to_dict(),
            "inputs": derived_inputs(fields.num_dense, fields.weighted),
            "num_dense": fields.num_dense,
            "sparse_features": [f.to_dict() for f in fields.sparse_features],
            "weighted": fields.weighted,
            "outputs": {k: OutputSpec(list(d)).to_dict() for k, d in output_dims.items()},
            "sharding": fields.sharding.to_dict(),
            "versions": versions.to_dict(),
            "op_libraries": list(OP_LIBRARIES),
            "quantization": fields.quantization,
            "validation": fields.validation,
            "sample": sample.to_dict(),
            **({"model_sha256": model_sha256} if model_sha256 is not None else {}),
            **({"aoti": aoti.to_dict()} if aoti is not None else {}),
            **({"tables": tables.to_dict()} if tables is not None else {}),
            **({"row_block": row_block} if row_block is not None else {}),
        }
        return Manifest.from_dict(manifest, "the exported artifact")

    @staticmethod
    def read(path: Union[str, Path], trusted: Optional[Collection[str]] = None) -> "Manifest":
        """The manifest of the artifact folder ``path``, checked; ArtifactError names the problem.

        ``trusted``: sha256s of manifest.json files allowed to load (None: any); the digest is of the
        very bytes parsed. ``.sha256`` is set to it."""
        raw = _manifest_bytes(path)
        digest = hashlib.sha256(raw).hexdigest()
        if trusted is not None and digest not in trusted:
            raise ArtifactError(untrusted_message(Path(path), digest, trusted))
        manifest = Manifest.from_dict(_parse_manifest(raw, path), path)
        manifest.sha256 = digest
        return manifest

    def write(self, path: Union[str, Path]) -> None:
        """Writes ``path``/manifest.json (after ``validate``)."""
        self.validate(path)
        (Path(path) / "manifest.json").write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False))  # JSON has no NaN

    def validate(self, path: Union[str, Path] = "artifact") -> None:
        """Raises ArtifactError naming the first field that breaks the contract (the rules of ``check_manifest``)."""
        check_manifest(self.to_dict(), path)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # Python's json reads NaN and Infinity; JSON (and the C++ loader) does not


def _manifest_bytes(path: Union[str, Path]) -> bytes:
    path = Path(path)
    try:
        return (path / "manifest.json").read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ArtifactError(f"{path}: not an artifact (manifest.json is missing)") from None
    except OSError as e:
        raise ArtifactError(f"{path}/manifest.json cannot be read: {e.strerror}") from None


def _parse_manifest(raw: bytes, path: Union[str, Path]) -> Any:
    try:
        return json.loads(raw, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ArtifactError(f"{Path(path)}/manifest.json is corrupt: {e}") from None


def untrusted_message(path: Path, digest: str, trusted: Collection[str]) -> str:
    """Why a manifest whose sha256 is ``digest`` may not load; names what to list where the allow-list
    names one of the version's model files instead (the meaning it had before it pinned manifests)."""
    text = f"{path}/manifest.json: sha256 {digest} is not in the trusted list"
    for name in ("model.pt", "model.pt2"):
        try:
            listed = file_sha256(path / name) in trusted
        except OSError:
            continue
        if listed:
            return (text + f" (the list names this version's {name}; it pins manifest.json, whose checksums pin every "
                    f"file of the version: list {digest}, e.g. sha256sum */*/manifest.json)")
    return text


def check_manifest(manifest: Any, path: Union[str, Path] = "artifact") -> None:
    """Raises ArtifactError unless ``manifest`` (parsed JSON) keeps the contract: manifest.schema.json, then the rules
    between fields (rules.py). The message names the file and the first field that breaks it ("sparse_features[0].rows
    is missing", "num_dense must be int, got str"), and how many more problems there are."""
    found = problems(manifest)
    if not found:
        broken = first_broken(manifest)
        found = [broken] if broken is not None else []
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ArtifactError(f"{path}/manifest.json: {found[0].message}{more}")


def file_sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
