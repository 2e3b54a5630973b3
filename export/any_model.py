"""Export of a model: any ``nn.Module`` that follows the model contract, the built-in DLRM and a bare
EmbeddingBagCollection alike (one path for all).

The model contract: an ``nn.Module`` whose ``forward(dense, features)`` takes ``dense``
float32 [B, num_dense] (num_dense may be 0) and ``features`` a KeyedJaggedTensor, and
returns a Tensor [B, ...] or a Dict[str, Tensor] of [B, ...] tensors (or names its served
outputs with ``serving_outputs``, as the DLRM does: ``recship.export.model``); its
EmbeddingBagCollections and EmbeddingCollections may sit anywhere in its tree, and its
forward must be traceable by torch.fx with those collections as leaves (no Python
branching on tensor values; transforms of raw inputs, such as a log of dense counts,
belong in forward so that clients send raw values). A bare EmbeddingBagCollection is
exported as ``PooledEmbeddings``: each feature's pooled embedding.

The steps are TorchRec's inference flow on recship's modules: quantize the tables
(straight into their inference shards: ``plan_inference_shards``, ``shard_quantized``),
``recship.fx`` tracing, TorchScript; then the exported model is checked against the float
model and the unsharded quantized one (``quantized_pooled_lookup``) on validation batches
and written as the usual artifact, which the server, its KServe fronts and the C++ loader
serve without model-specific code.

A model comes in memory or from a checkpoint (``recship train``); either way its
EmbeddingBagCollections' float tables stream one at a time (``_streamed_quantization``),
so peak memory is one float table plus the quantized model.
"""

import copy
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from recship.contract import Shard
from recship.contract.tables import split_table_name, table_name
from recship.export.artifact import MAX_ID_BOUND, ModelFields, ModelInfo, Sharding, SparseFeature
from recship.export.config import ExportConfig, ExportError, expand_id_policy
from recship.export.model import ExportedModule, PooledEmbeddings, StageError, build_kjt, served_outputs, trace_and_script
from recship.export.validation import Batch, eval_batches, pooled_lookup, quantized_pooled_lookup, refuse_non_finite
from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection, get_embedding_names_by_table
from recship.modules.types import DataType
from recship.quantize import quantize_embeddings
from recship.quantize.flat import FlatEmbeddingBagCollection, FlatEmbeddingCollection, flatten_collections
from recship.quantize.quantizer import HostRows
from recship.quantize.rowwise import row_bytes
from recship.quantize.sharded import InferenceShard, plan_inference_shards, shard_quantized
from recship.sparse import KeyedJaggedTensor, KeyedTensor
from recship.trainer.data import SyntheticConfig, SyntheticCriteo
from recship.trainer.entry_point import describe_model
from recship.trainer.managed_collisions import BaseManagedCollisionEmbeddingCollection
from recship.trainer.metrics import auc
from recship.trainer.planner.types import ShardingType

torch.fx.wrap(build_kjt)  # one fx node here too (fx.wrap patches per importing module)


def synthetic_batch(spec: Dict[str, Any], batch: int, seed: int) -> Tuple[torch.Tensor, KeyedJaggedTensor]:
    """A held-out request: dense ~ U[0, 1), 0-4 ids per feature and example, uniform over each table."""
    g = torch.Generator().manual_seed(seed)
    features = spec["features"]
    lengths = torch.randint(0, 5, (len(features) * batch,), generator=g)
    rows = torch.tensor([f[2].num_embeddings for f in features]).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
    weights = torch.rand(values.numel(), generator=g) if spec["weighted"] else None
    kjt = KeyedJaggedTensor(keys=[f[0] for f in features], values=values, lengths=lengths.to(torch.int32), weights=weights)
    return torch.rand(batch, spec["num_dense"], generator=g), kjt


def _validation_batches(spec: Dict[str, Any], config, data_seed: Optional[int]):
    """([(dense, kjt, labels or None)], what they are): the user's data, else synthetic batches drawn
    like the training run's (with its labelling model) when the seed is known, else plain random ones."""
    names = [f[0] for f in spec["features"]]
    rows = [f[2].num_embeddings for f in spec["features"]]
    n, batch = config.validation_batches, config.validation_batch_size
    if config.eval_data is not None:
        return eval_batches(config.eval_data, names, rows, spec["num_dense"], spec["weighted"], n, batch), config.eval_data
    if data_seed is not None:
        gen = SyntheticCriteo(SyntheticConfig(rows, num_dense=spec["num_dense"], batch_size=batch, seed=data_seed,
                                              weighted=spec["weighted"]), names)
        batches = [gen.batch(i, 2_000_000) for i in range(n)]  # a stream training never reads
        return [(b.dense, b.sparse, b.labels) for b in batches], f"synthetic, as the training run's (seed {data_seed})"
    return [(*synthetic_batch(spec, batch, config.seed * 7919 + i), None) for i in range(n)], "synthetic (uniform ids, no labels)"


class _Captured(nn.Module):
    """Stands in for a float EmbeddingBagCollection while the model runs once per validation batch: keeps the
    features each call gets (a collection shared by two paths is called more than once) and answers zeros."""

    def __init__(self, keys: List[str], dims: List[int]) -> None:
        super().__init__()
        self.keys, self.dims = keys, dims
        self.calls: List[List[KeyedJaggedTensor]] = []  # per validation batch, the features of each call

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        self.calls[-1].append(features)
        return KeyedTensor(keys=self.keys, length_per_key=self.dims, values=torch.zeros(features.stride(), sum(self.dims)), key_dim=1)


class _Recorded(nn.Module):
    """Stands in for a float EmbeddingBagCollection: for batch ``index``, the pooled lookups recorded for its calls, in order."""

    def __init__(self, keys: List[str], dims: List[int], per_batch: List[List[Dict[str, torch.Tensor]]]) -> None:
        super().__init__()
        self.keys, self.dims, self.per_batch, self.index, self.call = keys, dims, per_batch, 0, 0

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled = self.per_batch[self.index][self.call]
        self.call += 1
        return KeyedTensor(keys=self.keys, length_per_key=self.dims, values=torch.cat([pooled[k] for k in self.keys], dim=1), key_dim=1)


def raw_id_bounds(model: nn.Module, spec: Dict[str, Any]) -> Dict[str, int]:
    """feature -> the exclusive upper bound of the raw ids a request may send, for each feature whose collection
    sits behind a managed-collision module (``describe_model``'s ``spec``): the manifest's id_bound.

    TorchRec's managed-collision modules take raw ids in [0, input_hash_size) (``input_size()``); with an
    ``input_hash_func`` (which maps any id into that range) or an ``input_hash_size`` of 0 (TorchRec's hash-ZCH
    modules' "no bound"), any non-negative id: MAX_ID_BOUND, every int64 id but INT64_MAX (the empty-slot mark
    of the sorted-ids modules, and their default input_hash_size). A range smaller than the table's rows gives
    the rows: the remapping takes those ids as it takes any other. ValueError for a negative input_hash_size."""
    bounds: Dict[str, int] = {}
    for feature, path, table, _, _ in spec["features"]:
        parent, _, leaf = path.rpartition(".")
        owner = model.get_submodule(parent) if path else None
        if not (isinstance(owner, BaseManagedCollisionEmbeddingCollection) and leaf == "_embedding_module"):
            continue
        module = owner._managed_collision_collection._mc_modules()[table.name]
        size = module.input_size()
        if size < 0:
            raise ValueError(f"the managed-collision module of table {table.name!r} has input_hash_size {size}: it must be >= 0")
        if size == 0 or getattr(module, "_input_hash_func", None) is not None:
            size = MAX_ID_BOUND
        bounds[feature] = max(min(size, MAX_ID_BOUND), table.num_embeddings)
    return bounds


def _swap(model: nn.Module, paths: List[str], module: nn.Module) -> None:
    for path in paths:
        model.set_submodule(path, module)


def tables_by_reference(module: nn.Module) -> Tuple[nn.Module, Callable[[str, str], torch.Tensor]]:
    """(a copy of ``module`` whose EmbeddingBagCollections hold their tables on meta and whose EmbeddingCollections
    share ``module``'s own tables, ``load_table(path, table)`` reading an EBC table from ``module`` itself): an
    in-memory model streams its tables as a checkpoint does, and no float table is copied. The export reads
    ``module``'s tables and never writes them (it swaps the copy's collections for quantized ones): ``module`` is
    left as it was."""
    memo: Dict[int, Any] = {}
    for _, m in module.named_modules():
        if type(m) is EmbeddingBagCollection:
            for p in m.parameters():
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        elif type(m) is EmbeddingCollection:  # quantized whole from the copy's collection: its tables are these
            for p in m.parameters():
                memo[id(p)] = p
    copied = copy.deepcopy(module, memo)

    def load_table(path: str, table: str) -> torch.Tensor:
        ebc = module.get_submodule(path) if path else module
        assert isinstance(ebc, EmbeddingBagCollection)  # the path of one in the copy, which has the same tree
        bag = ebc.embedding_bags[table]
        assert isinstance(bag, nn.EmbeddingBag)  # an EmbeddingBagCollection holds one per table
        return bag.weight.detach()

    return copied, load_table


def _streamed_quantization(model: nn.Module, validation: List[Batch], load_table, quantize):
    """Quantizes ``model`` (its EBC tables on meta, loaded one at a time by ``load_table(path, table)``) and
    returns (float outputs per validation batch, the quantized reference's outputs, quantized model, report).

    The float model never exists whole. First the model runs each validation batch with stand-ins for its
    EBCs that keep the features each EBC call gets (what the model's forward made of the request: features
    it hashed, filtered or passed to a shared collection twice). Then each float table is loaded once, and
    its float and quantized pooled lookups for those calls are recorded (``quantize(model, load_table,
    record)`` calls ``record(path, table, weight, data_type, blocks)``). The float outputs come from the
    model with recorded float stand-ins for its EBCs and its float EmbeddingCollections; the reference
    outputs (what the unsharded quantized model answers) from recorded quantized stand-ins and the
    quantized EmbeddingCollections.
    """
    paths: Dict[int, List[str]] = {}
    modules: Dict[int, nn.Module] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if type(m) in (EmbeddingBagCollection, EmbeddingCollection):
            paths.setdefault(id(m), []).append(path)
            modules[id(m)] = m
    first = {key: ps[0] for key, ps in paths.items()}
    bags = {key: m for key, m in modules.items() if isinstance(m, EmbeddingBagCollection)}
    # each collection's outputs (a feature's name; feature@table for a feature several of its tables look up) and widths
    output_names = {key: get_embedding_names_by_table(m.embedding_bag_configs()) for key, m in bags.items()}
    layout = {key: ([name for names in output_names[key] for name in names],
                    [t.embedding_dim for t in m.embedding_bag_configs() for _ in t.feature_names]) for key, m in bags.items()}
    output_of = {first[key]: {t.name: names for t, names in zip(m.embedding_bag_configs(), output_names[key])}
                 for key, m in bags.items()}
    captured = {key: _Captured(*layout[key]) for key in bags}

    def new_batch(stand_in: nn.Module, index: int) -> None:
        assert isinstance(stand_in, _Captured)  # the stand-ins of this run
        stand_in.calls.append([])

    with torch.no_grad():
        _run(model, paths, captured, validation, new_batch)
    weighted = {first[key]: m.is_weighted() for key, m in bags.items()}
    calls = {first[key]: stand_in.calls for key, stand_in in captured.items()}
    recorded: Dict[str, Dict[str, List[List[Dict[str, torch.Tensor]]]]] = {
        which: {path: [[{} for _ in batch] for batch in per_batch] for path, per_batch in calls.items()} for which in ("float", "quantized")}

    def record(path: str, table, weight: torch.Tensor, data_type: DataType, error_minimizing: bool,
               blocks: List[Tuple[int, int]]) -> None:
        for batch, floats, quants in zip(calls[path], recorded["float"][path], recorded["quantized"][path]):
            for features, pooled, stored in zip(batch, floats, quants):
                for f, name in zip(table.feature_names, output_of[path][table.name]):
                    pooled[name] = pooled_lookup(weight, features[f], table, weighted[path])
                    stored[name] = quantized_pooled_lookup(weight, features[f], table, weighted[path], data_type, error_minimizing,
                                                           blocks)

    quantized, report = quantize(model, load_table, record)
    done = {key: quantized.get_submodule(ps[0]) if ps[0] else quantized for key, ps in paths.items()}
    outputs: Dict[str, List[Any]] = {}
    for which in ("float", "quantized"):
        stand_ins = {key: _Recorded(*layout[key], recorded[which][first[key]]) if key in bags
                     else (modules[key] if which == "float" else done[key])  # an EmbeddingCollection: loaded whole
                     for key in modules}

        def start(stand_in: nn.Module, index: int) -> None:
            if isinstance(stand_in, _Recorded):
                stand_in.index, stand_in.call = index, 0

        with torch.no_grad():
            outputs[which] = _run(quantized, paths, stand_ins, validation, start)
    return outputs["float"], outputs["quantized"], quantized, report


def _run(model: nn.Module, paths: Dict[int, List[str]], stand_ins: Mapping[int, nn.Module], validation: List[Batch],
         start: Callable[[nn.Module, int], None]) -> List[Any]:
    """``model``'s answers to the validation batches with ``stand_ins`` in place of its collections
    (``start(stand_in, batch index)`` before each batch); the collections are put back after."""
    originals = {key: model.get_submodule(ps[0]) if ps[0] else model for key, ps in paths.items() if key in stand_ins}
    outputs = []
    try:
        for key, stand_in in stand_ins.items():
            _swap(model, paths[key], stand_in)
        for i, (dense, kjt, _) in enumerate(validation):
            for stand_in in stand_ins.values():
                start(stand_in, i)
            outputs.append(model(dense, kjt))
    finally:
        for key, original in originals.items():
            _swap(model, paths[key], original)
    return outputs


def _dense_to(model: nn.Module, device: torch.device) -> None:
    """Moves ``model``'s parameters and buffers to ``device``, except the flat collections' (their shards
    stay on the devices they were placed on)."""
    def move(m: nn.Module) -> None:
        if isinstance(m, (FlatEmbeddingBagCollection, FlatEmbeddingCollection)):
            return
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = b.to(device)
        for child in m.children():
            move(child)

    move(model)


def export_any_model(
    module: nn.Module,
    config: ExportConfig,
    progress: Callable[[str], None],
    owned: bool = False,
    data_seed: Optional[int] = None,
    load_table: Optional[Callable[[str, str], torch.Tensor]] = None,
    torchscript_required: bool = True,
    host_rows: Optional[HostRows] = None,
) -> Tuple[Any, ModelFields, Any, nn.Module]:
    """(scripted artifact module or a StageError, manifest fields, sample batch, the module torch.export takes)
    of ``module``; see the module docstring. The stages, each a function below: ``_prepare`` (the model's
    contract, id policies, validation batches), ``_quantize`` (tables into their quantized modules or inference
    shards, float and reference outputs), ``_script`` (fx trace + TorchScript), ``_validate``, ``_fields``.

    ``config`` is the ExportConfig; ``progress(stage)`` advances the caller's stage bar.
    ``torchscript_required``: fx trace + TorchScript failing is an ExportError; else (model.pt2 will be the
    artifact's program) the StageError is returned in place of the scripted module and validation runs
    the module torch.export takes.
    ``owned``: the module was built for this export (from a checkpoint), so it is quantized in place.
    ``data_seed``: the training run's seed, for synthetic validation data drawn like its own.
    ``load_table(path, table)``: the EmbeddingBagCollections' tables are on meta and stream
    from a checkpoint one at a time; without it they stream from ``module`` itself (``tables_by_reference``).
    Either way peak memory is one float table plus the quantized model, beside the float model given.
    ``host_rows``: where the quantized CPU rows are allocated (``recship.quantize.HostRows``: the pipeline's mapping
    of the tables file it writes); None: fbgemm's own.
    """
    prepared = _prepare(module, config, owned, data_seed, load_table)
    progress("quantize + shard")
    quantized = _quantize(prepared, host_rows)
    progress("trace + script")
    scripted, exported = _script(prepared, quantized, torchscript_required)
    progress("validate")
    runner = exported if isinstance(scripted, StageError) else scripted
    validation = _validate(runner, prepared.validation, quantized.float_outputs, quantized.reference_outputs,
                           quantized.score_name, prepared.data, prepared.config, prepared.model,
                           quantized.tasks.get(quantized.score_name or "", 0))
    sample = synthetic_batch(prepared.spec, config.sample_batch_size, config.seed * 7919 + 104729)
    return scripted, _fields(prepared, quantized, validation), sample, exported


@dataclasses.dataclass
class _Prepared:
    """What ``_prepare`` found: the user's module (a bare EBC wrapped as PooledEmbeddings), the model this export
    quantizes (a copy unless owned) and how its tables load, its contract (``describe_model``'s spec), the config
    with per-feature id policies, raw-id bounds of managed-collision features, and the validation batches."""

    module: nn.Module
    model: nn.Module
    bare: bool
    load_table: Callable[[str, str], torch.Tensor]
    spec: Dict[str, Any]
    names: List[str]
    config: ExportConfig
    bounds: Dict[str, int]
    validation: List[Batch]
    data: str

    def qualified(self, path: str, table: str) -> str:
        """A table's manifest name, ``<collection path>.<table>`` (a bare EBC's tables keep their own names)."""
        path = path[len(PooledEmbeddings.PATH):].lstrip(".") if self.bare else path
        return table_name(path, table)


def _prepare(module: nn.Module, config: ExportConfig, owned: bool, data_seed: Optional[int],
             load_table: Optional[Callable[[str, str], torch.Tensor]]) -> _Prepared:
    """The model's contract and this export's choices checked against it (ExportError naming what is wrong)."""
    bare = type(module) is EmbeddingBagCollection
    if bare:  # its tables keep their names: the wrapper's path is left out of them
        module = PooledEmbeddings(module)
    if load_table is None:
        model, load_table = tables_by_reference(module)
    else:
        model = module if owned else copy.deepcopy(module)
    model.eval()
    try:
        spec = describe_model(model, None if bare else config.num_dense)
    except ValueError as e:
        raise ExportError(str(e)) from None
    names = [f[0] for f in spec["features"]]
    config = dataclasses.replace(config, id_policy=expand_id_policy(config.id_policy, names))
    folded = sorted(f for f in spec["shared"] if config.id_policy.get(f, "reject") == "modulo")
    if folded:  # id % rows differs per table: each table would see another id than the client sent
        raise ExportError(f"features {folded} feed several tables (shared features): their ids take the id policy "
                          "'reject' (ids outside the smallest of their tables are refused), not 'modulo'")
    unknown = sorted(set(config.id_policy) - set(names))
    if unknown:
        raise ExportError(f"id policy names features the model does not have: {unknown}")
    try:
        bounds = raw_id_bounds(model, spec)
    except ValueError as e:
        raise ExportError(str(e)) from None
    remapped = sorted(f for f in bounds if config.id_policy.get(f, "reject") != "reject")
    if remapped:  # a front folding raw ids into the rows would hand the remapping other ids than the client's
        raise ExportError(f"features {remapped} are remapped by managed-collision modules: their raw ids take the id policy "
                          "'reject' (ids outside the module's input range are refused), not 'modulo'")
    held = {(path, t.name) for path, t in spec["tables"]}
    unknown = sorted(set(config.table_dtypes) - {t for _, t in held} - {table_name(path, t) for path, t in held})
    if unknown:
        raise ExportError(f"--table-dtype names tables the model does not have: {unknown}")
    validation, data = _validation_batches(spec, config, data_seed)
    return _Prepared(module, model, bare, load_table, spec, names, config, bounds, validation, data)


@dataclasses.dataclass
class _Quantized:
    """What ``_quantize`` made: the quantized model and its report, where each collection's rows went
    (``plans``: inference shards per collection path; ``devices``), and the float model's and the unsharded
    quantized reference's outputs on the validation batches, with the output scored for AUC (``score_name``)
    and a multi-task model's {output: label column} (``tasks``)."""

    model: nn.Module
    report: Any  # QuantizationReport
    plans: Dict[str, Dict[str, List[InferenceShard]]]
    devices: List[torch.device]
    single: bool
    float_outputs: List[Dict[str, torch.Tensor]]
    reference_outputs: List[Dict[str, torch.Tensor]]
    score_name: Optional[str]
    tasks: Dict[str, int]


class _Placement:
    """Where each collection's quantized rows go (``quantize_embeddings``' ``layout``): one
    QuantEmbeddingBagCollection, or inference shards on ``devices`` when the export shards or runs on CUDA."""

    def __init__(self, config: ExportConfig) -> None:
        self.config = config
        self.devices = [torch.device(config.device, i) if config.device == "cuda" else torch.device("cpu")
                        for i in range(config.shards)]
        self.sharded = config.shards > 1 or bool(config.sharding) or config.device != "cpu"
        self.capacity = _device_capacity(config)
        self.stored: Dict[str, Tuple[Dict[str, DataType], Dict[str, List[Tuple[int, int]]]]] = {}  # path -> (types, column blocks)
        self.plans: Dict[str, Dict[str, List[InferenceShard]]] = {}

    def layout(self, path: str, tables, types: Dict[str, DataType], weighted: bool, qconfig):
        if not self.sharded:
            self.stored[path] = (types, {t.name: [(0, t.embedding_dim)] for t in tables})
            return None
        sizes = {t.name: t.num_embeddings * row_bytes(types[t.name], t.embedding_dim, qconfig.alignment) for t in tables}
        forced = {t.name: ShardingType(self.config.sharding) for t in tables} if self.config.sharding else None
        self.plans[path] = plan = plan_inference_shards(tables, self.config.shards, forced, sizes, self.capacity)
        self.stored[path] = (types, {t.name: sorted({(s.col_offset, s.cols) for s in plan[t.name]}) for t in tables})
        return shard_quantized(tables, types, plan, self.devices, weighted, qconfig.id_policy, qconfig.alignment,
                               host_rows=qconfig.host_rows)

    def quantize(self, target: nn.Module, weights, record, host_rows: Optional[HostRows]):
        """``target`` quantized in place (it is this export's own model); ``record`` sees each float table with
        its type and column blocks (``_streamed_quantization``)."""
        config = self.config

        def on_table(path: str, table, weight: torch.Tensor) -> None:
            types, blocks = self.stored[path]
            record(path, table, weight, types[table.name], config.error_minimizing, blocks[table.name])

        return quantize_embeddings(
            target, inplace=True, weights=weights, on_table=on_table, layout=self.layout, dtype=config.dtype,
            table_dtypes=dict(config.table_dtypes), error_budget=config.error_budget or 0.01,
            error_minimizing=config.error_minimizing, id_policy=dict(config.id_policy), seed=config.seed, device=config.device,
            host_rows=host_rows,
        )


def _quantize(prepared: _Prepared, host_rows: Optional[HostRows]) -> _Quantized:
    """The tables quantized (straight into their shards), and the float and reference outputs checked: finite,
    batch-first. ExportError naming the failure; an OSError (the disk's: tables.bin fills here) as it is."""
    placement = _Placement(prepared.config)
    model, validation, data = prepared.model, prepared.validation, prepared.data
    try:
        raw, raw_reference, quantized, report = _streamed_quantization(
            model, validation, prepared.load_table, lambda target, weights, record: placement.quantize(target, weights, record, host_rows))
        single = isinstance(raw[0], torch.Tensor)  # a lone Tensor is served as the output "output"
        float_outputs = [served_outputs(model, r) for r in raw]
        reference_outputs = [served_outputs(model, r) for r in raw_reference]
    except (ExportError, OSError):
        raise
    except ValueError as e:
        raise ExportError(str(e)) from None
    except Exception as e:
        raise ExportError(f"the float model failed on a validation batch ({data}): {type(e).__name__}: {e}") from e
    for outputs in float_outputs:
        refuse_non_finite(outputs, "the float model", model)
    for k, v in float_outputs[0].items():
        if v.dim() == 0 or v.shape[0] != validation[0][0].shape[0]:
            raise ExportError(f"output {k!r} has shape {list(v.shape)}: outputs must be batch-first [B, ...]")
    # the output that AUC and log loss are measured on, if the data has labels: the model's eval_output or its one output
    tasks = dict(getattr(prepared.module, "eval_outputs", None) or {})  # a multi-task model's {output: label column}
    score_name = (getattr(prepared.module, "eval_output", None) or next(iter(tasks), None)
                  or (next(iter(float_outputs[0])) if len(float_outputs[0]) == 1 else None))
    if score_name is not None and (score_name not in float_outputs[0] or float_outputs[0][score_name][0].numel() != 1):
        score_name = None
    return _Quantized(quantized, report, placement.plans, placement.devices, single, float_outputs, reference_outputs,
                      score_name, tasks)


def _script(prepared: _Prepared, quantized: _Quantized,
            torchscript_required: bool) -> Tuple[Union[torch.jit.ScriptModule, StageError], nn.Module]:
    """(TorchScript of the served module, or the StageError that kept it from TorchScript when model.pt2 may be the
    artifact's program alone; the served module itself, which torch.export takes)."""
    flat = flatten_collections(quantized.model)
    _dense_to(flat, quantized.devices[0])  # the dense layers run where the shards' outputs are merged: the first device
    exported = ExportedModule(flat, prepared.names, quantized.single, str(quantized.devices[0])).eval()
    try:
        return trace_and_script(exported, _source_file(type(prepared.module))), exported
    except StageError as e:
        if torchscript_required:
            raise ExportError(f"{type(prepared.module).__name__}: {e}{_stage_hint(e.stage)}") from e
        return e, exported  # model.pt2 alone: torch.export takes the module itself


def _fields(prepared: _Prepared, quantized: _Quantized, validation: Dict[str, Any]) -> ModelFields:
    """The manifest's model fields: features (each with its table's manifest name, type, id policy and raw-id
    bound), shards, the quantization report under the tables' manifest names, and the validation report."""
    config, spec, report = prepared.config, prepared.spec, quantized.report
    types = {t.table: t.data_type for t in report.tables}  # named "<path>.<table>" by quantize_embeddings
    features = []
    for f, path, t, pooling, weighted in spec["features"]:
        key = table_name(path, t.name)
        features.append(SparseFeature(f, prepared.qualified(path, t.name), pooling, t.embedding_dim, t.num_embeddings,
                                      types[key], config.id_policy.get(f, "reject"), weighted, prepared.bounds.get(f)))
    shards: List[Shard] = [dataclasses.replace(s, table=prepared.qualified(path, table))
                           for path, plan in quantized.plans.items() for table, table_shards in plan.items() for s in table_shards]
    tables = [dataclasses.replace(t, table=prepared.qualified(*split_table_name(t.table))) for t in report.tables]
    report = dataclasses.replace(report, tables=tables)
    entry_point = {"model": config.model, "args": config.model_args} if config.model else None
    user = prepared.module.collection if prepared.bare else prepared.module
    shape = getattr(user, "config", None)  # a model's config dataclass (the DLRM's DLRMConfig), recorded for people
    details = {"class": f"{type(user).__module__}.{type(user).__qualname__}", "entry_point": entry_point,
               "config": dataclasses.asdict(shape) if dataclasses.is_dataclass(shape) and not isinstance(shape, type) else None}
    return ModelFields(
        model=ModelInfo(config.model_name, config.model_version, "module", details),
        num_dense=spec["num_dense"],
        weighted=spec["weighted"],
        sparse_features=features,
        sharding=Sharding(config.device, config.shards, report.row_alignment, shards),
        quantization=report.to_dict(),
        validation=validation,
    )


def _source_file(cls: type) -> Optional[str]:
    """The file that defines ``cls`` (where a failing trace points in the user's code), or None."""
    try:
        return inspect.getsourcefile(cls)
    except TypeError:  # a class defined in the interpreter
        return None


def _stage_hint(stage: str) -> str:
    """What to do about a failed fx trace / TorchScript, for the error's end."""
    if stage == "fx trace":
        return (" (torch.fx runs the forward on proxies: a size or tensor value is no Python number there; "
                "--format aoti exports through torch.export without TorchScript where a C++ compiler is present)")
    return " (--format aoti exports model.pt2 alone through torch.export, without TorchScript, where a C++ compiler is present)"


def _device_capacity(config: ExportConfig) -> Optional[int]:
    """Bytes of quantized rows one shard's device may hold: 90% of the smallest GPU's memory; None on CPU
    (host memory: the OS decides)."""
    if config.device == "cuda":
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(config.shards)) * 9 // 10
    return None


def _validate(scripted, validation: List[Batch], float_outputs: List[Dict[str, torch.Tensor]],
              reference_outputs: List[Dict[str, torch.Tensor]], score_name: Optional[str], data: str,
              config: ExportConfig, model: nn.Module, column: int = 0) -> Dict[str, Any]:
    """The manifest's ``validation``: the exported model against the float model and the unsharded quantized
    reference on the validation batches. ExportError when it differs from the reference beyond float
    rounding (a sharding or tracing bug), or from the float model beyond ``config.error_budget``. ``column``: the
    label column ``score_name`` is scored on, where the labels are [B, T]."""
    max_diff: Dict[str, float] = {}
    sums = [0.0, 0.0]
    vs_quantized = 0.0
    scored: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for (dense, kjt, labels), want, reference in zip(validation, float_outputs, reference_outputs):
            raw = scripted(dense, kjt.lengths().to(torch.int32), kjt.values().to(torch.int64), kjt.weights_or_none())
            got = {k: v.cpu() for k, v in raw.items()}
            refuse_non_finite(got, "the exported model", model)
            if labels is not None and score_name is not None:
                scored.append((got[score_name].reshape(-1), want[score_name].reshape(-1), labels[:, column] if labels.dim() == 2 else labels))
            for k, w in want.items():
                if not w.numel():
                    max_diff.setdefault(k, 0.0)
                    continue
                max_diff[k] = max(max_diff.get(k, 0.0), float((got[k] - w).abs().max()))
                sums[0] += float((got[k] - w).double().norm() ** 2)
                sums[1] += float(w.double().norm() ** 2)
                scale = max(1.0, float(reference[k].abs().max()))
                vs_quantized = max(vs_quantized, float((got[k] - reference[k]).abs().max()) / scale)
    relative = (sums[0] / max(sums[1], 1e-30)) ** 0.5
    if vs_quantized > 1e-4:
        raise ExportError(f"validation failed: the exported model differs from the unsharded quantized model by {vs_quantized:.3g} "
                          "(more than float rounding): a sharding or tracing error")
    if config.error_budget is not None and relative > config.error_budget:
        raise ExportError(f"validation failed: the outputs' relative difference from the float model is {relative:.3g}, "
                          f"over the error budget {config.error_budget:g} (choose wider types or a larger --error-budget)")
    report: Dict[str, Any] = {
        "data": data,
        "batches": len(validation),
        "batch_size": config.validation_batch_size,
        "max_abs_diff_vs_float": max_diff,
        "relative_diff_vs_float": relative,
        "max_relative_diff_vs_unsharded_quantized": vs_quantized,
        "error": relative,
    }
    if scored:  # labels and a [B, 1] logit output: the ranking quality, exported and float
        scores, float_scores, targets = (torch.cat(parts) for parts in zip(*scored))
        bce = nn.functional.binary_cross_entropy_with_logits
        report.update(output=score_name, auc=auc(scores, targets), float_auc=auc(float_scores, targets),
                      log_loss=float(bce(scores, targets)), float_log_loss=float(bce(float_scores, targets)))
    return report
