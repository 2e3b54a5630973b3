"""TorchRec's state_dict of a sharded EmbeddingBagCollection: every table by name, as ShardedTensors.

``ShardedEmbeddingBagCollection.state_dict()`` has the unsharded collection's keys,
``embedding_bags.<table>.weight``:

- a sharded table (table-, row-, column-, table-row-wise) is a ``ShardedTensor`` of the
  table's global shape [num_embeddings, embedding_dim]; its global metadata is the plan's
  shards (offsets, sizes, ``rank:<r>/<device>`` placements) and its local shards are VIEWS
  into this rank's fbgemm TBE (``split_embedding_weights()``, slices of its one flat weight
  buffer). Reading one copies nothing, and ``torch.distributed.checkpoint.load`` into it
  writes the TBE's weights in place;
- a data-parallel table is the replicated plain tensor (the same on every rank).

The fused optimizer's state follows TorchRec's ``EmbeddingFusedOptimizer``: the parameter
``embedding_bags.<table>.weight`` (the same ShardedTensor) holds ``{"<table>.momentum1":
ShardedTensor}`` (then fbgemm's names for further states, e.g. ``exp_avg_sq``):

- pointwise state (EXACT_ADAGRAD: [rows, dim]) is sharded exactly like the weight;
- row-wise state (EXACT_ROWWISE_ADAGRAD: one value per row) is 1-D: [num_embeddings] with
  each shard at its row offset, except for column-wise tables, whose N column shards each
  keep their own row-wise state: [N * num_embeddings], shard i (by column offset) at
  i * num_embeddings. Like TorchRec, such a state loads only under the same column split.

Every rank builds the same global metadata from the plan, so building the ShardedTensors
needs no collective (they are built once, at sharding time).
"""

import warnings
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from recship.trainer.planner.types import ParameterSharding, ShardMetadata

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # ShardedTensor's module warns about its future on import
    from torch.distributed._shard.metadata import ShardMetadata as TorchShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties


# (shard index in the plan, this rank's view of it)
LocalShards = List[Tuple[int, torch.Tensor]]


def placement(shard: ShardMetadata, rank: int, device: torch.device) -> str:
    """``rank:<r>/<device>`` of a plan shard; this rank's own shards name the device they live on."""
    return f"rank:{shard.rank}/{device}" if shard.rank == rank else shard.placement


def make_sharded_tensor(
    local: List[Tuple[TorchShardMetadata, torch.Tensor]],
    metadata: List[TorchShardMetadata],
    size: List[int],
    dtype: torch.dtype,
    pg: Any,
) -> ShardedTensor:
    """A ShardedTensor of global ``size`` over ``metadata`` whose local shards are the given tensors (not copied)."""
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False)
    global_md = ShardedTensorMetadata(shards_metadata=metadata, size=torch.Size(size), tensor_properties=properties)
    shards = [Shard(t, md) for md, t in local]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_md, process_group=pg)


def table_metadata(ps: ParameterSharding, rank: int, device: torch.device) -> List[TorchShardMetadata]:
    """torch's ShardMetadata of every shard of a table's plan, in the plan's order."""
    return [TorchShardMetadata(list(s.shard_offsets), list(s.shard_sizes), placement(s, rank, device)) for s in ps.shards]


def weight_tensor(
    ps: ParameterSharding, size: List[int], local: LocalShards, rank: int, device: torch.device, pg: Any
) -> ShardedTensor:
    """The table's ShardedTensor [rows, dim]: global metadata from the plan, local shards = ``local`` views."""
    md = table_metadata(ps, rank, device)
    return make_sharded_tensor([(md[i], w) for i, w in local], md, size, local[0][1].dtype if local else torch.float32, pg)


# The fused optimizers' states by EmbOptimType name: (TorchRec's key after "<table>.", pointwise?).
# TorchRec names the first state "momentum1" and the others as fbgemm's get_optimizer_state() does.
OPTIMIZER_STATES: Dict[str, List[Tuple[str, bool]]] = {
    "EXACT_SGD": [],
    "EXACT_ADAGRAD": [("momentum1", True)],
    "EXACT_ROWWISE_ADAGRAD": [("momentum1", False)],
    "ADAM": [("momentum1", True), ("exp_avg_sq", True)],
    "PARTIAL_ROWWISE_ADAM": [("momentum1", True), ("exp_avg_sq", False)],
    "LAMB": [("momentum1", True), ("exp_avg_sq", True)],
}


def optimizer_state_tensor(
    ps: ParameterSharding, size: List[int], local: LocalShards, pointwise: bool, rank: int, device: torch.device, pg: Any
) -> ShardedTensor:
    """One fused-optimizer state of a table as TorchRec lays it out (see the module docstring).

    ``local``: (shard index, the state tensor of that shard): [rows, cols] if ``pointwise``, else [rows].
    """
    rows, dim = size
    md = table_metadata(ps, rank, device)
    example = local[0][1] if local else None
    for _, t in local:
        assert t.dim() == (2 if pointwise else 1), f"optimizer state of shape {list(t.shape)}, pointwise={pointwise}"
    if pointwise:
        dtype = example.dtype if example is not None else torch.float32
        return make_sharded_tensor([(md[i], t) for i, t in local], md, size, dtype, pg)
    column_wise = any(s.shard_sizes[1] != dim for s in ps.shards)
    if column_wise and any(s.shard_sizes[0] != rows for s in ps.shards):
        raise ValueError(f"a table split by rows and columns at once has no row-wise optimizer-state layout: {ps.shards}")
    order = sorted(range(len(ps.shards)), key=lambda i: ps.shards[i].shard_offsets[1])
    state_md: Dict[int, TorchShardMetadata] = {}
    for position, i in enumerate(order):
        s = ps.shards[i]
        offset = position * rows if column_wise else s.shard_offsets[0]
        state_md[i] = TorchShardMetadata([offset], [s.shard_sizes[0]], md[i].placement)
    total = rows * len(ps.shards) if column_wise else rows
    dtype = example.dtype if example is not None else torch.float32
    return make_sharded_tensor([(state_md[i], t) for i, t in local], [state_md[i] for i in range(len(ps.shards))], [total], dtype, pg)


def local_parameter(local: LocalShards, device: torch.device) -> nn.Parameter:
    """``embedding_bags.<table>.weight`` of a sharded table on this rank: a view into the TBE (not trained by autograd).

    One local shard: its [rows, cols] view. Several (column blocks of one table on one rank,
    which sit one after the other in the TBE's buffer): the span over them viewed
    [-1, cols of the first] as TorchRec does. None: an empty [0] tensor.
    """
    if not local:
        return nn.Parameter(torch.empty(0, device=device), requires_grad=False)
    if len(local) == 1:
        return nn.Parameter(local[0][1], requires_grad=False)
    first = local[0][1]
    offset, total = first.storage_offset(), 0
    for _, w in local:
        assert w.storage_offset() == offset + total and w.is_contiguous(), "a table's shards are adjacent in the TBE"
        total += w.numel()
    span = first.as_strided((total,), (1,), offset)
    cols = first.shape[1]
    return nn.Parameter(span.view(-1, cols) if total % cols == 0 else span, requires_grad=False)


def copy_into_shards(
    name: str, value: Any, ps: ParameterSharding, size: List[int], local: LocalShards
) -> None:
    """Writes ``value`` (a ShardedTensor with this rank's shards, or the full [rows, dim] tensor) into ``local``.

    ShardedTensor shards must match this plan's (offsets and sizes); to load under another
    plan or world size, read the checkpoint with torch.distributed.checkpoint, which reshards.
    """
    with torch.no_grad():
        if isinstance(value, ShardedTensor):
            if list(value.size()) != list(size):
                raise ValueError(f"{name}: the state_dict's table is {list(value.size())}, the model's is {size}")
            given = {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
            for i, w in local:
                s = ps.shards[i]
                src = given.get(tuple(s.shard_offsets))
                if src is None or tuple(src.shape) != tuple(w.shape):
                    raise ValueError(
                        f"{name}: the ShardedTensor has no local shard at offsets {s.shard_offsets} of size "
                        f"{s.shard_sizes} (it was sharded under another plan); load it with "
                        "torch.distributed.checkpoint.load, which reshards, or pass the full tensor"
                    )
                if src.data_ptr() != w.data_ptr():
                    w.copy_(src)
        elif isinstance(value, torch.Tensor):
            if list(value.shape) != list(size):
                raise ValueError(f"{name}: the state_dict's table is {list(value.shape)}, the model's is {size}")
            for i, w in local:
                (r0, c0), (rows, cols) = ps.shards[i].shard_offsets, ps.shards[i].shard_sizes
                w.copy_(value[r0 : r0 + rows, c0 : c0 + cols])
        else:
            raise TypeError(f"{name}: expected a ShardedTensor or a tensor, got {type(value).__name__}")
