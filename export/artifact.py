"""The artifact contract: its manifest (typed), sample, checksum, and loading with a self-check.

An artifact is a folder: ``model.pt`` (TorchScript: forward(dense, lengths, values, weights)
-> Dict[str, Tensor]), optionally ``model.pt2`` (the same model compiled by AOTInductor,
described by the manifest's ``aoti``), ``manifest.json`` (``Manifest``; its JSON Schema is
protos/recship/artifact/v1/manifest.schema.json, which the C++ loader's checks follow too)
and ``sample/`` (one request and the outputs the exported model gave for it, as raw
little-endian tensors). Only torch is needed here (fbgemm_gpu when a model is loaded).

Loading an artifact runs its TorchScript, which is code: only load artifacts from
people you trust. The sha256 in the manifest sits beside the model in the same folder,
so it detects accidents (a truncated copy), not tampering; ``trusted`` (an allow-list
of model.pt sha256s kept elsewhere) pins what may load.
"""

import hashlib
import io
import json
import math
import re
import sys
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

import torch

from recship.export.tables import (PINNED_NAME, TablesError, TablesSpec, aoti_constants, attach_torchscript, check_pinned, check_spec,
                                   map_tables, pt2_pinned)

FORMAT = "recship.artifact/2"  # the tables live in tables.bin (export/tables.py)
FORMAT_V1 = "recship.artifact/1"  # the tables inside model.pt / model.pt2: still loaded
# What a C++ process must dlopen (from fbgemm_gpu's folder, RTLD_NOW | RTLD_GLOBAL) before torch::jit::load:
# TorchScript resolves every fbgemm op of every method of the scripted TBE, and these libraries register them.
OP_LIBRARIES = ["fbgemm_gpu_tbe_common.so", "fbgemm_gpu_tbe_cache.so", "fbgemm_gpu_tbe_inference.so", "fbgemm_gpu_py.so"]
ID_POLICIES = ("reject", "modulo")
DEVICES = ("cpu", "cuda")
_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64}


class ArtifactError(ValueError):
    """A missing, tampered or inconsistent artifact; the message names the problem."""


@dataclass
class ModelInfo:
    """Which model this is. ``details``: the other keys as the exporter wrote them (``config``
    of a DLRM; ``class``, ``entry_point`` and ``config`` of any other module), kept verbatim."""

    name: str
    version: int
    kind: str  # "dlrm", "embeddings" or "module"
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
    id_policy: str  # "reject": ids outside [0, rows) are refused; "modulo": id % rows
    weighted: bool  # whether its ids carry per-id weights

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "table": self.table, "pooling": self.pooling, "dim": self.dim, "rows": self.rows,
                "weight_type": self.weight_type, "id_policy": self.id_policy, "weighted": self.weighted}


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
    """One block of one table: rows [row_offset, +rows), columns [col_offset, +cols), on device index ``device``."""

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
class Versions:
    """The releases the artifact was built with (a loader refuses another torch)."""

    torch: str
    fbgemm_gpu: str
    python: str

    @staticmethod
    def current() -> "Versions":
        import fbgemm_gpu

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
    model_sha256: str
    format: str = FORMAT
    aoti: Optional[AotiSpec] = None
    tables: Optional[TablesSpec] = None  # format 2: the tables file (None only in format 1 artifacts)

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
            "model_sha256": self.model_sha256,
            **({"aoti": self.aoti.to_dict()} if self.aoti is not None else {}),
            **({"tables": self.tables.to_dict()} if self.tables is not None else {}),
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
                              f.get("weighted", m["weighted"]))
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
            model_sha256=m["model_sha256"],
            format=m["format"],
            aoti=AotiSpec(**m["aoti"]) if "aoti" in m else None,
            tables=TablesSpec.from_dict(m["tables"]) if "tables" in m else None,
        )
        if m["inputs"] != out.inputs():
            raise ArtifactError(f"{path}/manifest.json: inputs must be {out.inputs()} (from num_dense and weighted), "
                                f"got {str(m['inputs'])[:200]}")
        return out

    @staticmethod
    def from_fields(fields: Dict[str, Any], output_dims: Dict[str, List[int]], sample: Sample, model_sha256: str,
                    versions: Optional[Versions] = None, aoti: Optional[AotiSpec] = None,
                    tables: Optional[TablesSpec] = None) -> "Manifest":
        """The manifest an exporter writes. ``fields``: model, num_dense, weighted, sparse_features,
        sharding, quantization and validation as JSON objects; ``output_dims``: output -> its shape
        after the batch dimension; ``versions``: default the running torch / fbgemm_gpu / python."""
        versions = versions or Versions.current()
        weighted = fields["weighted"]
        manifest = {
            "format": FORMAT,
            "model": fields["model"],
            "inputs": _inputs(fields["num_dense"], weighted),
            "num_dense": fields["num_dense"],
            "sparse_features": fields["sparse_features"],
            "weighted": weighted,
            "outputs": {k: OutputSpec(list(d)).to_dict() for k, d in output_dims.items()},
            "sharding": fields["sharding"],
            "versions": versions.to_dict(),
            "op_libraries": list(OP_LIBRARIES),
            "quantization": fields["quantization"],
            "validation": fields["validation"],
            "sample": sample.to_dict(),
            "model_sha256": model_sha256,
            **({"aoti": aoti.to_dict()} if aoti is not None else {}),
            **({"tables": tables.to_dict()} if tables is not None else {}),
        }
        return Manifest.from_dict(manifest, "the exported artifact")

    @staticmethod
    def read(path: Union[str, Path]) -> "Manifest":
        """The manifest of the artifact folder ``path``, checked; ArtifactError names the problem."""
        return Manifest.from_dict(read_manifest(path), path)

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


def read_manifest(path: Union[str, Path]) -> Dict[str, Any]:
    """The artifact's manifest as parsed JSON, its structure checked (``check_manifest``); prefer ``Manifest.read``."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise ArtifactError(f"{path}: not an artifact (manifest.json is missing)")
    try:
        manifest = json.loads((path / "manifest.json").read_bytes(), parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ArtifactError(f"{path}/manifest.json is corrupt: {e}") from None
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: Any, path: Union[str, Path] = "artifact") -> None:
    """Raises ArtifactError, naming the field, unless the manifest has every field of the contract with its type.

    The rules are those of protos/recship/artifact/v1/manifest.schema.json (tests/export/test_manifest.py
    holds the two together); the C++ loader checks the same required fields.
    """

    def fail(what: str) -> None:
        raise ArtifactError(f"{path}/manifest.json: {what}")

    def need(container: Any, key: str, kind: Union[type, Tuple[type, ...]], where: str) -> Any:
        value = container.get(key) if isinstance(container, dict) else None
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            fail(f"{where}{key} must be {name}, got {type(value).__name__}")
        return value

    def sizes(shape: Any) -> bool:
        return all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)

    if not isinstance(manifest, dict):
        fail(f"must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") not in (FORMAT, FORMAT_V1):
        fail(f"unknown artifact format {str(manifest.get('format'))[:80]!r}, expected {FORMAT!r}")
    if manifest["format"] == FORMAT:
        check_spec(manifest.get("tables"), fail)
    elif "tables" in manifest:
        fail(f"tables needs format {FORMAT!r}")
    if not re.fullmatch(r"[0-9a-f]{64}", str(manifest.get("model_sha256"))):
        fail("model_sha256 must be 64 lowercase hex digits")
    features = need(manifest, "sparse_features", list, "")
    names = set()
    for i, f in enumerate(features):
        where = f"sparse_features[{i}]."
        if not isinstance(f, dict):
            fail(f"sparse_features[{i}] must be an object")
        for key in ("name", "table", "pooling", "weight_type"):
            need(f, key, str, where)
        if need(f, "rows", int, where) <= 0 or need(f, "dim", int, where) <= 0:
            fail(f"{where}rows and dim must be positive")
        if f.get("id_policy") not in ID_POLICIES:
            fail(f"{where}id_policy must be 'reject' or 'modulo'")
        if not isinstance(f.get("weighted", False), bool):
            fail(f"{where}weighted must be bool")
        if f["name"] in names:
            fail(f"sparse feature {f['name']!r} appears twice")
        names.add(f["name"])
    if need(manifest, "num_dense", int, "") < 0:
        fail("num_dense must be >= 0")
    weighted = need(manifest, "weighted", bool, "")
    if features and weighted != any(f.get("weighted", weighted) for f in features):
        fail("weighted must say whether any sparse feature is weighted")
    for name, out in need(manifest, "outputs", dict, "").items():
        shape = need(out, "shape", list, f"outputs[{name!r}].")
        if not shape or shape[0] != "B" or not sizes(shape[1:]):
            fail(f"outputs[{name!r}].shape must be ['B', n, ...], got {str(shape)[:80]}")
        if out.get("dtype") != "float32":
            fail(f"outputs[{name!r}].dtype must be 'float32'")
    sharding = need(manifest, "sharding", dict, "")
    if sharding.get("device") not in DEVICES:
        fail("sharding.device must be 'cpu' or 'cuda'")
    if need(sharding, "num_devices", int, "sharding.") < 1 or need(sharding, "row_alignment", int, "sharding.") < 1:
        fail("sharding.num_devices and sharding.row_alignment must be >= 1")
    for i, s in enumerate(need(sharding, "shards", list, "sharding.")):
        need(s, "table", str, f"sharding.shards[{i}].")
        for key in ("index", "device", "row_offset", "rows", "col_offset", "cols"):
            if need(s, key, int, f"sharding.shards[{i}].") < 0:
                fail(f"sharding.shards[{i}].{key} must be >= 0")
    sample = need(manifest, "sample", dict, "")
    if need(sample, "batch_size", int, "sample.") < 1:
        fail("sample.batch_size must be >= 1")
    for group in ("inputs", "outputs"):
        for name, spec in need(sample, group, dict, "sample.").items():
            where = f"sample.{group}[{name!r}]."
            file = need(spec, "file", str, where)
            parts = PurePosixPath(file).parts
            if not parts or file.startswith("/") or ".." in parts or "\\" in file:  # nothing outside the artifact
                fail(f"{where}file must be a relative path inside the artifact, got {file[:80]!r}")
            if spec.get("dtype") not in _DTYPES:
                fail(f"{where}dtype must be one of {sorted(_DTYPES)}")
            if not sizes(need(spec, "shape", list, where)):
                fail(f"{where}shape must be a list of sizes")
    for name in ("dense", "lengths", "values"):
        if name not in sample["inputs"]:
            fail(f"sample.inputs[{name!r}] is missing")
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
    if not all(isinstance(lib, str) for lib in need(manifest, "op_libraries", list, "")):
        fail("op_libraries must be a list of file names")
    need(manifest, "quantization", dict, "")
    need(manifest, "validation", dict, "")
    if "aoti" in manifest:
        aoti = need(manifest, "aoti", dict, "")
        if need(aoti, "file", str, "aoti.") != "model.pt2":
            fail("aoti.file must be 'model.pt2'")
        if not re.fullmatch(r"[0-9a-f]{64}", str(aoti.get("sha256"))):
            fail("aoti.sha256 must be 64 lowercase hex digits")
        for key in ("target_isa", "torch"):
            need(aoti, key, str, "aoti.")
        for key, span in need(aoti, "dynamic", dict, "aoti.").items():
            if not (isinstance(span, list) and len(span) == 2 and sizes(span) and span[0] <= span[1]):
                fail(f"aoti.dynamic[{key!r}] must be [min, max] sizes")
        order = need(aoti, "input_order", list, "aoti.")
        if order not in (["dense", "lengths", "values"], ["dense", "lengths", "values", "weights"]):
            fail("aoti.input_order must be dense, lengths, values (, weights)")
        if sorted(map(str, need(aoti, "output_order", list, "aoti."))) != sorted(manifest["outputs"]):
            fail("aoti.output_order must name every output once")
        if not isinstance(aoti.get("compile_seconds"), (int, float)) or isinstance(aoti.get("compile_seconds"), bool):
            fail("aoti.compile_seconds must be a number")
        unknown = sorted(set(aoti) - {f.name for f in dataclasses.fields(AotiSpec)})
        if unknown:
            fail(f"aoti has unknown fields {unknown}")


def file_sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_sample(path: Union[str, Path], batch_size: int, inputs: Dict[str, torch.Tensor], outputs: Dict[str, torch.Tensor]) -> Sample:
    """Writes the sample request and its outputs under ``path``/sample/ as raw little-endian tensors.

    inputs: dense [B, num_dense] float32, lengths [F * B] int32, values [N] int64, weights [N] float32
    (weighted models only); outputs: name -> [B, ...] tensor. Returns the manifest's ``sample``.
    """
    (Path(path) / "sample").mkdir()
    sample = Sample(batch_size, {}, {})
    for group, tensors in (("inputs", inputs), ("outputs", outputs)):
        for name, t in tensors.items():
            file = f"sample/{group}.{name}.bin"
            array = t.detach().cpu().contiguous().numpy()
            (Path(path) / file).write_bytes(array.astype(array.dtype.newbyteorder("<")).tobytes())
            getattr(sample, group)[name] = SampleTensor(file, str(t.dtype).replace("torch.", ""), list(t.shape))
    return sample


def read_sample(path: Union[str, Path], manifest: Manifest) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(inputs, expected outputs) of the artifact's sample request."""
    out = []
    for group in (manifest.sample.inputs, manifest.sample.outputs):
        tensors = {}
        for name, spec in group.items():
            try:
                raw = (Path(path) / spec.file).read_bytes()
            except OSError as e:
                raise ArtifactError(f"{path}: sample file {spec.file!r} cannot be read: {e.strerror}") from None
            dtype = _DTYPES[spec.dtype]
            size = torch.empty((), dtype=dtype).element_size() * math.prod(spec.shape)
            if len(raw) != size:
                raise ArtifactError(f"{path}: sample file {spec.file!r} has {len(raw)} bytes, its shape {spec.shape} needs {size}")
            if not raw:  # e.g. dense [B, 0] of an embedding-only model
                t = torch.empty(spec.shape, dtype=dtype)
            else:
                t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(spec.shape)
            tensors[name] = t
        out.append(tensors)
    return out[0], out[1]


FORMATS = ("auto", "torchscript", "aoti")


def open_artifact(
    path: Union[str, Path], check: bool = True, trusted: Optional[Collection[str]] = None, format: str = "auto"
) -> Tuple[Any, Manifest]:
    """(the model, Manifest); with ``check``, verifies the checksum and runs the sample.

    ``format``: "torchscript" loads model.pt; "aoti" loads model.pt2 (ArtifactError if the
    artifact has none, or this CPU or torch cannot run it); "auto" loads model.pt2 where the
    artifact has one that runs here, else model.pt. Either model is called the same way:
    model(dense, lengths, values, weights) -> Dict[str, Tensor]. The model is loaded from
    the very bytes that were hashed, so a file swapped after the check cannot slip in.
    ``trusted``: sha256s of model files allowed to load (None: any).
    """
    import fbgemm_gpu  # noqa: F401  (registers the TBE ops the module calls)

    if format not in FORMATS:
        raise ArtifactError(f"format must be one of {FORMATS}, got {format!r}")
    manifest = Manifest.read(path)
    aoti = format == "aoti" or (format == "auto" and manifest.aoti is not None and aoti_runs_here(manifest)[0])
    if aoti:
        _aoti_runs_or_fail(Path(path), manifest)
    try:
        # the tables first: verified (or shared with a loaded version whose tables are equal), then the program
        tables = map_tables(path, manifest.tables) if manifest.tables is not None else {}
        model = _open_aoti(Path(path), manifest, trusted, tables) if aoti else _open_torchscript(Path(path), manifest, trusted, tables)
    except TablesError as e:
        raise ArtifactError(str(e)) from None
    if check:
        self_check(model, path, manifest)
    return model, manifest


def _verified_bytes(file: Path, want: str, trusted: Optional[Collection[str]]) -> bytes:
    if not file.is_file():
        raise ArtifactError(f"{file.parent}: {file.name} is missing")
    data = file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if trusted is not None and digest not in trusted:
        raise ArtifactError(f"{file}: sha256 {digest} is not in the trusted list")
    if digest != want:
        raise ArtifactError(f"{file}: sha256 {digest} does not match the manifest's {want}")
    return data


def _open_torchscript(path: Path, manifest: Manifest, trusted: Optional[Collection[str]], tables: Dict[str, torch.Tensor]) -> Any:
    data = _verified_bytes(path / "model.pt", manifest.model_sha256, trusted)
    # a CUDA artifact keeps its devices (its TBE rows are laid out for the GPU kernels)
    on_cuda = manifest.sharding.device == "cuda"
    extra: Dict[str, Any] = {PINNED_NAME: ""} if manifest.tables is not None else {}
    module = torch.jit.load(io.BytesIO(data), map_location=None if on_cuda else "cpu", _extra_files=extra)
    del data
    if manifest.tables is not None:
        pinned = extra[PINNED_NAME]
        check_pinned(pinned.decode() if isinstance(pinned, bytes) else pinned, manifest.tables, f"{path}/model.pt")
        attach_torchscript(module, manifest.tables, tables, str(path))
    return module


def aoti_runs_here(manifest: Manifest) -> Tuple[bool, str]:
    """(whether this process can run the artifact's model.pt2, why not)."""
    from recship.export.aoti import cpu_supports

    if manifest.aoti is None:
        return False, "the artifact has no model.pt2 (exported with --format torchscript)"
    if manifest.aoti.torch != torch.__version__:
        return False, f"model.pt2 was compiled by torch {manifest.aoti.torch}, this is torch {torch.__version__}"
    ok, missing = cpu_supports(manifest.aoti.target_isa)
    if not ok:
        return False, f"model.pt2 targets {manifest.aoti.target_isa}; this CPU lacks {missing}"
    return True, ""


def _aoti_runs_or_fail(path: Path, manifest: Manifest) -> None:
    runs, why = aoti_runs_here(manifest)
    if not runs:
        raise ArtifactError(f"{path}: {why}")


def _open_aoti(path: Path, manifest: Manifest, trusted: Optional[Collection[str]], tables: Dict[str, torch.Tensor]) -> Any:
    import tempfile

    from recship.export.aoti import AotiError, load_package

    assert manifest.aoti is not None  # _aoti_runs_or_fail says so
    data = _verified_bytes(path / manifest.aoti.file, manifest.aoti.sha256, trusted)
    constants = None
    if manifest.tables is not None:
        check_pinned(pt2_pinned(data), manifest.tables, f"{path}/model.pt2")
        constants = aoti_constants(manifest.tables, tables)
    # load the hashed bytes, not the file again: a private copy that nobody else can swap
    with tempfile.TemporaryDirectory(prefix="recship-aoti-") as tmp:
        copy = Path(tmp) / "model.pt2"
        copy.write_bytes(data)
        del data
        try:
            compiled = load_package(copy, manifest.aoti.target_isa, constants)
        except AotiError as e:
            raise ArtifactError(f"{path}/{manifest.aoti.file}: {str(e).replace(str(copy) + ': ', '')}") from None
        return AotiModel(compiled, manifest, constants)


class AotiModel:
    """An AOTInductor package called like the TorchScript model: (dense, lengths, values, weights)
    -> Dict[str, Tensor]. AOTI runs no input checks of its own, so shapes and dtypes are checked
    here first (ValueError); ids are checked by the server / the model's own assert."""

    format = "aoti"

    def __init__(self, compiled: Any, manifest: Manifest, constants: Optional[Dict[str, torch.Tensor]] = None) -> None:
        assert manifest.aoti is not None  # only artifacts with model.pt2 get here
        self._compiled = compiled
        self._constants = constants  # the package holds raw pointers into these (mapped tables): keep them alive
        # the package's flat entry point (positional tensors in input_order, outputs in output_order):
        # skips the pytree round trip of compiled(...), ~80 us a call at batch 1 here
        self._run = getattr(getattr(compiled, "loader", None), "run", None)
        self._outputs = list(manifest.aoti.output_order)
        self._num_features = len(manifest.sparse_features)
        self._num_dense = manifest.num_dense
        self._weighted = manifest.weighted

    def __call__(self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
                 weights: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        batch = dense.shape[0] if dense.dim() == 2 else -1
        if dense.dtype != torch.float32 or dense.dim() != 2 or dense.shape[1] != self._num_dense or batch < 1:
            raise ValueError(f"dense must be float32 [B >= 1, {self._num_dense}], got {dense.dtype} {list(dense.shape)}")
        if lengths.dtype != torch.int32 or list(lengths.shape) != [self._num_features * batch]:
            raise ValueError(f"lengths must be int32 [{self._num_features} * {batch}], got {lengths.dtype} {list(lengths.shape)}")
        if values.dtype != torch.int64 or values.dim() != 1:
            raise ValueError(f"values must be int64 [N], got {values.dtype} {list(values.shape)}")
        if int(lengths.sum()) != values.shape[0] or (lengths.numel() and int(lengths.min()) < 0):
            raise ValueError(f"lengths must be >= 0 and sum to the {values.shape[0]} values")
        inputs = [dense.contiguous(), lengths.contiguous(), values.contiguous()]
        if self._weighted:
            if weights is None or weights.dtype != torch.float32 or list(weights.shape) != list(values.shape):
                raise ValueError(f"weights must be float32 [{values.shape[0]}] for this weighted model")
            inputs.append(weights.contiguous())
        if self._run is None:
            return self._compiled(*inputs, *([] if self._weighted else [None]))
        return dict(zip(self._outputs, self._run(inputs)))


def load_artifact(
    path: Union[str, Path], check: bool = True, trusted: Optional[Collection[str]] = None, format: str = "auto"
) -> Tuple[Any, Dict[str, Any]]:
    """``open_artifact`` with the manifest as its JSON object, for the readers not yet on ``Manifest``."""
    model, manifest = open_artifact(path, check, trusted, format)
    return model, manifest.to_dict()


def self_check(model: Callable[..., Dict[str, torch.Tensor]], path: Union[str, Path], manifest: Manifest) -> float:
    """Runs the sample; raises ArtifactError unless every output matches; returns the max abs difference."""
    inputs, expected = read_sample(path, manifest)
    with torch.no_grad():
        got = model(inputs["dense"], inputs["lengths"], inputs["values"], inputs.get("weights"))
    worst = 0.0
    for name, want in expected.items():
        if name not in got:
            raise ArtifactError(f"{path}: the model does not produce output {name!r}")
        diff = float((got[name].float().cpu() - want).abs().max()) if want.numel() else 0.0
        worst = max(worst, diff)
    if worst > 1e-5:
        raise ArtifactError(f"{path}: sample self-check failed: outputs differ from the recorded ones by {worst:.3g}")
    return worst
