"""DistributedModelParallel: shard every EmbeddingBagCollection of a model, DDP the rest.

    model = DistributedModelParallel(model, device=torch.device("cpu"),
                                     optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.05))
    dense_opt = torch.optim.SGD(model.dense_parameters(), lr=0.05)
    loss = loss_fn(model(dense, kjt)); loss.backward()   # sharded tables update here
    dense_opt.step(); dense_opt.zero_grad()

The fused optimizer updates the sharded tables inside backward; only the dense
parameters (and data-parallel tables) go to a torch optimizer.
"""

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recship.trainer.distributed.sharded_ebc import FUSED_PARAMETER_MARK, ShardedEmbeddingBagCollection
from recship.trainer.embedding_modules import EmbeddingBagCollection
from recship.trainer.fused_optim import FusedOptimizerConfig
from recship.trainer.planner import EmbeddingShardingPlanner, ShardingPlan, Topology


class FusedOptimizer:
    """Handle on the optimizers fused into every sharded table of a model."""

    def __init__(self, modules: List[ShardedEmbeddingBagCollection], config: FusedOptimizerConfig) -> None:
        self._modules = modules
        self.config = config

    def set_learning_rate(self, lr: float) -> None:
        """Changes the learning rate from the next backward on."""
        for m in self._modules:
            m.set_learning_rate(lr)
        self.config.learning_rate = lr

    def step(self) -> None:
        """No-op: the update already happened in backward (kept for optimizer-loop symmetry)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: fused tables keep no gradients."""


class DistributedModelParallel(nn.Module):
    """Wraps ``module``: EmbeddingBagCollections sharded per ``plan``, the rest under DDP.

    Args:
        module: any model; every EmbeddingBagCollection inside it is sharded.
            Build it on "meta" to allocate only the shards each rank owns.
        pg: process group (default: the world, which must be initialised).
        plan: a ShardingPlan; planned with EmbeddingShardingPlanner (on rank 0,
            broadcast) when None.
        device: this rank's device.
        optimizer: settings of the fused embedding optimizer.
    """

    def __init__(
        self,
        module: nn.Module,
        pg: Optional[dist.ProcessGroup] = None,
        plan: Optional[ShardingPlan] = None,
        device: Optional[torch.device] = None,
        optimizer: Optional[FusedOptimizerConfig] = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("DistributedModelParallel needs torch.distributed.init_process_group first")
        device = torch.device(device or "cpu")
        optimizer = optimizer or FusedOptimizerConfig()
        optimizer.check_device(device.type)
        world_size = dist.get_world_size(pg)
        if plan is None:
            local = _local_world_size(world_size)
            topology = Topology(world_size=world_size, compute_device=device.type, local_world_size=local)
            plan = EmbeddingShardingPlanner(topology, optimizer=optimizer).collective_plan(module, pg)
        self.plan = plan
        sharded: List[ShardedEmbeddingBagCollection] = []
        for path, sub in list(module.named_modules()):
            if not isinstance(sub, EmbeddingBagCollection):
                continue
            tables = plan.get_plan_for_module(path)
            if tables is None:
                raise ValueError(f"the sharding plan has no entry for module {path or '<root>'!r}")
            replacement = ShardedEmbeddingBagCollection(sub, tables, optimizer, pg=pg, device=device)
            sharded.append(replacement)
            if path == "":
                module = replacement
            else:
                parent, _, name = path.rpartition(".")
                setattr(module.get_submodule(parent) if parent else module, name, replacement)
        if not sharded:
            raise ValueError("DistributedModelParallel found no EmbeddingBagCollection in the model")
        _materialize_dense(module, device, sharded)
        self._sharded = sharded
        self.fused_optimizer = FusedOptimizer(sharded, optimizer)
        if world_size > 1 and any(True for _ in self._dense_params(module)):
            # DDP must neither all-reduce nor broadcast from rank 0 what differs per rank:
            # the fused tables and the TBE's per-rank metadata buffers.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, _per_rank_state(module))
            self.module = DistributedDataParallel(module, process_group=pg, device_ids=None if device.type == "cpu" else [device])
        else:
            self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def unwrapped(self) -> nn.Module:
        m = self.module
        return m.module if isinstance(m, DistributedDataParallel) else m

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters for a torch optimizer: everything but the fused tables."""
        return self._dense_params(self.unwrapped)

    @staticmethod
    def _dense_params(module: nn.Module) -> Iterator[nn.Parameter]:
        for _, p in in_backward_optimizer_filter(module.named_parameters()):
            yield p

    def sharded_modules(self) -> List[ShardedEmbeddingBagCollection]:
        return list(self._sharded)


def in_backward_optimizer_filter(
    named_parameters: Iterator[Tuple[str, nn.Parameter]], include: bool = False
) -> Iterator[Tuple[str, nn.Parameter]]:
    """Filters ``model.named_parameters()`` for a torch optimizer.

    With include=False (the default) it yields the parameters a torch optimizer
    should update (dense layers, data-parallel tables) and drops those whose
    optimizer is fused into backward (the sharded tables); include=True yields
    only the fused ones.
    """
    for name, p in named_parameters:
        if getattr(p, FUSED_PARAMETER_MARK, False) == include:
            yield name, p


def _per_rank_state(module: nn.Module) -> List[str]:
    """Names of the parameters and buffers of every fused TBE (different on every rank)."""
    names = []
    for path, sub in module.named_modules():
        if isinstance(sub, ShardedEmbeddingBagCollection) and sub.tbe is not None:
            prefix = f"{path}.tbe." if path else "tbe."
            names += [prefix + n for n, _ in sub.tbe.named_parameters()]
            names += [prefix + n for n, _ in sub.tbe.named_buffers()]
    return names


def _materialize_dense(module: nn.Module, device: torch.device, sharded: List[nn.Module]) -> None:
    """Allocates and initialises meta-device dense submodules (sharded ones are already real)."""
    skip = {id(m) for s in sharded for m in s.modules()}
    for sub in module.modules():
        if id(sub) in skip:
            continue
        own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
        if any(t.is_meta for t in own):
            sub.to_empty(device=device, recurse=False)
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()


def _local_world_size(world_size: int) -> int:
    import os

    value = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return value if world_size % value == 0 else world_size
