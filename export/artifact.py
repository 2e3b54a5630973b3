"""Artifacts loaded: the sample files, and opening an artifact with a self-check (its manifest's types and checks are
the contract's: ``recship.contract``, re-exported here).

An artifact is a folder: ``model.pt`` (TorchScript: forward(dense, lengths, values, weights)
-> Dict[str, Tensor]), optionally ``model.pt2`` (the same model compiled by AOTInductor,
described by the manifest's ``aoti``), ``manifest.json`` (``Manifest``; its JSON Schema is
recship/contract/manifest.schema.json, which the C++ loader obeys too)
and ``sample/`` (one request and the outputs the exported model gave for it, as raw
little-endian tensors). Only torch is needed here (fbgemm_gpu when a model is loaded).

An artifact is verified as a unit before any of it runs (``open_artifact``): the manifest,
then every file it lists (model.pt and model.pt2 by sha256, whichever loads; tables.bin
table by table; each model file's copy of the tables spec; the sample files' sizes and
values), then the model loads from the very bytes that were hashed and runs the sample.
Any failure refuses the whole artifact, naming the file.

Loading an artifact runs its TorchScript (or model.pt2's compiled code): only load artifacts
from people you trust. The checksums in the manifest sit beside the files in the same
folder, so they detect accidents (a truncated copy), not tampering; ``trusted`` (an
allow-list of manifest.json sha256s kept elsewhere) pins what may load: a listed manifest
pins, through its checksums, every file of the artifact.
"""

import hashlib
import io
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple, Union

import fbgemm_gpu  # registers the TBE ops the models call
import torch

from recship.export.aoti import AotiError, cpu_supports, load_package
from recship.export.blocks import RowBlocks
# the contract's names, re-exported: what this module loads is described there, and importers of it keep working
from recship.contract.manifest import (FORMAT_V1, MAX_ID_BOUND, SAMPLE_DTYPES, AotiSpec, ArtifactError, Manifest, ModelFields,
                                       ModelInfo, Sample, SampleTensor, Sharding, SparseFeature, file_sha256)
from recship.contract.tables import TablesError, check_pinned, pt2_pinned
from recship.export.tables import aoti_constants, attach_torchscript, map_tables
from recship.names import LOAD_FORMATS
from recship.sparse.ids import out_of_range_message

_DTYPES = {name: getattr(torch, name) for name in SAMPLE_DTYPES}  # the sample files' dtypes

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
    """(inputs, expected outputs) of the artifact's sample request, verified: every file's size is the one
    its shape needs, its inputs are a valid request of the model (lengths >= 0 summing to the values, ids
    inside a ``reject`` feature's [0, bound), finite dense and weights) and its outputs are finite. ArtifactError
    names the file; the C++ loader checks the same, in the same order, with the same words."""
    out: List[Dict[str, torch.Tensor]] = [{}, {}]
    inputs_first: List[str] = [name for name in ("dense", "lengths", "values", "weights") if name in manifest.sample.inputs]
    order: List[Tuple[int, str, SampleTensor]] = [(0, name, manifest.sample.inputs[name]) for name in inputs_first]
    order += [(1, name, manifest.sample.outputs[name]) for name in sorted(manifest.sample.outputs)]
    for group, name, spec in order:
        try:
            raw = (Path(path) / spec.file).read_bytes()
        except OSError as e:
            raise ArtifactError(f"{path}: sample file {spec.file!r} cannot be read: {e.strerror}") from None
        dtype = _DTYPES[spec.dtype]
        size = torch.empty((), dtype=dtype).element_size() * math.prod(spec.shape)
        if len(raw) != size:
            raise ArtifactError(f"{path}: sample file {spec.file!r} has {len(raw)} bytes, its shape {spec.shape} needs {size}")
        if not raw:  # e.g. dense [B, 0] of an embedding-only model
            out[group][name] = torch.empty(spec.shape, dtype=dtype)
        else:
            out[group][name] = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(spec.shape)
    inputs, outputs = out
    _check_sample_request(Path(path), manifest, inputs)
    for name in sorted(outputs):
        if not bool(torch.isfinite(outputs[name]).all()):
            raise ArtifactError(f"{path}: sample file {manifest.sample.outputs[name].file!r} holds NaN or infinity")
    return inputs, outputs


def _check_sample_request(path: Path, manifest: Manifest, inputs: Dict[str, torch.Tensor]) -> None:
    """The sample's inputs as a request: the server's rules (and words) for what a file can get wrong."""
    files = {name: spec.file for name, spec in manifest.sample.inputs.items()}

    def bad(name: str, why: str) -> ArtifactError:
        return ArtifactError(f"{path}: sample file {files[name]!r} is not a valid request: {why}")

    b, features = manifest.sample.batch_size, manifest.sparse_features
    lengths = inputs["lengths"].to(torch.int64).view(len(features), b)
    for f, row in zip(features, lengths.tolist()):
        negative = next((n for n in row if n < 0), None)
        if negative is not None:
            raise bad("lengths", f"sparse feature {f.name!r}: negative length {negative}")
    values = inputs["values"]
    total = int(lengths.sum())
    if total != values.numel():
        raise bad("lengths", f"its lengths sum to {total}, but {files['values']!r} holds {values.numel()} ids")
    start = 0
    for f, count in zip(features, lengths.sum(1).tolist()):
        ids = values[start: start + count]
        start += count
        if f.id_policy == "reject":
            outside = ((ids < 0) | (ids >= f.bound)).nonzero()
            if outside.numel():
                raise bad("values", out_of_range_message(f.name, int(ids[int(outside[0])]), f.bound))
    if not bool(torch.isfinite(inputs["dense"]).all()):
        raise bad("dense", "dense values must be finite (no NaN or infinity)")
    if "weights" in inputs:
        start = 0
        for f, count in zip(features, lengths.sum(1).tolist()):
            if f.weighted and not bool(torch.isfinite(inputs["weights"][start: start + count]).all()):
                raise bad("weights", f"sparse feature {f.name!r}: weights must be finite")
            start += count


FORMATS = LOAD_FORMATS


def open_artifact(
    path: Union[str, Path], check: bool = True, trusted: Optional[Collection[str]] = None, format: str = "auto",
    accept: Optional[Callable[[Manifest], None]] = None,
) -> Tuple[Any, Manifest]:
    """(the model, Manifest), the artifact verified as a unit first; with ``check``, its sample runs too.

    In the contract's open order (recship/contract/__init__.py, steps 1-8: the C++ loader's Model::load keeps the
    same), each failure an ArtifactError naming the file. The model loads from the very bytes that were hashed (a
    file swapped after the check cannot slip in).

    ``format``: "torchscript" loads model.pt; "aoti" loads model.pt2 (ArtifactError if the
    artifact has none, or this CPU or torch cannot run it); "auto" loads model.pt2 where the
    artifact has one that runs here, else model.pt. Either model is called the same way:
    model(dense, lengths, values, weights) -> Dict[str, Tensor], in blocks of the manifest's ``row_block``
    examples where it has one (``RowBlocks``: an answer does not depend on the batch it ran in).
    ``trusted``: sha256s of manifest.json files allowed to load (None: any); a listed manifest
    pins every file through its checksums. ``accept(manifest)``: the caller's own check of the manifest, once read
    and before anything else (raises to refuse the artifact): a server's device, without reading the manifest twice.
    """
    if format not in FORMATS:
        raise ArtifactError(f"format must be one of {FORMATS}, got {format!r}")
    path = Path(path)
    manifest = Manifest.read(path, trusted)  # 1-2: the contract's open order (recship/contract/__init__.py)
    if accept is not None:
        accept(manifest)
    _check_versions(path, manifest)
    if manifest.model_sha256 is None and format == "torchscript":
        raise ArtifactError(f"{path} has no model.pt: TorchScript could not compile this model at export, its program is "
                            "model.pt2 (load it with format auto or aoti)")
    # 3. which model file runs
    aoti = format == "aoti" or (format == "auto" and manifest.aoti is not None
                                and (manifest.model_sha256 is None or aoti_runs_here(manifest)[0]))
    if aoti:
        _aoti_runs_or_fail(path, manifest)
    # 4. every model file the manifest lists, whichever loads: a version is refused as a unit
    files = {**({"model.pt": manifest.model_sha256} if manifest.model_sha256 is not None else {}),
             **({manifest.aoti.file: manifest.aoti.sha256} if manifest.aoti else {})}
    used = manifest.aoti.file if aoti and manifest.aoti is not None else "model.pt"
    data = {name: _verified_bytes(path / name, want, keep=name == used or manifest.tables is not None)
            for name, want in files.items()}  # bytes of the one that loads, and of both with tables.bin (pinned copies)
    try:
        tables: Dict[str, torch.Tensor] = {}
        if manifest.tables is not None:
            # 5. verified (or shared with a loaded version whose tables are equal); 6. each model file's pinned copy
            tables = map_tables(path, manifest.tables)
            for name in files:
                check_pinned(pt2_pinned(data[name] or b""), manifest.tables, f"{path}/{name}")
        sample = read_sample(path, manifest) if check else None  # 7.
        _check_op_libraries(path, manifest)  # 8., then the model and its sample run
        program = data[used]
        assert program is not None  # kept: it loads
        data.clear()
        model = _open_aoti(path, manifest, program, tables) if aoti else _open_torchscript(path, manifest, program, tables)
        del program
    except TablesError as e:
        raise ArtifactError(str(e)) from None
    if manifest.row_block:  # every forward on blocks of exactly row_block examples (export/blocks.py)
        model = RowBlocks(model, manifest.row_block, len(manifest.sparse_features))
    if sample is not None:
        self_check(model, path, manifest, sample)
    return model, manifest


def _release(version: str) -> str:
    """"2.13.0+cpu" -> "2.13.0" (the C++ loader's release())."""
    return re.split(r"[+ ]", version, maxsplit=1)[0]


def _check_versions(path: Path, manifest: Manifest) -> None:
    """The artifact's torch and fbgemm_gpu releases must be this process's (the C++ loader's check_versions)."""
    built, running = _release(manifest.versions.torch), _release(torch.__version__)
    if built != running:
        raise ArtifactError(f"{path / 'manifest.json'}: artifact built with torch {built}, this loader runs torch {running}")
    found = getattr(fbgemm_gpu, "__version__", "")
    if found and _release(found) != _release(manifest.versions.fbgemm_gpu):
        raise ArtifactError(f"{path / 'manifest.json'}: artifact built with fbgemm_gpu {manifest.versions.fbgemm_gpu}, this loader runs "
                            f"fbgemm_gpu {found}")


def _check_op_libraries(path: Path, manifest: Manifest) -> None:
    """Each fbgemm op library the manifest names is one fbgemm_gpu ships (the C++ loader dlopens them from its folder;
    importing fbgemm_gpu loaded them here), in the C++ loader's words."""
    folder = os.path.dirname(fbgemm_gpu.__file__)
    for lib in manifest.op_libraries:
        if not os.path.isfile(os.path.join(folder, lib)):
            raise ArtifactError(f"{path}/manifest.json: op_libraries: cannot load fbgemm op library {lib!r}: it is not in {folder}")


def _verified_bytes(file: Path, want: str, keep: bool = True) -> Optional[bytes]:
    """The bytes of ``file`` (``keep``; else None, hashed as a stream) after its sha256 matched ``want``."""
    try:
        if keep:
            data: Optional[bytes] = file.read_bytes()
            digest = hashlib.sha256(data).hexdigest()  # type: ignore[arg-type]
        else:
            data, digest = None, file_sha256(file)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ArtifactError(f"{file.parent}: {file.name} is missing") from None
    except OSError as e:
        raise ArtifactError(f"{file}: cannot be read: {e.strerror}") from None
    if digest != want:
        raise ArtifactError(f"{file}: sha256 {digest} does not match the manifest's {want}")
    return data


def _open_torchscript(path: Path, manifest: Manifest, data: bytes, tables: Dict[str, torch.Tensor]) -> Any:
    # a CUDA artifact keeps its devices (its TBE rows are laid out for the GPU kernels)
    on_cuda = manifest.sharding.device == "cuda"
    try:
        module = torch.jit.load(io.BytesIO(data), map_location=None if on_cuda else "cpu")
    except RuntimeError as e:  # bytes that hashed right but do not load: an exporter's bug, named as the file
        raise ArtifactError(f"{path}/model.pt cannot be loaded: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if manifest.tables is not None:
        attach_torchscript(module, manifest.tables, tables, str(path))
    return module


def aoti_runs_here(manifest: Manifest) -> Tuple[bool, str]:
    """(whether this process can run the artifact's model.pt2, why not)."""
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
        raise ArtifactError(f"{path}: {why}" + (" (and the artifact has no model.pt: TorchScript could not compile the model)"
                                                if manifest.model_sha256 is None and manifest.aoti is not None else ""))


def _open_aoti(path: Path, manifest: Manifest, data: bytes, tables: Dict[str, torch.Tensor]) -> Any:


    assert manifest.aoti is not None  # _aoti_runs_or_fail says so
    constants = aoti_constants(manifest.tables, tables) if manifest.tables is not None else None
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
        # skips the pytree round trip of compiled(...), a cost per call that dominates at batch 1
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


def self_check(model: Callable[..., Dict[str, torch.Tensor]], path: Union[str, Path], manifest: Manifest,
               sample: Optional[Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]] = None) -> float:
    """Runs the sample (``sample``: what ``read_sample`` gave, else it is read now); raises ArtifactError
    unless every output (by name) has the recorded shape, is finite and is within 1e-5 of the recorded
    values; returns the max abs difference. NaN or infinity fails it, recorded or computed."""
    inputs, expected = sample if sample is not None else read_sample(path, manifest)
    with torch.no_grad():
        got = model(inputs["dense"], inputs["lengths"], inputs["values"], inputs.get("weights"))
    worst = 0.0
    for name in sorted(expected):
        want, file = expected[name], manifest.sample.outputs[name].file
        if name not in got:
            raise ArtifactError(f"{path}: the model does not produce output {name!r}")
        out = got[name].float().cpu()
        where = f"{path}: sample self-check failed on output {name!r}"
        if list(out.shape) != list(want.shape):
            raise ArtifactError(f"{where}: shape {list(out.shape)}, {file!r} holds {list(want.shape)}")
        if not bool(torch.isfinite(out).all()):
            raise ArtifactError(f"{where}: the model gave NaN or infinity")
        diff = float((out - want).abs().max()) if want.numel() else 0.0
        if not diff <= 1e-5:
            raise ArtifactError(f"{where}: it differs from {file!r} by {diff:.3g}")
        worst = max(worst, diff)
    return worst
