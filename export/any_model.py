"""Export of any model that holds embedding collections (not only the built-in DLRM).

The model contract: an ``nn.Module`` whose ``forward(dense, features)`` takes ``dense``
float32 [B, num_dense] (num_dense may be 0) and ``features`` a KeyedJaggedTensor, and
returns a Tensor [B, ...] or a Dict[str, Tensor] of [B, ...] tensors; its
EmbeddingBagCollections and EmbeddingCollections may sit anywhere in its tree, and its
forward must be traceable by torch.fx with those collections as leaves (no Python
branching on tensor values; transforms of raw inputs, such as a log of dense counts,
belong in forward so that clients send raw values).

The steps are TorchRec's inference flow on recship's modules: ``quantize_embeddings``,
``shard_quant_model``, ``recship.fx`` tracing, TorchScript; then the exported model is
checked against the float model and the unsharded quantized one on synthetic batches
and written as the usual artifact, which the server, its KServe fronts and the C++
loader serve without model-specific code.

A model comes in memory or from a checkpoint (``recship train --model``); either way its
EmbeddingBagCollections' float tables stream one at a time (``_streamed_quantization``). Not yet: CUDA.
"""

import copy
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from recship.export.artifact import ModelFields, ModelInfo, Sharding, SparseFeature
from recship.export.model import build_kjt, trace_and_script
from recship.quantize.flat import flatten_collections
from recship.quantize.sharded import Shard
from recship.sparse import KeyedJaggedTensor, KeyedTensor
from recship.trainer.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from recship.trainer.entry_point import describe_model

if TYPE_CHECKING:
    from recship.export.config import ExportConfig

torch.fx.wrap(build_kjt)  # one fx node here too (fx.wrap patches per importing module)


class ExportedModule(nn.Module):
    """The artifact's entry point around a user's (quantized) model: request tensors in, named outputs out."""

    def __init__(self, model: nn.Module, feature_names: List[str], single_output: bool) -> None:
        super().__init__()
        self.model = model
        self._feature_names = list(feature_names)
        self._single_output = single_output  # a constant when traced: the branch below is resolved then

    def forward(
        self, dense: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> Dict[str, torch.Tensor]:
        out = self.model(dense, build_kjt(self._feature_names, values, lengths, weights))
        if self._single_output:
            return {"output": out}
        return out


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


def _as_dict(out, error) -> Dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"output": out}
    if isinstance(out, dict) and out and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out.items()):
        return out
    raise error(f"the model's forward returned {type(out).__name__}; a model to export returns a Tensor or a Dict[str, Tensor]")


def _validation_batches(spec: Dict[str, Any], config, data_seed: Optional[int]):
    """([(dense, kjt, labels or None)], what they are): the user's data, else synthetic batches drawn
    like the training run's (with its labelling model) when the seed is known, else plain random ones."""
    from recship.export.validation import eval_batches
    from recship.trainer.data import SyntheticConfig, SyntheticCriteo

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


def _swap(model: nn.Module, paths: List[str], module: nn.Module) -> None:
    for path in paths:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, module)


def tables_by_reference(module: nn.Module) -> Tuple[nn.Module, Callable[[str, str], torch.Tensor]]:
    """(a copy of ``module`` whose EmbeddingBagCollections hold their tables on meta, ``load_table(path, table)``
    reading a table from ``module`` itself): an in-memory model streams its tables as a checkpoint does, and
    no float table is copied."""
    memo: Dict[int, Any] = {}
    for _, m in module.named_modules():
        if type(m) is EmbeddingBagCollection:
            for p in m.parameters():
                memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    copied = copy.deepcopy(module, memo)

    def load_table(path: str, table: str) -> torch.Tensor:
        ebc = module.get_submodule(path) if path else module
        assert isinstance(ebc, EmbeddingBagCollection)  # the path of one in the copy, which has the same tree
        bag = ebc.embedding_bags[table]
        assert isinstance(bag, nn.EmbeddingBag)  # an EmbeddingBagCollection holds one per table
        return bag.weight.detach()

    return copied, load_table


def _streamed_quantization(model: nn.Module, validation, load_table, quantize):
    """Quantizes ``model`` (its EBC tables on meta, loaded one at a time by ``load_table(path, table)``)
    and returns (float outputs per validation batch, quantized model, report).

    The float model never exists whole. First the model runs each validation batch with stand-ins for its
    EBCs that keep the features each EBC call gets (what the model's forward made of the request: features
    it hashed, filtered or passed to a shared collection twice). Then each float table is loaded once and
    its pooled lookups for those calls are recorded; the float outputs come from the model with recorded
    stand-ins for its EBCs and its float EmbeddingCollections.
    """
    from recship.export.validation import pooled_lookup

    paths: Dict[int, List[str]] = {}
    modules: Dict[int, nn.Module] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if type(m) in (EmbeddingBagCollection, EmbeddingCollection):
            paths.setdefault(id(m), []).append(path)
            modules[id(m)] = m
    first = {key: ps[0] for key, ps in paths.items()}
    bags = {key: m for key, m in modules.items() if isinstance(m, EmbeddingBagCollection)}
    layout = {key: ([f for t in m.embedding_bag_configs() for f in t.feature_names],
                    [t.embedding_dim for t in m.embedding_bag_configs() for _ in t.feature_names]) for key, m in bags.items()}
    captured = {key: _Captured(*layout[key]) for key in bags}
    try:
        for key, stand_in in captured.items():
            _swap(model, paths[key], stand_in)
        with torch.no_grad():
            for dense, kjt, _ in validation:
                for stand_in in captured.values():
                    stand_in.calls.append([])
                model(dense, kjt)
    finally:
        for key in captured:
            _swap(model, paths[key], bags[key])
    weighted = {first[key]: m.is_weighted() for key, m in bags.items()}
    calls = {first[key]: stand_in.calls for key, stand_in in captured.items()}
    recorded: Dict[str, List[List[Dict[str, torch.Tensor]]]] = {
        path: [[{} for _ in batch] for batch in per_batch] for path, per_batch in calls.items()}

    def record(path: str, table, weight: torch.Tensor) -> None:
        for batch, per_batch in zip(calls[path], recorded[path]):
            for features, pooled in zip(batch, per_batch):
                for f in table.feature_names:
                    pooled[f] = pooled_lookup(weight, features[f], table, weighted[path])

    quantized, report = quantize(model, load_table, record)
    stand_ins: Dict[int, nn.Module] = {}
    for key, m in modules.items():
        if key in bags:
            stand_ins[key] = _Recorded(*layout[key], recorded[first[key]])
        else:
            stand_ins[key] = m  # the float EmbeddingCollection (its weights were loaded with the dense part)
    done = {key: quantized.get_submodule(ps[0]) if ps[0] else quantized for key, ps in paths.items()}
    outputs = []
    try:
        for key, replacement in stand_ins.items():
            _swap(quantized, paths[key], replacement)
        with torch.no_grad():
            for i, (dense, kjt, _) in enumerate(validation):
                for replacement in stand_ins.values():
                    if isinstance(replacement, _Recorded):
                        replacement.index, replacement.call = i, 0
                outputs.append(quantized(dense, kjt))
    finally:
        for key, q in done.items():
            _swap(quantized, paths[key], q)
    return outputs, quantized, report


def export_any_model(
    module: nn.Module,
    config: "ExportConfig",
    progress: Callable[[str], None],
    owned: bool = False,
    data_seed: Optional[int] = None,
    load_table: Optional[Callable[[str, str], torch.Tensor]] = None,
) -> Tuple[Any, ModelFields, Any, nn.Module]:
    """(scripted artifact module, manifest fields, sample batch, the module that was scripted) of ``module``;
    see the module docstring.

    ``config`` is the ExportConfig; ``progress(stage)`` advances the caller's stage bar.
    ``owned``: the module was built for this export (from a checkpoint), so it is quantized in place.
    ``data_seed``: the training run's seed, for synthetic validation data drawn like its own.
    ``load_table(path, table)``: the EmbeddingBagCollections' tables are on meta and stream
    from a checkpoint one at a time; without it they stream from ``module`` itself (``tables_by_reference``).
    Either way peak memory is one float table plus the quantized model, beside the float model given.
    """
    from recship.export.config import ExportError, expand_id_policy
    from recship.export.validation import refuse_non_finite
    from recship.quantize.sharded import InferenceShard, shard_quant_model
    from recship.quantize import quantize_embeddings

    if config.device != "cpu":
        raise ExportError("exporting a model other than the built-in DLRM runs on CPU only for now (--device cpu)")
    if load_table is None:
        model, load_table = tables_by_reference(module)
    else:
        model = module if owned else copy.deepcopy(module)
    model.eval()
    try:
        spec = describe_model(model, config.num_dense)
    except ValueError as e:
        raise ExportError(str(e)) from None
    names = [f[0] for f in spec["features"]]
    config = dataclasses.replace(config, id_policy=expand_id_policy(config.id_policy, names))
    unknown = sorted(set(config.id_policy) - set(names))
    if unknown:
        raise ExportError(f"id policy names features the model does not have: {unknown}")
    validation, data = _validation_batches(spec, config, data_seed)

    def quantize(target: nn.Module, weights=None, on_table=None):
        return quantize_embeddings(  # in place: ``target`` is this export's own model
            target, inplace=True, weights=weights, on_table=on_table, dtype=config.dtype, table_dtypes=dict(config.table_dtypes),
            error_budget=config.error_budget or 0.01, error_minimizing=config.error_minimizing,
            id_policy=dict(config.id_policy), seed=config.seed,
        )

    try:
        progress("quantize + shard")
        raw, quantized, report = _streamed_quantization(model, validation, load_table, quantize)
    except ValueError as e:
        raise ExportError(str(e)) from None
    except Exception as e:
        raise ExportError(f"the float model failed on a validation batch ({data}): {type(e).__name__}: {e}") from e
    single = isinstance(raw[0], torch.Tensor)  # a lone Tensor is served as the output "output"
    float_outputs = [_as_dict(r, ExportError) for r in raw]
    for outputs in float_outputs:
        refuse_non_finite(outputs, "the float model", model)
    for k, v in float_outputs[0].items():
        if v.dim() == 0 or v.shape[0] != validation[0][0].shape[0]:
            raise ExportError(f"output {k!r} has shape {list(v.shape)}: outputs must be batch-first [B, ...]")
    # the output that AUC and log loss are measured on, if the data has labels: the model's eval_output or its one output
    score_name = getattr(module, "eval_output", None) or (next(iter(float_outputs[0])) if len(float_outputs[0]) == 1 else None)
    if score_name is not None and (score_name not in float_outputs[0] or float_outputs[0][score_name][0].numel() != 1):
        score_name = None

    try:
        sharded: nn.Module = quantized
        plans: Dict[str, Dict[str, List[InferenceShard]]] = {}
        if config.shards > 1 or config.sharding:
            sharded, plans = shard_quant_model(quantized, shards=config.shards, sharding=config.sharding or "table_wise")
    except ValueError as e:
        raise ExportError(str(e)) from None

    progress("trace + script")
    exported = ExportedModule(flatten_collections(sharded), names, single).eval()
    try:
        scripted = trace_and_script(exported)
    except Exception as e:
        raise ExportError(
            f"fx tracing / TorchScript of {type(module).__name__} failed: {type(e).__name__}: {e} "
            "(its forward must be traceable by torch.fx: no Python branches on tensor values)"
        ) from e

    progress("validate")
    unsharded = ExportedModule(quantized, names, single).eval()
    max_diff: Dict[str, float] = {}
    sums = [0.0, 0.0]
    vs_quantized = 0.0
    with torch.no_grad():
        scored: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for (dense, kjt, labels), want in zip(validation, float_outputs):
            args = (dense, kjt.lengths().to(torch.int32), kjt.values().to(torch.int64), kjt.weights_or_none())
            got, reference = scripted(*args), unsharded(*args)
            refuse_non_finite(got, "the exported model", model)
            if labels is not None and score_name is not None:
                scored.append((got[score_name].reshape(-1), want[score_name].reshape(-1), labels))
            for k, w in want.items():
                max_diff[k] = max(max_diff.get(k, 0.0), float((got[k] - w).abs().max()) if w.numel() else 0.0)
                sums[0] += float((got[k] - w).double().norm() ** 2)
                sums[1] += float(w.double().norm() ** 2)
                scale = max(1.0, float(reference[k].abs().max()) if reference[k].numel() else 1.0)
                vs_quantized = max(vs_quantized, float((got[k] - reference[k]).abs().max()) / scale if w.numel() else 0.0)
    relative = (sums[0] / max(sums[1], 1e-30)) ** 0.5
    if vs_quantized > 1e-4:
        raise ExportError(f"validation failed: the exported model differs from the unsharded quantized model by {vs_quantized:.3g} "
                          "(more than float rounding): a sharding or tracing error")
    if config.error_budget is not None and relative > config.error_budget:
        raise ExportError(f"validation failed: the outputs' relative difference from the float model is {relative:.3g}, "
                          f"over the error budget {config.error_budget:g} (choose wider types or a larger --error-budget)")
    validation_report = {
        "data": data,
        "batches": len(validation),
        "batch_size": config.validation_batch_size,
        "max_abs_diff_vs_float": max_diff,
        "relative_diff_vs_float": relative,
        "max_relative_diff_vs_unsharded_quantized": vs_quantized,
        "error": relative,
    }
    if scored:  # labels and a [B, 1] logit output: the ranking quality, exported and float
        from recship.trainer.metrics import auc

        scores, float_scores, targets = (torch.cat(parts) for parts in zip(*scored))
        bce = nn.functional.binary_cross_entropy_with_logits
        validation_report.update(output=score_name, auc=auc(scores, targets), float_auc=auc(float_scores, targets),
                                 log_loss=float(bce(scores, targets)), float_log_loss=float(bce(float_scores, targets)))

    types = {t.table: t.data_type for t in report.tables}
    features = []
    for f, path, t, pooling, weighted in spec["features"]:
        qualified = f"{path}.{t.name}" if path else t.name
        features.append(SparseFeature(f, qualified, pooling, t.embedding_dim, t.num_embeddings, types[qualified],
                                      config.id_policy.get(f, "reject"), weighted))
    shards: List[Shard] = [dataclasses.replace(s, table=f"{path}.{table}" if path else table)
              for path, plan in plans.items() for table, table_shards in plan.items() for s in table_shards]
    entry_point = {"model": config.model, "args": config.model_args} if config.model else None
    fields = ModelFields(
        model=ModelInfo(config.model_name, config.model_version, "module",
                        {"class": f"{type(module).__module__}.{type(module).__qualname__}", "entry_point": entry_point, "config": None}),
        num_dense=spec["num_dense"],
        weighted=spec["weighted"],
        sparse_features=features,
        sharding=Sharding("cpu", config.shards, report.row_alignment, shards),
        quantization=report.to_dict(),
        validation=validation_report,
    )
    return scripted, fields, synthetic_batch(spec, config.sample_batch_size, config.seed * 7919 + 104729), exported

