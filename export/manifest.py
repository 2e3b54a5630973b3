"""The artifact's manifest: its typed fields (``Manifest``, ``SparseFeature``, ``Sharding``, ``Sample``, ...), the
contract's checks (``check_manifest``: every field, its type and its rules, in the words the C++ loader uses too)
and file checksums. What ``recship.export.artifact`` loads and export writes. It uses no torch itself (the tables
spec it checks, ``recship.export.tables``, still imports it).

The manifest's JSON Schema is protos/recship/artifact/v1/manifest.schema.json; the C++ loader's checks
(cpp_loader/src/manifest.cpp) follow the same rules.
"""

import hashlib
import json
import re
import sys
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

from recship.contract import Shard
from recship.export.tables import TablesSpec, check_spec
from recship.names import DEVICES, ID_POLICIES

FORMAT = "recship.artifact/2"  # the tables live in tables.bin (export/tables.py)
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

    @staticmethod
    def current() -> "Versions":
        import fbgemm_gpu  # here: the manifest's types load without torch (a server reads them before any model)
        import torch

        return Versions(torch.__version__, getattr(fbgemm_gpu, "__version__", "unknown"), sys.version.split()[0])

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
        return _inputs(self.num_dense, self.weighted)

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

        out = Manifest(
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
        if m["inputs"] != out.inputs():
            raise ArtifactError(f"{Path(path)}/manifest.json: inputs must be {_compact(out.inputs())} (from num_dense and "
                                f"weighted), got {_compact(m['inputs'])[:200]}")
        return out

    @staticmethod
    def from_fields(fields: ModelFields, output_dims: Dict[str, List[int]], sample: Sample, model_sha256: Optional[str],
                    versions: Optional[Versions] = None, aoti: Optional[AotiSpec] = None,
                    tables: Optional[TablesSpec] = None, row_block: Optional[int] = None) -> "Manifest":
        """The manifest an exporter writes, checked as a loader would check it. ``fields``: what the exporter says
        of the model; ``output_dims``: output -> its shape after the batch dimension; ``versions``: default the
        running torch / fbgemm_gpu / python."""
        versions = versions or Versions.current()
        manifest = {
            "format": FORMAT,
            "model": fields.model.to_dict(),
            "inputs": _inputs(fields.num_dense, fields.weighted),
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


def _inputs(num_dense: Any, weighted: Any) -> Dict[str, Any]:
    return {
        "dense": {"dtype": "float32", "shape": ["B", num_dense]},
        "lengths": {"dtype": "int32", "shape": ["F*B"], "order": "feature-major, features in the order below"},
        "values": {"dtype": "int64", "shape": ["N"]},
        "weights": {"dtype": "float32", "shape": ["N"], "required": weighted},
    }


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
    """Raises ArtifactError, naming the field, unless the manifest has every field of the contract with its type.

    The rules are those of protos/recship/artifact/v1/manifest.schema.json (tests/export/test_manifest.py
    holds the two together); the C++ loader (cpp_loader/src/manifest.cpp check_manifest) checks the same, in
    the same words: a field that is absent "is missing", one of another JSON type "must be int, got str".
    """

    def fail(what: str) -> None:
        raise ArtifactError(f"{path}/manifest.json: {what}")

    def need(container: Dict[str, Any], key: str, kind: type, where: str) -> Any:
        if key not in container:
            fail(f"{where}{key} is missing")
        value = container[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            fail(f"{where}{key} must be {kind.__name__}, got {type(value).__name__}")
        return value

    def entry(container: Any, where: str) -> Dict[str, Any]:
        if not isinstance(container, dict):
            fail(f"{where} must be an object")
        return container

    def sizes(shape: Any) -> bool:
        return all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)

    if not isinstance(manifest, dict):
        fail("must be a JSON object")
    if need(manifest, "format", str, "") not in (FORMAT, FORMAT_V1):
        fail(f"unknown artifact format {manifest['format'][:80]!r}, expected {FORMAT!r}")
    if manifest["format"] == FORMAT:
        if "tables" not in manifest:
            fail("tables is missing")
        check_spec(manifest["tables"], fail)
    elif "tables" in manifest:
        fail(f"tables needs format {FORMAT!r}")
    # model.pt's checksum; an artifact without model.pt (TorchScript could not compile the model) has model.pt2's (aoti)
    if ("model_sha256" in manifest or "aoti" not in manifest) and not re.fullmatch(r"[0-9a-f]{64}", need(manifest, "model_sha256", str, "")):
        fail("model_sha256 must be 64 lowercase hex digits")
    if "row_block" in manifest and need(manifest, "row_block", int, "") < 0:
        fail("row_block must be >= 0")
    features = need(manifest, "sparse_features", list, "")
    names = set()
    for i, f in enumerate(features):
        where = f"sparse_features[{i}]."
        if not isinstance(f, dict):
            fail(f"sparse_features[{i}] must be an object")
        for key in ("name", "table", "pooling", "weight_type", "id_policy"):
            need(f, key, str, where)
        if need(f, "rows", int, where) <= 0 or need(f, "dim", int, where) <= 0:
            fail(f"{where}rows and dim must be positive")
        if f["id_policy"] not in ID_POLICIES:
            fail(f"{where}id_policy must be 'reject' or 'modulo'")
        if "weighted" in f:
            need(f, "weighted", bool, where)
        if "id_bound" in f:
            if not f["rows"] <= need(f, "id_bound", int, where) <= MAX_ID_BOUND:
                fail(f"{where}id_bound must lie in [rows, 2**63 - 1] = [{f['rows']}, {MAX_ID_BOUND}], got {f['id_bound']}")
            if f["id_policy"] != "reject":
                fail(f"{where}id_bound needs id_policy 'reject', got {f['id_policy']!r}")
        if f["name"] in names:
            fail(f"sparse feature {f['name']!r} appears twice")
        names.add(f["name"])
    if need(manifest, "num_dense", int, "") < 0:
        fail("num_dense must be >= 0")
    weighted = need(manifest, "weighted", bool, "")
    if features and weighted != any(f.get("weighted", weighted) for f in features):
        fail("weighted must say whether any sparse feature is weighted")
    for name, out in need(manifest, "outputs", dict, "").items():
        where = f"outputs[{name!r}]"
        dtype = need(entry(out, where), "dtype", str, where + ".")
        shape = need(out, "shape", list, where + ".")
        if not shape or shape[0] != "B" or not sizes(shape[1:]):
            fail(f"{where}.shape must be ['B', n, ...], got {_compact(shape)[:80]}")
        if dtype != "float32":
            fail(f"{where}.dtype must be 'float32'")
    sharding = need(manifest, "sharding", dict, "")
    if need(sharding, "device", str, "sharding.") not in DEVICES:
        fail("sharding.device must be 'cpu' or 'cuda'")
    if need(sharding, "num_devices", int, "sharding.") < 1 or need(sharding, "row_alignment", int, "sharding.") < 1:
        fail("sharding.num_devices and sharding.row_alignment must be >= 1")
    for i, s in enumerate(need(sharding, "shards", list, "sharding.")):
        need(entry(s, f"sharding.shards[{i}]"), "table", str, f"sharding.shards[{i}].")
        for key in ("index", "device", "row_offset", "rows", "col_offset", "cols"):
            if need(s, key, int, f"sharding.shards[{i}].") < 0:
                fail(f"sharding.shards[{i}].{key} must be >= 0")
    sample = need(manifest, "sample", dict, "")
    if need(sample, "batch_size", int, "sample.") < 1:
        fail("sample.batch_size must be >= 1")
    for group in ("inputs", "outputs"):
        for name, spec in need(sample, group, dict, "sample.").items():
            where = f"sample.{group}[{name!r}]."
            file = need(entry(spec, where[:-1]), "file", str, where)
            parts = PurePosixPath(file).parts
            if not parts or file.startswith("/") or ".." in parts or "\\" in file:  # nothing outside the artifact
                fail(f"{where}file must be a relative path inside the artifact, got {file[:80]!r}")
            if need(spec, "dtype", str, where) not in SAMPLE_DTYPES:
                fail(f"{where}dtype must be one of {sorted(SAMPLE_DTYPES)}")
            if not sizes(need(spec, "shape", list, where)):
                fail(f"{where}shape must be a list of sizes")
    for name in ("dense", "lengths", "values"):
        if name not in sample["inputs"]:
            fail(f"sample.inputs[{name!r}] is missing")
    _check_sample_spec(manifest, fail)
    if manifest["format"] == FORMAT:
        _check_table_rows(manifest, fail)
    model = need(manifest, "model", dict, "")
    need(model, "name", str, "model.")
    need(model, "version", int, "model.")
    need(model, "kind", str, "model.")
    inputs = need(manifest, "inputs", dict, "")
    for key in ("dense", "lengths", "values", "weights"):
        need(inputs, key, dict, "inputs.")
    versions = need(manifest, "versions", dict, "")
    for key in ("torch", "fbgemm_gpu", "python"):
        need(versions, key, str, "versions.")
    if not all(isinstance(lib, str) and lib not in ("", ".", "..") and "/" not in lib and "\\" not in lib
               for lib in need(manifest, "op_libraries", list, "")):
        fail("op_libraries must be a list of file names")
    need(manifest, "quantization", dict, "")
    need(manifest, "validation", dict, "")
    if "aoti" in manifest:
        aoti = need(manifest, "aoti", dict, "")
        if need(aoti, "file", str, "aoti.") != "model.pt2":
            fail("aoti.file must be 'model.pt2'")
        if not re.fullmatch(r"[0-9a-f]{64}", need(aoti, "sha256", str, "aoti.")):
            fail("aoti.sha256 must be 64 lowercase hex digits")
        for key in ("target_isa", "torch"):
            need(aoti, key, str, "aoti.")
        for key, span in need(aoti, "dynamic", dict, "aoti.").items():
            if not (isinstance(span, list) and len(span) == 2 and sizes(span) and span[0] <= span[1]):
                fail(f"aoti.dynamic[{key!r}] must be [min, max] sizes")
        order = need(aoti, "input_order", list, "aoti.")
        want = ["dense", "lengths", "values"] + (["weights"] if weighted else [])  # model.pt2's flat call signature
        if order != want:
            fail(f"aoti.input_order must be {_compact(want)}, got {_compact(order)}")
        named = need(aoti, "output_order", list, "aoti.")
        if not all(isinstance(n, str) for n in named) or sorted(named) != sorted(manifest["outputs"]):
            fail("aoti.output_order must name every output once")
        if "compile_seconds" not in aoti:
            fail("aoti.compile_seconds is missing")
        if not isinstance(aoti["compile_seconds"], (int, float)) or isinstance(aoti["compile_seconds"], bool):
            fail("aoti.compile_seconds must be a number")
        unknown = sorted(set(aoti) - {f.name for f in dataclasses.fields(AotiSpec)})
        if unknown:
            fail(f"aoti has unknown fields {unknown}")


def _compact(value: Any) -> str:
    """A JSON value as the C++ loader's messages print it (nlohmann's dump(): compact, keys sorted)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _check_sample_spec(m: Dict[str, Any], fail: Callable[[str], None]) -> None:
    """The sample is one request of this model and its outputs: each tensor's dtype and shape follow from
    the manifest (so its files' sizes do too). The C++ loader's check_manifest says the same words."""
    sample, b = m["sample"], m["sample"]["batch_size"]
    inputs, outputs = sample["inputs"], sample["outputs"]
    unknown = sorted(set(inputs) - {"dense", "lengths", "values", "weights"})
    if unknown:
        fail(f"sample.inputs has unknown inputs {unknown}")
    if m["weighted"] != ("weights" in inputs):
        fail("sample.inputs['weights'] is missing (the model is weighted)" if m["weighted"] else
             "sample.inputs['weights'] is given, but the model is unweighted")

    def need(group: str, name: str, dtype: str, shape: Optional[List[int]], what: str) -> None:
        spec = sample[group][name]  # shape None: any one dimension
        if spec["dtype"] != dtype or (spec["shape"] != shape if shape is not None else len(spec["shape"]) != 1):
            fail(f"sample.{group}[{name!r}] must be {dtype} {shape if shape is not None else '[N]'} ({what}), "
                 f"got {spec['dtype']} {spec['shape']}")

    need("inputs", "dense", "float32", [b, m["num_dense"]], "batch_size, num_dense")
    need("inputs", "lengths", "int32", [len(m["sparse_features"]) * b], "features x batch_size")
    need("inputs", "values", "int64", None, "one dimension")
    values = inputs["values"]["shape"]
    if "weights" in inputs:
        need("inputs", "weights", "float32", values, "one per value")
    if sorted(outputs) != sorted(m["outputs"]):
        fail(f"sample.outputs must hold every output, {sorted(m['outputs'])}, got {sorted(outputs)}")
    for name in sorted(outputs):
        need("outputs", name, "float32", [b, *m["outputs"][name]["shape"][1:]], "batch_size, the output's shape")


def _check_table_rows(m: Dict[str, Any], fail: Callable[[str], None]) -> None:
    """Each sparse feature's rows (the bound requests are validated by) are the rows tables.bin holds of its
    table: segments named ``<table>`` or ``<table>@<shard>`` in a tensor of its collection (``model.<path>.``,
    for a table named ``<path>.<table>``; the model files pin that list): all of them (row-wise) or each of
    them (table- and column-wise). A table no segment names is not checked."""
    held: Dict[Tuple[str, str], List[int]] = {}
    for t in m["tables"]["tensors"]:
        for seg in t["segments"]:
            table, at, index = seg["name"].rpartition("@")
            if not (at and re.fullmatch(r"[0-9]+", index)):
                table = seg["name"]
            if seg.get("rows") is not None:
                held.setdefault((t["name"], table), []).append(seg["rows"])
    for i, f in enumerate(m["sparse_features"]):
        path, _, table = f["table"].rpartition(".")
        rows = [r for (tensor, name), rs in held.items() if name == table and tensor.startswith(f"model.{path}." if path else "")
                for r in rs]
        if rows and f["rows"] != sum(rows) and any(r != f["rows"] for r in rows):
            fail(f"sparse_features[{i}].rows is {f['rows']}, but tables holds {'+'.join(map(str, rows))} rows "
                 f"of its table {f['table']!r}")


def file_sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
