"""Sharded training checkpoints on torch.distributed.checkpoint (DCP).

Layout of one checkpoint, ``<root>/step_<N>/``:
    .metadata, __<rank>_0.distcp   DCP's own files (every tensor, sharded or not)
    recship.json                   what recship needs to read it back: format, step,
                                   world size, the sharding plan, the model config,
                                   each table's geometry and optimizer-state layout

Saved tensors (DCP keys):
    tables/<module>/<table>/weight     ShardedTensor [rows, dim] (the plan's shards) of an
                                       EmbeddingBagCollection's or EmbeddingCollection's table
    tables/<module>/<table>/state<i>   the fused optimizer's state i: ShardedTensor
                                       [rows, dim] for adagrad; [rows, G] for row-wise
                                       adagrad, one column per column block of the
                                       saving plan (G = 1 unless column-wise)
    dense/<name>                       every other parameter and buffer (replicated)
    dense_optimizer/...                the torch optimizer's state_dict
    progress/step, progress/next_batch

Because tables are ShardedTensors with global offsets, DCP reshards on load:
a checkpoint written by N ranks under one plan loads under M ranks and another.
A save writes to ``step_<N>.tmp-<id>`` and renames it only once complete, so a
crash never leaves a partial checkpoint where ``latest_checkpoint`` looks.
"""

import json
import os
import shutil
import uuid
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from recship.oserrors import doing, no_space

from recship.trainer.checkpoint_reader import (FORMAT, META_FILE, CheckpointError, data_parallel_key, load_tensors, quiet_dcp,
                                               read_metadata)
from recship.trainer.distributed.sharded_tables import ShardedEmbeddingTables
from recship.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from recship.trainer.fused_optim import EmbOptimType
from recship.trainer.planner.types import ShardingPlan

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ShardedTensor import warns about its future
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor import ShardMetadata as _TorchShardMetadata


# ---------------------------------------------------------------------------
# state of the sharded tables
# ---------------------------------------------------------------------------


def _sharded(local: List[Tuple[List[int], torch.Tensor]], global_size: List[int], rank: int, pg) -> ShardedTensor:
    shards = [
        Shard(t.contiguous(), _TorchShardMetadata(list(offsets), list(t.shape), f"rank:{rank}/{t.device.type}"))
        for offsets, t in local
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards(shards, global_size, process_group=pg)


def _column_blocks(module: ShardedEmbeddingTables, table: str) -> List[int]:
    """Sorted column offsets of the table's shards under the module's plan."""
    return sorted({s.shard_offsets[1] for s in module.module_sharding_plan[table].shards})


def _table_state(path: str, module: ShardedEmbeddingTables, rank: int, pg) -> Dict[str, Any]:
    """DCP entries for every sharded table of ``module`` (this rank's shards)."""
    out: Dict[str, Any] = {}
    shards = module.local_shards()
    states = module.local_optimizer_states()
    rowwise = module.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    for t in module.table_configs():
        if t.name in module.data_parallel:
            continue
        key = f"tables/{path}/{t.name}"
        mine = [(ts, w) for ts, w in shards.items() if ts[0] == t.name]
        offsets = {ts: module.module_sharding_plan[t.name].shards[ts[1]].shard_offsets for ts, _ in mine}
        out[f"{key}/weight"] = _sharded(
            [(offsets[ts], w) for ts, w in mine], [t.num_embeddings, t.embedding_dim], rank, pg
        )
        n_states = len(next(iter(states.values()))) if states else _num_states(module.optimizer)
        blocks = _column_blocks(module, t.name)
        for i in range(n_states):
            if rowwise:
                local = [([offsets[ts][0], blocks.index(offsets[ts][1])], states[ts][i].view(-1, 1)) for ts, _ in mine]
                size = [t.num_embeddings, len(blocks)]
            else:
                local = [(offsets[ts], states[ts][i]) for ts, _ in mine]
                size = [t.num_embeddings, t.embedding_dim]
            out[f"{key}/state{i}"] = _sharded(local, size, rank, pg)
    return out


def _num_states(optim: EmbOptimType) -> int:
    return 0 if optim == EmbOptimType.EXACT_SGD else 1


def _sharded_modules(model: nn.Module) -> List[Tuple[str, ShardedEmbeddingTables]]:
    """Every sharded collection (pooled or sequence) by its unwrapped path."""
    out = []
    for path, m in model.named_modules():
        if isinstance(m, ShardedEmbeddingTables):
            out.append((_strip_wrappers(path), m))
    return out


def _strip_wrappers(name: str) -> str:
    """'_dmp_wrapped_module.module.sparse' (DMP, DDP) -> 'sparse': keys that do not depend on wrapping."""
    parts = name.split(".")
    while parts and parts[0] in ("module", "_dmp_wrapped_module"):
        parts = parts[1:]
    return ".".join(parts)


def _dense_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every state-dict entry but the sharded tables, by unwrapped name (data-parallel tables included,
    as ``<module>.embedding_bags.<table>.weight``, or ``<module>.embeddings.<table>.weight`` for an EmbeddingCollection's)."""
    sharded = set()
    for path, m in _sharded_modules(model):
        prefix = f"{path}." if path else ""
        sharded |= {prefix + m.state_key(t.name) for t in m.table_configs() if t.name not in m.data_parallel}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        name = _strip_wrappers(name)
        if name not in sharded:
            out[name] = t
    return out


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------


def save_checkpoint(
    root: Union[str, Path],
    step: int,
    model: nn.Module,
    dense_optimizer: Optional[torch.optim.Optimizer] = None,
    next_batch: int = 0,
    plan: Optional[ShardingPlan] = None,
    config: Optional[Dict[str, Any]] = None,
) -> Path:
    """Writes ``<root>/step_<step>`` from every rank (a collective); returns its path.

    Args:
        model: a DistributedModelParallel (or any module holding sharded EBCs).
        dense_optimizer: the torch optimizer of the dense parameters.
        next_batch: the data position to resume from.
        plan: the sharding plan (stored so a production job can reuse it).
        config: a JSON-able description of the model (e.g. asdict(DLRMConfig)).
    """
    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = root / f"step_{step:08d}"
    # every rank must write into the same temporary directory: rank 0 names it
    box = [f"step_{step:08d}.tmp-{uuid.uuid4().hex[:8]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    tmp = root / box[0]
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    _barrier()
    state: Dict[str, Any] = {}
    tables_meta: Dict[str, Any] = {}
    for path, module in _sharded_modules(model):
        state.update(_table_state(path, module, rank, None))
        for t in module.table_configs():
            ps = module.module_sharding_plan[t.name]
            tables_meta[f"{path}/{t.name}"] = {
                "config": _table_json(t),
                "collection": module.state_key(t.name).split(".")[0],  # embedding_bags, or an EmbeddingCollection's embeddings
                "sharding_type": ps.sharding_type.value,
                "column_blocks": _column_blocks(module, t.name),
                "optimizer": module.optimizer.value,
                "data_parallel": t.name in module.data_parallel,
            }
    for name, tensor in _dense_state(model).items():
        state[f"dense/{name}"] = tensor.detach()
    optimizer_meta = None
    if dense_optimizer is not None:
        tensors, optimizer_meta = _split_optimizer_state(dense_optimizer.state_dict())
        state.update(tensors)
    state["progress/step"] = torch.tensor(step)
    state["progress/next_batch"] = torch.tensor(next_batch)
    try:
        with doing(f"saving checkpoint {final.name}", tmp):
            _save(state, tmp)
            _barrier()
            if rank == 0:
                _write_meta(tmp, final, step, next_batch, model, tables_meta, optimizer_meta, plan, config)
    except BaseException:  # a full disk, a read-only folder: no partial checkpoint is left behind
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return final


def _save(state: Dict[str, Any], tmp: Path) -> None:
    """DCP's save of ``state`` into ``tmp``; a full disk is an OSError ENOSPC naming the bytes needed and free
    (``recship.oserrors.no_space``), and a rank's OSError is raised as itself, not inside DCP's CheckpointException,
    so that the command says it in one line.

    The space is checked first: when the disk fills under DCP's writer, torch's zip writer reports a
    RuntimeError ("unexpected pos 704 vs 598"), not the ENOSPC behind it."""
    needed = sum(_local_bytes(v) for v in state.values())  # this rank's tensor bytes: DCP's files hold at least these
    short = torch.tensor([int(_free_bytes(tmp) < needed)])
    if dist.is_initialized():  # every rank refuses, or none: a rank alone in DCP's collectives would wait for ever
        dist.all_reduce(short, op=dist.ReduceOp.MAX)
    if short.item():
        raise no_space(tmp, needed)
    try:
        quiet_dcp(dcp.save, state, checkpoint_id=str(tmp))
    except CheckpointException as e:
        failures = getattr(e, "failures", {}) or {}
        for rank in sorted(failures):
            failure = failures[rank]
            error = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(error, OSError):
                raise error from None
        if _free_bytes(tmp) == 0:  # the disk filled meanwhile (another writer): that is why a write failed
            raise no_space(tmp, needed) from e
        raise


def _local_bytes(value: Any) -> int:
    """The bytes of this rank's part of a state value: a tensor, a ShardedTensor's local shards, a DTensor's local part."""
    if isinstance(value, ShardedTensor):
        return sum(s.tensor.numel() * s.tensor.element_size() for s in value.local_shards())
    if hasattr(value, "to_local"):  # a DTensor
        value = value.to_local()
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _free_bytes(folder: Path) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def _write_meta(tmp: Path, final: Path, step: int, next_batch: int, model: nn.Module, tables_meta: Dict[str, Any],
                optimizer_meta: Optional[Dict[str, Any]], plan: Optional[ShardingPlan], config: Optional[Dict[str, Any]]) -> None:
    """Rank 0's last part of a save: the metadata file, then the rename that makes ``final`` appear, complete."""
    meta = {
        "format": FORMAT,
        "step": step,
        "next_batch": next_batch,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "tables": tables_meta,
        "dense_keys": sorted(_dense_state(model)),
        "dense_optimizer": optimizer_meta,
        "plan": json.loads(plan.to_json()) if plan is not None else None,
        "config": config,
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)  # the checkpoint becomes visible only now, complete


def _table_json(t: Union[EmbeddingBagConfig, EmbeddingConfig]) -> Dict[str, Any]:
    d = asdict(t)
    d.pop("init_fn", None)
    d["data_type"] = t.data_type.value
    if isinstance(t, EmbeddingBagConfig):
        d["pooling"] = t.pooling.value
    return d


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------
# find and load
# ---------------------------------------------------------------------------


def load_checkpoint(
    path: Union[str, Path],
    model: nn.Module,
    dense_optimizer: Optional[torch.optim.Optimizer] = None,
) -> Dict[str, Any]:
    """Loads a checkpoint into ``model`` (under any world size and plan); returns its metadata.

    A collective: every rank calls it. Tables are resharded to the model's plan;
    optimizer state follows (row-wise adagrad state of a different column split is
    the width-weighted mean of the saved blocks it covers).
    """
    path = Path(path)
    meta = read_metadata(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharded = _sharded_modules(model)
    state: Dict[str, Any] = {}
    rowwise_templates: Dict[str, torch.Tensor] = {}
    for mpath, module in sharded:
        template = _table_state(mpath, module, rank, None)
        for t in module.table_configs():
            key = f"tables/{mpath}/{t.name}"
            saved = meta["tables"].get(f"{mpath}/{t.name}")
            if saved is None:
                raise CheckpointError(f"{path} has no table {mpath}/{t.name}")
            if saved["config"]["num_embeddings"] != t.num_embeddings or saved["config"]["embedding_dim"] != t.embedding_dim:
                raise CheckpointError(
                    f"table {t.name}: checkpoint has {saved['config']['num_embeddings']}x{saved['config']['embedding_dim']}, "
                    f"model has {t.num_embeddings}x{t.embedding_dim}"
                )
            if t.name in module.data_parallel:
                continue
            state[f"{key}/weight"] = template[f"{key}/weight"]
            same_optimizer = saved["optimizer"] == module.optimizer.value
            if not same_optimizer and rank == 0:
                warnings.warn(f"table {t.name}: optimizer changed ({saved['optimizer']} -> {module.optimizer.value}); its state starts fresh")
            if same_optimizer and module.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
                # [rows, G] of the saving plan: read whole (it is 1/dim of the table) and map onto our shards
                g = len(saved["column_blocks"])
                rowwise_templates[f"{key}/state0"] = torch.zeros(t.num_embeddings, g)
            elif same_optimizer and module.optimizer == EmbOptimType.EXACT_ADAGRAD:
                state[f"{key}/state0"] = template[f"{key}/state0"]
    state.update(rowwise_templates)
    dense = _dense_state(model)
    saved_as = {name: name for name in dense}
    for mpath, module in sharded:  # data-parallel tables of checkpoints written before they were embedding_bags.<t>.weight
        for table in module.data_parallel:
            name = f"{mpath}.{module.state_key(table)}" if mpath else module.state_key(table)
            if name.split(".")[-3] == "embedding_bags":
                saved_as[name] = data_parallel_key(meta, mpath, table)
    missing = sorted(name for name in dense if saved_as[name] not in meta["dense_keys"])
    if missing:
        raise CheckpointError(f"{path} lacks dense parameters {missing}")
    for name, tensor in dense.items():
        state[f"dense/{saved_as[name]}"] = tensor.detach()
    optimizer_tensors: Dict[str, torch.Tensor] = {}
    if dense_optimizer is not None:
        if meta.get("dense_optimizer") is None:
            raise CheckpointError(f"{path} has no dense optimizer state")
        _init_optimizer_state(dense_optimizer)
        optimizer_tensors, _ = _split_optimizer_state(dense_optimizer.state_dict())
        state.update(optimizer_tensors)
    load_tensors(state, path)
    if dense_optimizer is not None:
        dense_optimizer.load_state_dict(_join_optimizer_state(optimizer_tensors, meta["dense_optimizer"], path))
    for mpath, module in sharded:
        _copy_into_tbe(mpath, module, state, meta)
    return meta


def _copy_into_tbe(mpath: str, module: ShardedEmbeddingTables, state: Dict[str, Any], meta: Dict[str, Any]) -> None:
    shards = module.local_shards()
    states = module.local_optimizer_states()
    with torch.no_grad():
        for t in module.table_configs():
            if t.name in module.data_parallel:
                continue
            key = f"tables/{mpath}/{t.name}"
            by_offset = {tuple(s.metadata.shard_offsets): s.tensor for s in state[f"{key}/weight"].local_shards()}
            saved_state = state.get(f"{key}/state0")
            state_shards, rowwise = None, None
            if isinstance(saved_state, ShardedTensor):
                state_shards = {tuple(s.metadata.shard_offsets): s.tensor for s in saved_state.local_shards()}
            elif saved_state is not None:
                rowwise = saved_state
            saved_blocks = meta["tables"][f"{mpath}/{t.name}"]["column_blocks"]
            for (table, idx), w in shards.items():
                if table != t.name:
                    continue
                offsets = tuple(module.module_sharding_plan[table].shards[idx].shard_offsets)
                w.copy_(by_offset[offsets])
                if state_shards is not None:
                    states[(table, idx)][0].copy_(state_shards[offsets])
                elif rowwise is not None:
                    states[(table, idx)][0].copy_(_rowwise_for(rowwise, saved_blocks, t.embedding_dim, offsets, w.shape))


def _rowwise_for(saved: torch.Tensor, blocks: List[int], dim: int, offsets, shape) -> torch.Tensor:
    """Row-wise state of a shard = width-weighted mean of the saved column blocks it overlaps."""
    r0, c0 = offsets
    rows, cols = shape
    edges = blocks + [dim]
    acc = torch.zeros(rows)
    for k in range(len(blocks)):
        overlap = max(0, min(edges[k + 1], c0 + cols) - max(edges[k], c0))
        if overlap:
            acc += saved[r0 : r0 + rows, k] * overlap
    return acc / cols


def _split_optimizer_state(sd: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """A torch optimizer state_dict -> (its tensors under DCP keys, the rest as JSON)."""
    tensors: Dict[str, torch.Tensor] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    for index, per_param in sd["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"dense_optimizer/{index}/{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _join_optimizer_state(tensors: Dict[str, torch.Tensor], saved: Dict[str, Any], path: Path) -> Dict[str, Any]:
    state: Dict[int, Dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split("/")
        state.setdefault(int(index), {})[name] = value
    for index, values in saved["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": saved["param_groups"]}


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates lazily-initialised optimizer state (e.g. Adam's) so DCP has a template to fill.

    A step with zero gradients and learning rate 0 changes no parameter; the state
    it creates is overwritten by the load.
    """
    if optimizer.state:
        return
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, saved_lr):
        g["lr"] = lr


