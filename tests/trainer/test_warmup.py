"""``torchrec.optim.warmup`` as TorchRec users write it (tests/snippets/torchrec_warmup.txt, through docs/torchrec.md's import
map): the learning rate of every step follows the stages (a reference schedule written here from TorchRec's
definitions), torch optimizers step bitwise as with that rate set by hand, the fused embedding kernels of a sharded
model (2 gloo ranks) update by that rate too (against plain PyTorch SGD in one process), and the schedule survives a
state_dict round trip."""

import copy
import math

import pytest
import torch
from torch import nn

from gloo_ranks import run_ranks
from recship.distributed import DistributedModelParallel, ParameterConstraints, ShardingType, in_backward_optimizer_filter
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingShardingPlanner, Topology
from recship.trainer.fused_optim import EmbOptimType, FusedOptimizerConfig
from tutorials.notebook import run_snippet

# TorchRec user code, kept out of .py files (torchrec is not a dependency: no .py file imports it)
LR = 0.1


def _user_code() -> dict:
    scope = run_snippet("torchrec_warmup")
    return scope


def _reference_multiplier(stages, i):
    """TorchRec's schedule, restated: the first stage whose max_iters i has not passed, else 1."""
    for s in stages:
        if i <= s.max_iters:
            break
    else:
        return 1.0
    name = s.policy.name
    decay = s.decay_iters if s.decay_iters > 0 else (1 if name == "STEP" else s.max_iters)
    value = {
        "LINEAR": lambda: s.value + (1 - s.value) * (i / s.max_iters),
        "CONSTANT": lambda: s.value,
        "POLY": lambda: (1 - i / decay) ** s.value,
        "STEP": lambda: s.value ** (i // decay),
        "INVSQRT": lambda: i ** -0.5,
        "COSINE_ANNEALING_WARM_RESTARTS": lambda: s.value + (1 - s.value) * (1 + math.cos(math.pi * (i % s.sgdr_period) / s.sgdr_period)) / 2,
        "INTERPOLATE": lambda: s.value + (s.end_value - s.value) * (i - s.start_interpolating_iters) / (s.max_iters - s.start_interpolating_iters),
    }[name]()
    return value * s.lr_scale


def _all_policies(code):
    W, P = code["WarmupStage"], code["WarmupPolicy"]
    return [W(P.LINEAR, max_iters=2, value=0.1), W(P.POLY, max_iters=5, value=2.0, decay_iters=8),
            W(P.INVSQRT, max_iters=7, lr_scale=2.0), W(P.COSINE_ANNEALING_WARM_RESTARTS, max_iters=12, value=0.3, sgdr_period=4),
            W(P.STEP, max_iters=15, value=0.7), W(P.CONSTANT, max_iters=16, value=3.0)]


def test_the_schedule_is_torchrecs():
    code = _user_code()
    model = nn.Linear(3, 2)
    opt = code["warmup_sgd"](model.named_parameters(), copy.deepcopy(code["STAGES"]), LR)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
    # LINEAR 0.2 -> 1 up to iteration 4 (inclusive), CONSTANT 0.5 to 6, STEP 0.5 every 3 iterations to 10, then 1
    assert lrs == pytest.approx([LR * m for m in [0.2, 0.4, 0.6, 0.8, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 1.0]], rel=1e-12)
    stages = _all_policies(code)
    opt = code["warmup_sgd"](model.named_parameters(), copy.deepcopy(stages), LR)
    for i in range(20):
        assert opt.param_groups[0]["lr"] == pytest.approx(LR * _reference_multiplier(stages, i), rel=1e-12), i
        opt.step()
    assert opt.warmup_state == (20, len(stages))


def test_torch_optimizers_step_as_with_the_rate_set_by_hand():
    code = _user_code()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    reference = copy.deepcopy(model)
    stages = _all_policies(code)
    opt = code["warmup_sgd"](model.named_parameters(), copy.deepcopy(stages), LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    for i in range(18):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g)
        for group in ref_opt.param_groups:
            group["lr"] = LR * _reference_multiplier(stages, i)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())), i


def test_state_dict_carries_the_schedule():
    code = _user_code()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = code["warmup_sgd"](model.named_parameters(), copy.deepcopy(code["STAGES"]), LR)
    for _ in range(6):
        opt.step()
    saved = opt.state_dict()
    assert torch.equal(saved["state"]["__warmup"]["warmup"], torch.tensor([6, 1]))
    fresh = code["warmup_sgd"](model.named_parameters(), copy.deepcopy(code["STAGES"]), LR)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.2 * LR)
    fresh.load_state_dict(saved)
    assert fresh.warmup_state == (6, 1) and fresh.param_groups[0]["lr"] == pytest.approx(0.5 * LR)
    fresh.step()
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.25 * LR)  # iteration 7: the STEP stage
    W, P = code["WarmupStage"], code["WarmupPolicy"]
    with pytest.raises(ValueError, match="max_iters must grow"):
        code["warmup_sgd"](model.named_parameters(), [W(P.LINEAR, max_iters=5), W(P.CONSTANT, max_iters=5)], LR)
    with pytest.raises(ValueError, match="INVSQRT"):
        code["warmup_sgd"](model.named_parameters(), [W(P.INVSQRT, max_iters=5)], LR)


def test_interpolate_stage_draws_a_line_on_the_global_iteration():
    code = _user_code()
    W, P = code["WarmupStage"], code["WarmupPolicy"]
    stages = [W(P.LINEAR, max_iters=3, value=0.2),
              W(P.INTERPOLATE, max_iters=10, value=1.0, end_value=0.25, start_interpolating_iters=4, lr_scale=2.0),
              W(P.INTERPOLATE, max_iters=14, value=0.5, end_value=0.1, start_interpolating_iters=11)]
    opt = code["warmup_sgd"](nn.Linear(3, 2).named_parameters(), copy.deepcopy(stages), LR)
    lrs = []
    for i in range(18):
        lrs.append(opt.param_groups[0]["lr"])
        assert lrs[-1] == pytest.approx(LR * _reference_multiplier(stages, i), rel=1e-12), i
        opt.step()
    # iteration 4 starts the line at value (times lr_scale 2), iteration 10 ends it at end_value; after the last stage, 1
    assert lrs[4] == pytest.approx(2 * LR) and lrs[10] == pytest.approx(0.5 * LR) and lrs[14] == pytest.approx(0.1 * LR)
    assert lrs[15:] == [LR] * 3
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="INTERPOLATE needs start_interpolating_iters and end_value"):
        code["warmup_sgd"](model.named_parameters(), [W(P.INTERPOLATE, max_iters=5, end_value=0.1)], LR)
    with pytest.raises(ValueError, match="must be greater than its start_interpolating_iters"):
        code["warmup_sgd"](model.named_parameters(), [W(P.INTERPOLATE, max_iters=5, end_value=0.1, start_interpolating_iters=5)], LR)


# -- the fused embedding optimizer of a sharded model -----------------------------------------------------------

LOCAL_BATCH, STEPS = 4, 9


def _tables():
    return [EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=4, feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", num_embeddings=7, embedding_dim=4, feature_names=["f1"])]


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = EmbeddingBagCollection(_tables())
        self.over = nn.Linear(8, 1)

    def forward(self, kjt):
        return self.over(self.sparse(kjt).values())


def _batch(step, world_size, lo, hi):
    """Examples lo..hi of step's global batch (world_size * LOCAL_BATCH examples), and their targets."""
    g = torch.Generator().manual_seed(step)
    n = world_size * LOCAL_BATCH
    lengths = {t.feature_names[0]: torch.randint(1, 4, (n,), generator=g) for t in _tables()}
    ids = {t.feature_names[0]: [torch.randint(0, t.num_embeddings, (int(l),), generator=g) for l in lengths[t.feature_names[0]]]
           for t in _tables()}
    targets = torch.randn(n, 1, generator=g)
    keys = list(lengths)
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat([i for k in keys for i in ids[k][lo:hi]]),
                            lengths=torch.cat([lengths[k][lo:hi] for k in keys]))
    return kjt, targets[lo:hi]


def _stages(code):
    W, P = code["WarmupStage"], code["WarmupPolicy"]
    return [W(P.LINEAR, max_iters=3, value=0.1), W(P.STEP, max_iters=6, value=3.0, decay_iters=2)]


def _fused_worker(rank, world_size, how):
    code = _user_code()
    torch.manual_seed(0)
    model = _Toy()
    constraints = {"t0": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE]),
                   "t1": ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE])}
    plan = EmbeddingShardingPlanner(Topology(world_size, "cpu"), constraints=constraints).collective_plan(model)
    dmp = DistributedModelParallel(model, plan=plan, optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_SGD, learning_rate=LR))
    dense = in_backward_optimizer_filter(dmp.named_parameters())
    if how == "warmup":
        opt, scheduler = code["warmup_combined"](dmp.fused_optimizer, dense, _stages(code), LR), None
    else:  # torch's scheduler on the combined optimizer: the fused kernels take its rate at zero_grad, as TorchRec's
        opt = code["CombinedOptimizer"]([dmp.fused_optimizer, code["KeyedOptimizerWrapper"](dict(dense), lambda ps: torch.optim.SGD(ps, lr=LR))])
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: _reference_multiplier(_stages(code), i))
    for step in range(STEPS):
        kjt, target = _batch(step, world_size, rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        nn.functional.mse_loss(dmp(kjt), target).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    sharded = dmp.sharded_modules()[0]
    return {t.name: sharded.gather_table(t.name) for t in _tables()}, {k: v.detach().clone() for k, v in dmp.unwrapped.over.state_dict().items()}


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("how", ["warmup", "lambda_lr"])
def test_the_fused_kernels_update_at_the_scheduled_rate(world_size, how):
    code = _user_code()
    torch.manual_seed(0)
    model = _Toy()
    initial = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    stages = _stages(code)
    for step in range(STEPS):
        kjt, target = _batch(step, world_size, 0, world_size * LOCAL_BATCH)
        for group in opt.param_groups:
            group["lr"] = LR * _reference_multiplier(stages, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(kjt), target).backward()
        opt.step()
    results = run_ranks(_fused_worker, world_size, how)
    for rank, (tables, dense) in enumerate(results):
        for name, table in tables.items():
            if rank > 0:  # gather_table assembles on rank 0
                assert table is None
                continue
            want = model.sparse.embedding_bags[name].weight.detach()
            torch.testing.assert_close(table, want, atol=1e-5, rtol=0)
            # the rate mattered: the tables moved by more than the tolerance
            assert (want - initial.sparse.embedding_bags[name].weight).abs().max() > 1e-2
        for k, v in dense.items():
            torch.testing.assert_close(v, model.over.state_dict()[k], atol=1e-5, rtol=0)
