"""Reading an exported artifact: manifest, checksum, sample self-check (torch + fbgemm_gpu only).

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
from pathlib import Path, PurePosixPath
from typing import Any, Collection, Dict, Optional, Tuple, Union

import torch

FORMAT = "recship.artifact/1"
_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64}


class ArtifactError(ValueError):
    """A missing, tampered or inconsistent artifact; the message names the problem."""


def read_manifest(path: Union[str, Path]) -> Dict[str, Any]:
    """The artifact's manifest, its structure checked (``check_manifest``); ArtifactError names the problem."""
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise ArtifactError(f"{path}: not an artifact (manifest.json is missing)")
    try:
        manifest = json.loads((path / "manifest.json").read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ArtifactError(f"{path}/manifest.json is corrupt: {e}") from None
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: Any, path: Union[str, Path] = "artifact") -> None:
    """Raises ArtifactError unless every field a reader of the artifact relies on has the right type."""

    def fail(what: str) -> None:
        raise ArtifactError(f"{path}/manifest.json: {what}")

    def need(container: Any, key: str, kind, where: str) -> Any:
        value = container.get(key) if isinstance(container, dict) else None
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            fail(f"{where}{key} must be {name}, got {type(value).__name__}")
        return value

    if not isinstance(manifest, dict):
        fail(f"must be a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        fail(f"unknown artifact format {str(manifest.get('format'))[:80]!r}, expected {FORMAT!r}")
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
        if f.get("id_policy") not in ("reject", "modulo"):
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
        if not shape or shape[0] != "B" or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape[1:]):
            fail(f"outputs[{name!r}].shape must be ['B', n, ...], got {str(shape)[:80]}")
    if need(manifest, "sharding", dict, "").get("device") not in ("cpu", "cuda"):
        fail("sharding.device must be 'cpu' or 'cuda'")
    sample = need(manifest, "sample", dict, "")
    for group in ("inputs", "outputs"):
        for name, spec in need(sample, group, dict, "sample.").items():
            where = f"sample.{group}[{name!r}]."
            file = need(spec, "file", str, where)
            parts = PurePosixPath(file).parts
            if not parts or file.startswith("/") or ".." in parts or "\\" in file:  # nothing outside the artifact
                fail(f"{where}file must be a relative path inside the artifact, got {file[:80]!r}")
            if spec.get("dtype") not in _DTYPES:
                fail(f"{where}dtype must be one of {sorted(_DTYPES)}")
            shape = need(spec, "shape", list, where)
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                fail(f"{where}shape must be a list of sizes")


def file_sha256(path: Union[str, Path]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_sample(path: Union[str, Path], manifest: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(inputs, expected outputs) of the artifact's sample request."""
    out = []
    for group in ("inputs", "outputs"):
        tensors = {}
        for name, spec in manifest["sample"][group].items():
            try:
                raw = (Path(path) / spec["file"]).read_bytes()
            except OSError as e:
                raise ArtifactError(f"{path}: sample file {spec['file']!r} cannot be read: {e.strerror}") from None
            dtype = _DTYPES[spec["dtype"]]
            size = torch.empty((), dtype=dtype).element_size() * math.prod(spec["shape"])
            if len(raw) != size:
                raise ArtifactError(f"{path}: sample file {spec['file']!r} has {len(raw)} bytes, its shape {spec['shape']} needs {size}")
            if not raw:  # e.g. dense [B, 0] of an embedding-only model
                t = torch.empty(spec["shape"], dtype=dtype)
            else:
                t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(spec["shape"])
            tensors[name] = t
        out.append(tensors)
    return out[0], out[1]


def load_artifact(path: Union[str, Path], check: bool = True, trusted: Optional[Collection[str]] = None):
    """(TorchScript module, manifest); with ``check``, verifies the checksum and runs the sample.

    The model is loaded from the very bytes that were hashed, so a file swapped after the
    check cannot slip in. ``trusted``: sha256s of model.pt files allowed to load (None: any).
    """
    import fbgemm_gpu  # noqa: F401  (registers the TBE ops the module calls)

    manifest = read_manifest(path)
    model_file = Path(path) / "model.pt"
    if not model_file.is_file():
        raise ArtifactError(f"{path}: model.pt is missing")
    data = model_file.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if trusted is not None and digest not in trusted:
        raise ArtifactError(f"{model_file}: sha256 {digest} is not in the trusted list")
    if digest != manifest["model_sha256"]:
        raise ArtifactError(f"{model_file}: sha256 {digest} does not match the manifest's {manifest['model_sha256']}")
    # a CUDA artifact keeps its devices (its TBE rows are laid out for the GPU kernels)
    on_cuda = manifest["sharding"]["device"] == "cuda"
    model = torch.jit.load(io.BytesIO(data), map_location=None if on_cuda else "cpu")
    del data
    if check:
        self_check(model, path, manifest)
    return model, manifest


def self_check(model, path: Union[str, Path], manifest: Dict[str, Any]) -> float:
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
