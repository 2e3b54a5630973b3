"""HybridEvalDMP (TorchRec's ``torchrec.distributed.model_parallel.HybridEvalDMP``): DistributedModelParallel for
evaluation with the embedding tables and the dense part on different devices (say, tables in host memory, dense
layers on a GPU), and the ranks of one host sharing one copy of their tables.

    dmp = HybridEvalDMP(model, env=ShardingEnv.from_process_group(own_group), device=torch.device("cpu"))
    dmp.to("cuda")                          # the dense part only: the sharded tables stay where they are
    dmp.share_embedding_memory(host_group)  # every rank of the host now reads rank 0's table memory

As TorchRec's: no data-parallel wrapper unless asked (``init_data_parallel=False`` by default: evaluation has no
gradients to all-reduce); ``to`` moves every parameter and buffer except those under a sharded module; the
constructor leaves the training flag as it is (TorchRec's docstring says it calls ``eval()``, its code does not):
call ``eval()``.

``share_embedding_memory(pg)`` puts the storage of every CPU tensor of the sharded modules into POSIX shared memory
on the group's rank 0 and maps it on the others, no data copied. The ranks must hold the same tables, as when each
rank runs its own single-rank DMP of one model: recship checks that every rank's storages have the same sizes,
types and contents before mapping (a ValueError otherwise, on every rank) and then points the tables' weights and
the lookup kernels' buffers at the shared storage. (TorchRec's maps the storage into a detached copy of each
parameter, ``param.data.set_(...)``, which leaves the parameter and its kernel on the rank's own memory.)
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from recship.trainer.distributed.sharded_module import ShardedModule
from recship.trainer.distributed.sharded_tables import ShardedEmbeddingTables
from recship.trainer.model_parallel import DistributedModelParallel

_SHARDED = (ShardedModule, ShardedEmbeddingTables)


def _sharded_modules(root: nn.Module) -> List[nn.Module]:
    """The outermost sharded modules under ``root``."""
    found: List[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, _SHARDED):
                found.append(child)
            else:
                walk(child)

    if isinstance(root, _SHARDED):
        return [root]
    walk(root)
    return found


def _tensors(module: nn.Module) -> List[torch.Tensor]:
    """Every tensor a sharded module reads: its parameters and buffers and those of its lookup kernels (which are
    not submodules: see ``ShardedEmbeddingTables``)."""
    out = [t for t in module.parameters()] + [t for t in module.buffers()]
    for m in module.modules():
        for kernel in getattr(m, "_tbes", None) or []:
            out += list(kernel.parameters()) + list(kernel.buffers())
    return out


def _storage_meta(storage: torch.UntypedStorage) -> Tuple[int, int]:
    """(bytes, a checksum of them) of a CPU storage."""
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
    return int(storage.nbytes()), int(torch.sum(as_bytes, dtype=torch.int64))


class HybridEvalDMP(DistributedModelParallel):
    """DistributedModelParallel for evaluation with split device placement (see the module docstring).

    Args:
        module: the model, as DistributedModelParallel takes it.
        init_data_parallel: wrap the dense part in DDP (default False: evaluation all-reduces nothing).
        kwargs: DistributedModelParallel's other arguments (env, device, plan, sharders, init_parameters, ...).
    """

    def __init__(self, module: nn.Module, *, init_data_parallel: bool = False, **kwargs: Any) -> None:
        super().__init__(module, init_data_parallel=init_data_parallel, **kwargs)

    def to(self, *args: Any, **kwargs: Any) -> "HybridEvalDMP":  # type: ignore[override]
        """Moves (or casts) every parameter and buffer outside the sharded modules, as ``nn.Module.to`` takes it;
        the sharded tables stay on their device."""

        def move(m: nn.Module) -> None:
            for name, p in m._parameters.items():
                if p is not None:
                    m._parameters[name] = nn.Parameter(p.data.to(*args, **kwargs), requires_grad=p.requires_grad)
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(*args, **kwargs)
            for child in m.children():
                if not isinstance(child, _SHARDED):
                    move(child)

        move(self.module)
        return self

    def share_embedding_memory(self, pg: dist.ProcessGroup) -> None:
        """Maps the sharded modules' CPU storage of ``pg``'s rank 0 into every rank of ``pg`` (one host's ranks).

        A collective: every rank of ``pg`` calls it. ValueError (on every rank) when the ranks' tables differ.
        """
        tensors = [t for m in _sharded_modules(self.module) for t in _tensors(m) if t.device.type == "cpu" and t.numel() > 0]
        storages: Dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        ptrs = list(storages)
        meta = [_storage_meta(storages[p]) for p in ptrs]
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        everyone: List[Optional[List[Tuple[int, int]]]] = [None] * size
        dist.all_gather_object(everyone, meta, group=pg)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise ValueError(f"share_embedding_memory: rank {r} of the group holds other tables than its rank 0 "
                                 f"({len(theirs or [])} storages of {[b for b, _ in theirs or []]} bytes and checksums "
                                 f"{[c for _, c in theirs or []]}, against {[b for b, _ in everyone[0] or []]} bytes and "
                                 f"{[c for _, c in everyone[0] or []]}): only ranks holding the same tables can share them")
        if not ptrs:
            return
        handles: List[Any] = [None]
        if rank == 0:  # moves each storage into /dev/shm in place: every tensor on it follows
            handles = [[tuple(storages[p]._share_filename_cpu_()) for p in ptrs]]
        dist.broadcast_object_list(handles, src=dist.get_global_rank(pg, 0), group=pg)
        if rank != 0:
            shared = {p: torch.UntypedStorage._new_shared_filename_cpu(*h) for p, h in zip(ptrs, handles[0])}
            with torch.no_grad():
                for t in tensors:
                    new = shared.get(t.untyped_storage().data_ptr())
                    if new is not None:
                        t.set_(new, t.storage_offset(), t.shape, t.stride())
        dist.barrier(group=pg)


__all__ = ["HybridEvalDMP"]
