"""Reading an exported artifact: manifest, checksum, sample self-check (torch + fbgemm_gpu only)."""

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Tuple, Union

import torch

FORMAT = "recship.artifact/1"
_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64}


class ArtifactError(ValueError):
    """A missing, tampered or inconsistent artifact; the message names the problem."""


def read_manifest(path: Union[str, Path]) -> Dict[str, Any]:
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise ArtifactError(f"{path}: not an artifact (manifest.json is missing)")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}/manifest.json is corrupt: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: unknown artifact format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def verify_checksum(path: Union[str, Path], manifest: Dict[str, Any]) -> None:
    model = Path(path) / "model.pt"
    if not model.is_file():
        raise ArtifactError(f"{path}: model.pt is missing")
    h = hashlib.sha256()
    with model.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != manifest["model_sha256"]:
        raise ArtifactError(f"{model}: sha256 {h.hexdigest()} does not match the manifest's {manifest['model_sha256']}")


def read_sample(path: Union[str, Path], manifest: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(inputs, expected outputs) of the artifact's sample request."""
    out = []
    for group in ("inputs", "outputs"):
        tensors = {}
        for name, spec in manifest["sample"][group].items():
            raw = (Path(path) / spec["file"]).read_bytes()
            dtype = _DTYPES[spec["dtype"]]
            if not raw:  # e.g. dense [B, 0] of an embedding-only model
                t = torch.empty(spec["shape"], dtype=dtype)
            else:
                t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(spec["shape"])
            tensors[name] = t
        out.append(tensors)
    return out[0], out[1]


def load_artifact(path: Union[str, Path], check: bool = True):
    """(TorchScript module, manifest); with ``check``, verifies the checksum and runs the sample."""
    import fbgemm_gpu  # noqa: F401  (registers the TBE ops the module calls)

    manifest = read_manifest(path)
    verify_checksum(path, manifest)
    # a CUDA artifact keeps its devices (its TBE rows are laid out for the GPU kernels)
    on_cuda = manifest.get("sharding", {}).get("device") == "cuda"
    model = torch.jit.load(str(Path(path) / "model.pt"), map_location=None if on_cuda else "cpu")
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
