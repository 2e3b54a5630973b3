"""export_model: checkpoint -> quantize -> reshard for inference -> fx + TorchScript -> artifact.

The artifact directory (the contract the server and the C++ loader read):

    model.pt        TorchScript: forward(dense, lengths, values, weights) -> Dict[str, Tensor], its tables
                    left out (placeholders filled from tables.bin at load)
    model.pt2       the same forward compiled by AOTInductor (``--format aoti`` or ``both``), its tables
                    likewise in tables.bin
    tables.bin      every table's rows once, aligned (export/tables_writer.py), mapped read-only by every loader (export/tables.py)
    manifest.json   features, tables (tables.bin's tensors and segments), types, outputs, plan, versions,
                    op libraries, quantization report, sha256 of every file, the sample's files
    sample/         one request as raw little-endian tensors and the outputs the
                    exported model gave for it (any loader can self-check at start)

Any model, the built-in DLRM and a bare EmbeddingBagCollection take the one path of
``recship.export.any_model``: float tables are streamed one at a time (from the checkpoint,
or from the model in memory), each quantized into its inference shards while its float and
quantized lookups for the validation batches are recorded, then dropped, so peak memory
stays near the quantized model plus one table. This module runs the stages and writes,
publishes and names the artifact.
"""

import dataclasses
import functools
import io
import logging
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import fbgemm_gpu
import torch
from torch import nn
from tqdm import tqdm

from recship.contract.manifest import AotiSpec, Manifest, ModelFields, Versions, file_sha256
from recship.contract.repository import RepositoryError, exchange, next_version, publish_version
from recship.contract.tables import PINNED_NAME, TABLES_FILE, TablesSpec, table_name
from recship.export.aoti import AotiError, load_package
from recship.export.aoti_compile import AotiPackage, compile_package, compiler_available
from recship.export.any_model import export_any_model
from recship.export.artifact import write_sample
from recship.export.blocks import run_in_blocks
from recship.export.compile_cache import resolve
from recship.export.config import TABLES_CHART, ExportConfig, ExportError
from recship.export.model import StageError
from recship.export.tables_writer import StagedTables, TablesWriter, link_if_unchanged, pin_pt2
from recship.export.validation import Batch
from recship.oserrors import doing, label, write_bytes
from recship.plots import plot_artifact, plot_if_available
from recship.modules.embedding_modules import EmbeddingBagCollection, materialize
from recship.quantize.quantizer import QuantizationReport, TableReport
from recship.trainer.checkpoint_reader import META_FILE, CheckpointError, CheckpointReader, latest_checkpoint
from recship.trainer.entry_point import build_model

log = logging.getLogger(__name__)  # warnings; recship.logs formats them (text or --log-format json)


# ---------------------------------------------------------------------------
# sources: a model in memory, or a checkpoint of one
# ---------------------------------------------------------------------------


def _module_from_checkpoint(
    path: Path, config: ExportConfig
) -> Tuple[nn.Module, ExportConfig, Optional[int], Callable[[str, str], torch.Tensor]]:
    """For a checkpoint written by ``recship train`` (its model's entry point recorded, or named by
    ``config.model``): (the model, its dense part loaded and its EmbeddingBagCollection tables not,
    the config naming its entry point, the training run's seed, ``load_table(path, table)`` reading
    one float table)."""
    if not path.exists():
        raise ExportError(f"checkpoint not found: {path}")
    folder = path if path.name == "checkpoints" else path / "checkpoints"  # a run folder (recship train --out), or its checkpoints
    if path.is_dir() and not (path / META_FILE).exists() and folder.is_dir():
        newest = latest_checkpoint(folder)
        raise ExportError(f"{path} is a training run's folder, not a checkpoint: "
                          + (f"export one of its checkpoints, e.g. the newest complete one: recship export {newest}" if newest
                             else f"it holds no complete checkpoint in {folder}"))
    try:
        reader = CheckpointReader(path)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    recorded = (reader.config or {}).get("entry_point")
    entry = config.model or (recorded or {}).get("model")
    if entry is None:
        raise ExportError(f"{path}: the checkpoint does not record its model's entry point; name it with --model "
                          "(model=... in ExportConfig)")
    if config.model:
        args = config.model_args
    else:
        assert recorded is not None  # the entry point came from it
        args = recorded.get("args", {})
    try:
        model = build_model(entry, args, device="meta")
    except ValueError as e:
        raise ExportError(str(e)) from None
    every_path = [(p, m) for p, m in model.named_modules(remove_duplicate=False) if p and type(m) is EmbeddingBagCollection]
    bags = [(p, m) for p, m in model.named_modules() if type(m) is EmbeddingBagCollection]  # each once, first path
    saved = {(mpath, cfg.name): cfg for mpath, cfg in reader.table_configs()}
    built = {(mpath, t.name): t for mpath, m in bags for t in m.embedding_bag_configs()}
    for key, t in built.items():
        cfg = saved.get(key)
        if cfg is None:
            raise ExportError(f"{path} has no table {table_name(*key)}, which {entry} builds")
        if (cfg.num_embeddings, cfg.embedding_dim) != (t.num_embeddings, t.embedding_dim):
            raise ExportError(f"{path}: table {table_name(*key)} is {cfg.num_embeddings} x {cfg.embedding_dim}, "
                              f"{entry} builds {t.num_embeddings} x {t.embedding_dim}")
    extra = sorted(table_name(mpath, name) for mpath, name in saved if (mpath, name) not in built)
    if extra:
        raise ExportError(f"{path} has tables {entry} does not build: {extra[:5]}")
    # the dense part (EmbeddingCollections included) is allocated and loaded; the EBC tables stay
    # where the factory put them (meta, given a device argument) and stream from the checkpoint
    for mpath, _ in every_path:
        model.set_submodule(mpath, nn.Module())
    try:

        materialize(model, "cpu")
        missing, unexpected = model.load_state_dict(reader.dense_state_dict(), strict=False)
    finally:
        for mpath, m in every_path:
            model.set_submodule(mpath, m)
    if missing or unexpected:
        raise ExportError(f"{path} does not match {entry}({args}): missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    train = (reader.config or {}).get("train") or {}
    seed = train.get("seed")
    # validated on the run's own data unless --eval-data says otherwise: its eval data, else its training data
    # (synthetic data: drawn like the run's, from its seed)
    recorded_data = train.get("eval_data") or (train.get("data") if train.get("data") != "synthetic" else None)
    eval_data = config.eval_data if config.eval_data is not None else recorded_data
    if config.eval_data is None and recorded_data is not None and not Path(recorded_data).is_file() and ":" not in recorded_data:
        raise ExportError(f"{path}: its run trained on {recorded_data}, which is not there now; validation runs on the run's "
                          "own data: give its path with --eval-data (eval_data=... in ExportConfig)")
    # tables stream one at a time (each dropped before the next is loaded): they may share one buffer
    return (model, dataclasses.replace(config, model=entry, model_args=dict(args), eval_data=eval_data), seed,
            functools.partial(reader.table, reuse=True))


# ---------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------


def export_model(source: Union[str, Path, nn.Module], config: ExportConfig) -> Dict[str, Any]:
    """Runs every stage and writes ``config.out`` (or the next version under ``config.repo``); returns the manifest."""
    if config.repo is not None:
        out = Path(config.repo) / config.model_name  # the model folder: write_artifact adds the version
    else:
        assert config.out is not None  # ExportConfig asks for one of the two
        out = Path(config.out)
        if out.exists() and not config.overwrite:
            raise ExportError(f"{out} already exists; to replace it, pass --overwrite (overwrite=True in ExportConfig)")
    stages = ["load", "quantize + shard", "trace + script", "validate", "write"]
    bar = _Stages(stages, config.progress)
    parent = out if config.repo is not None else out.parent
    made = [f for f in [parent, *parent.parents] if not f.exists()]  # folders the export creates, removed if it fails
    staging: Optional[Tuple[Path, StagedTables]] = None  # the staging folder, and the tables file quantized into
    try:

        bar.next("load")
        owned = False
        data_seed: Optional[int] = None
        load_table: Optional[Callable[[str, str], torch.Tensor]] = None
        if isinstance(source, (str, Path)):
            (source, config, data_seed, load_table), owned = _module_from_checkpoint(Path(source), config), True
        if not isinstance(source, nn.Module):
            raise ExportError(f"cannot export a {type(source).__name__}: give a checkpoint path or a model (an nn.Module)")
        aoti = _wants_aoti(config)
        staging = _staging(out, config)
        scripted, fields, sample, exported = export_any_model(
            source, config, bar.next, owned=owned, data_seed=data_seed, load_table=load_table,
            torchscript_required=config.format in ("torchscript", "both") or not aoti,
            host_rows=staging[1].allocate,  # CPU rows are quantized straight into the tables file
        )
        bar.next("write + compile model.pt2" if aoti else "write")
        manifest = write_artifact(*staging, out, scripted, fields, (*sample, None), config, exported, aoti)
        bar.finish()
    except BaseException as e:
        if isinstance(e, OSError):  # a full disk, a read-only folder: recship.cli says it in one line, with the stage
            label(e, f"export stage {bar.stage!r}", out)
        if staging is not None:
            shutil.rmtree(staging[0], ignore_errors=True)
        for folder in made:  # innermost first, as long as each is empty
            if not folder.is_dir() or any(folder.iterdir()):
                break
            folder.rmdir()
        raise
    finally:
        if staging is not None:
            staging[1].close()
        bar.close()
    _print_summary(manifest, out, config)
    return manifest


def staging_folder(out: Path, config: ExportConfig) -> Path:
    """A new, empty folder beside (or, with ``config.repo``, inside) ``out`` where the artifact is
    written before ``write_artifact`` renames it into place.

    With ``config.repo``, ``out`` is the model folder and the staging folder is hidden inside it
    (the server skips names starting with "."), so a failed or killed export never leaves a
    version folder behind. Its name carries the exporter's pid: one left by a killed export (as
    large as its tables) is removed here.
    """
    if config.repo is not None:
        out.mkdir(parents=True, exist_ok=True)
        prefix = out / ".version.tmp-"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        prefix = out.parent / f".{out.name}.tmp-"
    _remove_abandoned(prefix)
    tmp = Path(f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    return tmp


def _staging(out: Path, config: ExportConfig) -> Tuple[Path, StagedTables]:
    with doing("creating the export's staging folder"):
        tmp = staging_folder(out, config)
    return tmp, StagedTables(tmp / TABLES_FILE)


def write_artifact(
    tmp: Path, staged: Optional[StagedTables], out: Path, scripted: Union[torch.jit.ScriptModule, StageError], fields: ModelFields,
    sample: Batch, config: ExportConfig, exported: Optional[nn.Module] = None, aoti: Optional[bool] = None,
) -> Dict[str, Any]:
    """Writes the artifact into the staging folder ``tmp`` (``staging_folder``) and renames it into place.

    With ``config.repo``, ``out`` is the model folder and the artifact becomes its next version
    (``publish_version``), else ``out`` is the artifact's folder. ``fields``: model, num_dense,
    weighted, sparse_features, sharding, quantization and validation of the manifest (``ModelFields``);
    ``Manifest.from_fields`` adds the inputs, outputs, sample, versions and checksum (the
    artifact contract is recship.contract's). ``exported``: the module torch.export compiles into
    model.pt2 when ``aoti`` (default: as ``config.format`` asks). ``scripted``: its TorchScript, saved
    as model.pt; or the StageError that kept TorchScript from it, and the artifact has model.pt2 alone
    (its sample outputs are then model.pt2's own). ``staged``: ``tmp``/tables.bin with the rows
    quantized into it (``StagedTables``), or None. ``tmp`` is removed if this fails.
    """
    if aoti is None:
        aoti = _wants_aoti(config)
    script_error = scripted if isinstance(scripted, StageError) else None
    program: Optional[torch.jit.ScriptModule] = None if isinstance(scripted, StageError) else scripted
    try:
        if program is None and (exported is None or not aoti):
            raise ExportError(str(script_error))
        dense, kjt, _ = sample
        inputs = {
            "dense": dense.float().contiguous(),
            "lengths": kjt.lengths().to(torch.int32).contiguous(),
            "values": kjt.values().to(torch.int64).contiguous(),
        }
        if kjt.weights_or_none() is not None:
            inputs["weights"] = kjt.weights().float().contiguous()
        runner: nn.Module = program if program is not None else exported  # type: ignore[assignment]
        with torch.no_grad():  # through the blocks every loader will run (export/blocks.py)
            outputs = {k: v.cpu() for k, v in run_in_blocks(runner, config.row_block, len(fields.sparse_features), inputs["dense"],
                                                            inputs["lengths"], inputs["values"], inputs.get("weights")).items()}
        # the tables go into tables.bin once; model.pt and model.pt2 take them from it at load
        tables = TablesWriter()
        tables.add_tables(runner, torchscript=program is not None)
        package = None
        if aoti:
            assert exported is not None
            package = _compile_aoti(tmp, exported, fields, config, script_error)
            tables.add_aoti(package.constants)
        spec = tables.write(tmp, staged)
        if config.repo is not None:  # the newest version's tables, unchanged: one file, hard-linked
            newest = next_version(out) - 1
            if newest > 0:
                link_if_unchanged(tmp, spec, out / str(newest))
        if program is not None:
            with tables.emptied(program):
                # saved to memory first (model.pt is small: its tables are in tables.bin): torch's zip writer aborts the
                # process (std::terminate in a destructor) when the disk fills under it; Python's write raises ENOSPC
                buffer = io.BytesIO()
                torch.jit.save(program, buffer, _extra_files={PINNED_NAME: spec.pinned()})
            write_bytes(tmp / "model.pt", buffer.getbuffer(), "writing model.pt")
        else:
            log.warning("no model.pt (TorchScript): %s; the artifact's program is model.pt2 (torch.export + AOTInductor), "
                        "which both servers and the C++ loader run", script_error)
        aoti_spec = None
        if package is not None:
            aoti_spec, outputs = _finish_aoti(package, fields, inputs, outputs, spec, config.row_block,
                                              reference="model.pt" if program is not None else "the eager model")
        with doing("writing the sample request", tmp / "sample"):
            sample_files = write_sample(tmp, config.sample_batch_size, inputs, outputs)
        output_dims = {k: list(v.shape[1:]) for k, v in outputs.items()}
        manifest = Manifest.from_fields(fields, output_dims, sample_files, file_sha256(tmp / "model.pt") if program is not None else None,
                                        current_versions(), aoti=aoti_spec, tables=spec, row_block=config.row_block)
        if config.plot is not False:  # into the staging folder: it is published with the rest or not at all
            if config.plot:
                plot_artifact(tmp / TABLES_CHART, manifest.to_dict())
            else:
                plot_if_available(plot_artifact, tmp / TABLES_CHART, manifest.to_dict())
        if config.repo is not None:
            def stamp(version: int) -> None:  # the manifest names the version folder it goes into
                manifest.model.version = version
                with doing("writing manifest.json", tmp / "manifest.json"):
                    manifest.write(tmp)

            try:
                publish_version(tmp, out, stamp)
            except RepositoryError as e:
                raise ExportError(str(e)) from None
        else:
            with doing("writing manifest.json", tmp / "manifest.json"):
                manifest.write(tmp)
            if out.exists():  # --overwrite: swapped in at once (a server never sees the version missing)
                exchange(tmp, out)
                shutil.rmtree(tmp)  # the old artifact, now under the staging name
            else:
                os.replace(tmp, out)  # the artifact appears complete or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest.to_dict()


def current_versions() -> Versions:
    """The releases this process exports with: the manifest's ``versions`` (a loader refuses another torch)."""
    return Versions(torch.__version__, getattr(fbgemm_gpu, "__version__", "unknown"), sys.version.split()[0])


def _remove_abandoned(prefix: Path) -> None:
    """Removes staging folders ``<prefix><pid>-<id>`` whose exporting process is gone (killed mid-export);
    those of running exports, and names of any other shape, are left alone."""
    for tmp in prefix.parent.glob(prefix.name + "*"):
        pid = tmp.name[len(prefix.name):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("removed %s, left by an export that did not finish", tmp)
        except PermissionError:  # another user's live process
            pass


def _wants_aoti(config: ExportConfig) -> bool:
    if config.format == "torchscript":
        return False
    if config.device != "cpu":
        if config.format != "auto":
            raise ExportError("--format aoti/both exports CPU models only for now; use --format torchscript with --device cuda")
        return False
    if config.format == "auto" and not compiler_available():
        if config.progress:
            log.warning("no C++ compiler found (or RECSHIP_AOTI=0): writing model.pt (TorchScript) only, no AOTInductor model.pt2")
        return False

    if not shutil.which(os.environ.get("CXX", "g++")):
        raise ExportError("--format aoti/both needs a C++ compiler (g++ or $CXX) for AOTInductor; none found")
    return True


def _compile_aoti(tmp: Path, exported: nn.Module, fields: ModelFields, config: ExportConfig,
                 script_error: Optional[StageError] = None) -> AotiPackage:
    """Compiles ``exported`` into tmp/model.pt2 (without its constants: they go into the tables file).
    ``script_error``: why there is no model.pt, said too if model.pt2 fails (then the model has no program)."""
    num_features = len(fields.sparse_features)
    # a fixed request with every size >= 2 (sizes 0 and 1 would be specialised by torch.export)
    example = (
        torch.zeros(2, fields.num_dense), torch.ones(2 * num_features, dtype=torch.int32),
        torch.zeros(2 * num_features, dtype=torch.int64), torch.ones(2 * num_features) if fields.weighted else None,
    )
    if num_features == 0:
        raise ExportError("an AOTInductor model needs at least one sparse feature")
    isa = None if config.target_isa == "native" else config.target_isa
    try:
        return compile_package(exported, example, num_features, tmp / "model.pt2", target_isa=isa, cache=resolve(config.compile_cache))
    except AotiError as e:
        if script_error is not None:
            raise ExportError(f"{e}; and {script_error}: neither model.pt2 nor model.pt can be built") from e
        raise ExportError(f"{e} (export with --format torchscript to skip model.pt2)") from e


def _finish_aoti(package: AotiPackage, fields: ModelFields, inputs: Dict[str, torch.Tensor], outputs: Dict[str, torch.Tensor],
                 tables: TablesSpec, row_block: int, reference: str = "model.pt") -> Tuple[AotiSpec, Dict[str, torch.Tensor]]:
    """Adds the tables spec to model.pt2 (so it pins the tables), checks it on the sample against ``outputs``
    (``reference``'s: model.pt's, or the eager model's when there is no model.pt) and returns the manifest's
    ``aoti`` with the sample outputs to record: model.pt's where there is one, else model.pt2's own."""
    pin_pt2(package.path, tables)
    try:
        compiled = load_package(package.path, package.target_isa, package.constants)
    except AotiError as e:
        raise ExportError(f"{e} (export with --format torchscript to skip model.pt2)") from e
    spec = AotiSpec(
        file="model.pt2", sha256=file_sha256(package.path), target_isa=package.target_isa, torch=torch.__version__,
        dynamic=package.dynamic, input_order=["dense", "lengths", "values"] + (["weights"] if fields.weighted else []),
        output_order=list(outputs), compile_seconds=round(package.compile_seconds, 2),
    )
    with torch.no_grad():
        got = run_in_blocks(compiled, row_block, len(fields.sparse_features), inputs["dense"], inputs["lengths"], inputs["values"],
                            inputs.get("weights"))
    for k, want in outputs.items():
        if k not in got or got[k].shape != want.shape or (want.numel() and float((got[k] - want).abs().max()) > 1e-5):
            raise ExportError(f"model.pt2 disagrees with {reference} on the sample (output {k!r}): an AOTInductor compilation error")
    return spec, (outputs if reference == "model.pt" else {k: got[k].cpu() for k in outputs})


class _Stages:
    def __init__(self, stages: List[str], enabled: bool) -> None:
        self._bar = None
        if enabled and sys.stderr.isatty():  # a bar on a terminal only: in a log file it is noise
            self._bar = tqdm(total=len(stages), desc="export", unit="stage", file=sys.stderr)
        self._started = False
        self.stage = ""  # the stage running: an OSError names it (recship.oserrors)

    def next(self, name: str) -> None:
        self.stage = name
        if self._bar is not None:
            if self._started:
                self._bar.update(1)
            self._bar.set_description(f"export: {name}")
        self._started = True

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.set_description("export: done")
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _print_summary(manifest: Dict[str, Any], out: Path, config: ExportConfig) -> None:
    if not config.progress:
        return
    print(report_text(manifest))
    v = manifest["validation"]
    diffs = ", ".join(f"{k} {d:.3g}" for k, d in v["max_abs_diff_vs_float"].items())
    quality = f"; {v['output']}: AUC {v['auc']:.4f} (float {v['float_auc']:.4f})" if "auc" in v else ""
    print(f"validation ({v['batches']} batches of {v['batch_size']}, {v['data']}): outputs differ from the float model's by "
          f"{v['relative_diff_vs_float']:.3g} relative; max |difference| {diffs}{quality}")
    if config.repo is not None:
        version = manifest["model"]["version"]
        out = out / str(version)
        print(f"wrote {out} (version {version})")
    else:
        print(f"artifact: {out}")
    if (out / TABLES_CHART).is_file():
        print(f"chart: {out / TABLES_CHART}")


def report_text(manifest: Dict[str, Any]) -> str:
    """The manifest's quantization report as the printed table."""
    q = manifest["quantization"]
    report = QuantizationReport([TableReport(**t) for t in q["tables"]], q["row_alignment"], q["error_minimizing"])
    return str(report)
