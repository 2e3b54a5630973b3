"""GradientAccumulationWrapper (TorchRec's): N micro-batches through a pipeline step the dense parameters once, as one
step on the micro-batches concatenated (a loss summed over examples), an incomplete last cycle is stepped at
StopIteration; under DistributedModelParallel on 2 gloo ranks the fused-in-backward tables still update every
micro-batch (as TorchRec's), the dense parameters once per cycle, and DDP all-reduces only on a cycle's last
micro-batch. References: plain PyTorch on the whole batches."""

from dataclasses import dataclass
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.distributed import (EmbeddingBagCollectionSharder, GradientAccumulationConfig, GradientAccumulationWrapper, ShardingPlan,
                                 TrainPipelineBase, TrainPipelineSparseDist, construct_module_sharding_plan, row_wise)
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.fused_optim import EmbOptimType
from recship.trainer.model_parallel import DistributedModelParallel


@dataclass
class Batch:
    dense: torch.Tensor  # [B, 3]
    target: torch.Tensor  # [B]
    kjt: KeyedJaggedTensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return self


def test_config_defaults_and_checks():
    assert GradientAccumulationConfig() == GradientAccumulationConfig(False, 1, 1)
    assert GradientAccumulationConfig(num_steps=4).is_enabled  # enabled by num_steps > 1, as TorchRec's
    assert not GradientAccumulationConfig(num_steps=1).is_enabled
    for bad in ({"num_steps": 0}, {"num_warmup_steps": 0}, {"num_steps": 2.0}):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            GradientAccumulationConfig(**bad)


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        pred = self.lin(batch.dense).squeeze(1)
        return (pred - batch.target) ** 2, pred  # per-example losses: the pipeline sums them


def _dense_batches(n: int, size: int = 4) -> List[Batch]:
    g = torch.Generator().manual_seed(7)
    empty = KeyedJaggedTensor(keys=[], values=torch.empty(0, dtype=torch.long), lengths=torch.empty(0, dtype=torch.int))
    return [Batch(torch.randn(size, 3, generator=g), torch.randn(size, generator=g), empty) for _ in range(n)]


@pytest.mark.parametrize("pipeline_type", [TrainPipelineBase, TrainPipelineSparseDist])
def test_accumulated_steps_equal_steps_on_concatenated_batches(pipeline_type):
    batches = _dense_batches(5)
    torch.manual_seed(0)
    model = Dense()
    reference = Dense()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # momentum: an extra or missing step shows
    wrapped = GradientAccumulationWrapper(pipeline_type(model, opt, torch.device("cpu")), opt, model,
                                          GradientAccumulationConfig(num_steps=3))
    it = iter(batches)
    outputs = []
    with pytest.raises(StopIteration):
        while True:
            outputs.append(wrapped.progress(it))
    assert len(outputs) == 5 and wrapped.current_step == 5

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for cycle in (batches[:3], batches[3:]):  # the last cycle is incomplete: stepped at StopIteration
        whole = Batch(torch.cat([b.dense for b in cycle]), torch.cat([b.target for b in cycle]), cycle[0].kjt)
        ref_opt.zero_grad()
        reference(whole)[0].sum().backward()
        ref_opt.step()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], want, atol=1e-6, rtol=0, msg=name)
    assert all(p.grad is None for p in model.parameters())  # the flush clears what it stepped


def test_set_step_reset_and_disabled():
    batches = _dense_batches(4)
    torch.manual_seed(0)
    model = Dense()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pipeline = TrainPipelineBase(model, opt, torch.device("cpu"))
    wrapped = GradientAccumulationWrapper(pipeline, opt, model, GradientAccumulationConfig(num_steps=2))
    assert pipeline._optimizer is wrapped.optimizer_wrapper and wrapped.optimizer_wrapper.param_groups is opt.param_groups
    before = model.lin.weight.detach().clone()
    wrapped.set_step(2)  # cycle boundary at 2: the next call is a cycle's first, it does not step
    wrapped.progress(iter(batches))
    assert torch.equal(model.lin.weight, before) and model.lin.weight.grad is not None
    wrapped.progress(iter(batches))
    assert not torch.equal(model.lin.weight, before)
    wrapped.reset()
    assert wrapped.current_step == 0
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        wrapped.set_step(-1)
    # disabled: the pipeline is left alone and steps every batch
    opt2 = torch.optim.SGD(model.parameters(), lr=0.05)
    plain = TrainPipelineBase(model, opt2, torch.device("cpu"))
    off = GradientAccumulationWrapper(plain, opt2, model, GradientAccumulationConfig())
    assert plain._optimizer is opt2
    w0 = model.lin.weight.detach().clone()
    off.progress(iter(batches))
    assert not torch.equal(model.lin.weight, w0)
    with pytest.raises(TypeError, match="GradientAccumulationConfig"):
        GradientAccumulationWrapper(plain, opt2, model, {"num_steps": 2})


# -- DistributedModelParallel on 2 gloo ranks ----------------------------------------------------------------------------

LOCAL, ROWS, DIM, LR, N_STEPS, MICRO = 3, 10, 4, 0.1, 2, 4


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=ROWS, feature_names=["f"])])
        self.lin = nn.Linear(DIM + 3, 1)

    def forward(self, batch: Batch) -> Tuple[torch.Tensor, torch.Tensor]:
        pred = self.lin(torch.cat([self.ebc(batch.kjt).values(), batch.dense], dim=1)).squeeze(1)
        return nn.functional.mse_loss(pred, batch.target), pred


def _global_batch(k: int, world_size: int) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + k)
    n = world_size * LOCAL
    lengths = torch.randint(0, 4, (n,), generator=g)
    return torch.randn(n, 3, generator=g), torch.randn(n, generator=g), [torch.randint(0, ROWS, (int(m),), generator=g) for m in lengths]


def _local_batch(k: int, rank: int, world_size: int) -> Batch:
    dense, target, bags = _global_batch(k, world_size)
    pick = slice(rank * LOCAL, (rank + 1) * LOCAL)
    mine = bags[pick]
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.cat(mine), lengths=torch.tensor([len(b) for b in mine], dtype=torch.int))
    return Batch(dense[pick], target[pick], kjt)


def _worker(rank: int, world_size: int) -> Dict[str, object]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = Sparse()
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(model.ebc, {"t0": row_wise()}, local_size=world_size,
                                                               world_size=world_size, device_type="cpu")})
    dmp = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    all_reduces: List[int] = []

    def counting_hook(state, bucket):
        all_reduces.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    dmp._dmp_wrapped_module.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(dmp.dense_parameters(), lr=LR)
    pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
    wrapped = GradientAccumulationWrapper(pipeline, opt, dmp, GradientAccumulationConfig(num_steps=N_STEPS))
    it = iter([_local_batch(k, rank, world_size) for k in range(MICRO)])
    with pytest.raises(StopIteration):
        while True:
            wrapped.progress(it)
    return {"t0": dmp.module.ebc.gather_table("t0"), "lin": {k: v.detach().clone() for k, v in dmp.module.lin.state_dict().items()},
            "all_reduces": len(all_reduces)}


def _reference(world_size: int) -> Dict[str, object]:
    """Plain PyTorch on the global batches: the table steps every micro-batch, the linear layer every N_STEPS."""
    torch.manual_seed(0)
    model = Sparse()
    table = model.ebc.embedding_bags["t0"].weight.detach().clone().requires_grad_()
    lin = model.lin
    lin_opt = torch.optim.SGD(lin.parameters(), lr=LR)
    for k in range(MICRO):
        dense, target, bags = _global_batch(k, world_size)
        pooled = torch.stack([table[b].sum(0) for b in bags])
        pred = lin(torch.cat([pooled, dense], dim=1)).squeeze(1)
        nn.functional.mse_loss(pred, target).backward()
        with torch.no_grad():
            table -= LR * table.grad
        table.grad = None
        if (k + 1) % N_STEPS == 0:
            lin_opt.step()
            lin_opt.zero_grad()
    return {"t0": table.detach(), "lin": {k: v.detach() for k, v in lin.state_dict().items()}}


def test_dmp_accumulates_dense_and_steps_fused_tables_every_micro_batch():
    want = _reference(2)
    results = run_ranks(_worker, 2)
    torch.testing.assert_close(results[0]["t0"], want["t0"], atol=1e-6, rtol=0)
    for r, got in enumerate(results):
        for name, value in want["lin"].items():
            torch.testing.assert_close(got["lin"][name], value, atol=1e-6, rtol=0, msg=f"rank {r} lin.{name}")
        # 4 micro-batches, cycles of 2: DDP all-reduces the warmup call (step 0) and each cycle's last (steps 1, 3)
        assert got["all_reduces"] == 3, got["all_reduces"]
