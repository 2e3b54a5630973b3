"""TorchRec's distributed API on recship: sharders, fused_params, apply_optimizer_in_backward, awaitables.

One gloo rank in this process (the update rules are per rank; multi-rank equality is
covered by test_sharded_ebc.py). References are plain torch modules and optimizers.
"""

import copy

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmEmbOptimType
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

from recship.distributed import (
    CombinedOptimizer,
    DistributedModelParallel,
    EmbeddingBagCollectionAwaitable,
    EmbeddingBagCollectionSharder,
    EmbeddingShardingPlanner,
    EmbOptimType,
    FusedOptimizerConfig,
    RowWiseAdagrad,
    ShardingEnv,
    Topology,
    get_default_sharders,
    in_backward_optimizer_filter,
)
from recship.sparse import KeyedJaggedTensor, KeyedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.fused_optim import fused_config, fused_config_from_torch

TABLES = [
    EmbeddingBagConfig(name="product_table", embedding_dim=8, num_embeddings=30, feature_names=["product"]),
    EmbeddingBagConfig(name="user_table", embedding_dim=12, num_embeddings=20, feature_names=["user"]),
]


def ebc(seed=0):
    torch.manual_seed(seed)
    return EmbeddingBagCollection(tables=TABLES, device="cpu")


def batch(seed=1, examples=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (2 * examples,), generator=g)
    rows = torch.tensor([30] * examples + [20] * examples).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
    return KeyedJaggedTensor(keys=["product", "user"], values=values, lengths=lengths)


def shard(module, pg, sharder=None):
    sharder = sharder or EmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(Topology(world_size=1, compute_device="cpu")).collective_plan(module, [sharder], pg)
    return sharder.shard(module, plan.plan[""], ShardingEnv.from_process_group(pg), torch.device("cpu"))


def train_step(module, kjt, loss_weights):
    out = module(kjt)
    values = out.wait().values() if hasattr(out, "wait") else out.values()
    (values * loss_weights).sum().backward()


def tables_of(sharded):
    return {t: sharded.gather_table(t) for t in ("product_table", "user_table")}


def reference_step(optimizer_class, kwargs, kjt, loss_weights, seed=0):
    """The unsharded EBC updated by the torch optimizer itself."""
    ref = ebc(seed)
    opt = optimizer_class(ref.parameters(), **kwargs)
    train_step(ref, kjt, loss_weights)
    opt.step()
    return {t: ref.embedding_bags[t].weight.detach() for t in ("product_table", "user_table")}


@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [
        (torch.optim.SGD, {"lr": 0.5}),
        (torch.optim.Adagrad, {"lr": 0.3}),
        (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-3}),
        (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-4}),
    ],
)
def test_apply_optimizer_in_backward_is_honoured(pg, optimizer_class, kwargs):
    kjt, loss_weights = batch(), torch.randn(5, 20, generator=torch.Generator().manual_seed(3))
    module = ebc()
    for p in module.parameters():
        apply_optimizer_in_backward(optimizer_class, [p], kwargs)
    sharded = shard(module, pg)
    assert sharded.fused_optimizer.param_groups[0]["lr"] == kwargs["lr"]
    train_step(sharded, kjt, loss_weights)
    want = reference_step(optimizer_class, kwargs, kjt, loss_weights)
    got = tables_of(sharded)
    for t in want:
        torch.testing.assert_close(got[t], want[t], atol=1e-6, rtol=1e-5)
        assert not torch.equal(got[t], ebc().embedding_bags[t].weight.detach())  # it did move


def test_fused_params_set_the_optimizer_and_print_like_torchrec(pg):
    fused_params = {"optimizer": FbgemmEmbOptimType.EXACT_SGD, "learning_rate": 0.02}
    sharded = shard(ebc(), pg, EmbeddingBagCollectionSharder(fused_params=fused_params))
    assert isinstance(sharded.fused_optimizer, CombinedOptimizer)
    assert repr(sharded.fused_optimizer) == ": EmbeddingFusedOptimizer (\nParameter Group 0\n    lr: 0.02\n)"
    assert sorted(sharded.fused_optimizer.params) == ["embedding_bags.product_table.weight", "embedding_bags.user_table.weight"]
    default = shard(ebc(), pg)
    assert "lr: 0.01" in repr(default.fused_optimizer) and default._optimizer_config.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD

    kjt, loss_weights = batch(), torch.randn(5, 20, generator=torch.Generator().manual_seed(3))
    train_step(sharded, kjt, loss_weights)
    torch.testing.assert_close(tables_of(sharded), reference_step(torch.optim.SGD, {"lr": 0.02}, kjt, loss_weights))
    # an LR scheduler's way: change the group's lr, then step() applies it from the next backward
    before = tables_of(sharded)
    sharded.fused_optimizer.param_groups[0]["lr"] = 0.5
    sharded.fused_optimizer.step()
    assert "lr: 0.5" in repr(sharded.fused_optimizer)
    ref = ebc()
    with torch.no_grad():
        for t, w in before.items():
            ref.embedding_bags[t].weight.copy_(w)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    train_step(ref, kjt, loss_weights)
    opt.step()
    train_step(sharded, kjt, loss_weights)
    for t, w in tables_of(sharded).items():
        torch.testing.assert_close(w, ref.embedding_bags[t].weight.detach())


def test_settings_fbgemm_cannot_honour_are_refused_not_ignored(pg):
    with pytest.raises(ValueError, match=r"SGD\(momentum=0.9\) cannot be fused.*EXACT_SGD"):
        fused_config_from_torch(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="no fused embedding optimizer for RMSprop"):
        fused_config_from_torch(torch.optim.RMSprop, {"lr": 0.1})
    with pytest.raises(ValueError, match=r"fused_params \['cache_load_factor'\] are not supported"):
        EmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 0.2})
    with pytest.raises(ValueError, match="fused optimizer 'nadam' is not supported"):
        fused_config({"optimizer": "nadam"})
    module = ebc()
    apply_optimizer_in_backward(torch.optim.SGD, [module.embedding_bags["product_table"].weight], {"lr": 0.5})
    with pytest.raises(ValueError, match="one optimizer per EmbeddingBagCollection"):
        shard(module, pg)
    apply_optimizer_in_backward(torch.optim.SGD, [module.embedding_bags["user_table"].weight], {"lr": 0.4})
    with pytest.raises(ValueError, match="one optimizer per EmbeddingBagCollection"):
        shard(module, pg)


def test_unset_arguments_take_fbgemms_defaults_as_in_torchrec():
    """TorchRec passes on only the arguments given: fbgemm's eps (1e-8) where torch.optim.Adagrad's is 1e-10."""
    assert fused_config_from_torch(torch.optim.Adagrad, {}) == FusedOptimizerConfig(EmbOptimType.EXACT_ADAGRAD, 0.01, eps=1e-8)
    assert fused_config_from_torch(torch.optim.Adagrad, {"eps": 1e-10}).eps == 1e-10
    adam = fused_config_from_torch(torch.optim.Adam, {"lr": 0.1, "betas": (0.8, 0.9)})
    assert (adam.optimizer, adam.learning_rate, adam.beta1, adam.beta2, adam.eps) == (EmbOptimType.ADAM, 0.1, 0.8, 0.9, 1e-8)
    assert fused_config({"optimizer": "exact_sgd", "learning_rate": 0.3}).optimizer == EmbOptimType.EXACT_SGD


def test_sharded_output_is_an_awaitable_usable_directly_or_waited(pg):
    module = ebc()
    sharded = shard(module, pg)
    kjt = batch()
    out = sharded(kjt)
    assert isinstance(out, EmbeddingBagCollectionAwaitable)
    kt = out.wait()
    assert isinstance(kt, KeyedTensor) and kt.keys() == ["product", "user"]
    want = module(kjt).values()
    torch.testing.assert_close(kt.values(), want)
    torch.testing.assert_close(out.values(), want)  # used as its result
    assert torch.equal(torch.cat([out.values()]), kt.values())


def test_the_three_stages_are_real_modules_and_the_tbe_sits_in_lookups(pg):
    module = ebc()
    sharded = shard(module, pg)
    for stages in (sharded._input_dists, sharded._lookups, sharded._output_dists):
        assert isinstance(stages, nn.ModuleList) and len(stages) == 1
    assert sharded._lookups[0].tbe is sharded.tbe is not None
    # the state_dict is the unsharded collection's (TorchRec's), never the TBE's buffers
    state = sharded.state_dict()
    assert list(state) == list(module.state_dict()) and all(type(v).__name__ == "ShardedTensor" for v in state.values())
    # every parameter's optimizer is fused: nothing left for a dense optimizer
    assert dict(in_backward_optimizer_filter(sharded.named_parameters())) == {}


def test_dmp_takes_torchrec_arguments(pg):
    module = ebc()
    kjt = batch()
    want = module(kjt).values()
    sharders = get_default_sharders()
    plan = EmbeddingShardingPlanner(Topology(world_size=1, compute_device="cpu")).collective_plan(module, sharders, pg)
    model = DistributedModelParallel(module, env=ShardingEnv.from_process_group(pg), plan=plan, sharders=sharders, device=torch.device("cpu"))
    torch.testing.assert_close(model(kjt).wait().values(), want)
    assert repr(model.fused_optimizer).count("EmbeddingFusedOptimizer") == 1
    with pytest.raises(ValueError, match="either as optimizer= or in the sharders"):
        DistributedModelParallel(copy.deepcopy(module), optimizer=FusedOptimizerConfig(), sharders=sharders)
    # the shorthand: optimizer= is a sharder's fused_params
    model = DistributedModelParallel(ebc(), optimizer=FusedOptimizerConfig(EmbOptimType.EXACT_SGD, 0.25))
    assert "lr: 0.25" in repr(model.fused_optimizer)


def test_row_wise_adagrad_dense_matches_its_formula():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6, 4))
    opt = RowWiseAdagrad([w], lr=0.1, eps=1e-6)
    start = w.detach().clone()
    acc = torch.zeros(6)
    for step in range(3):
        g = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        w.grad = g.clone()
        opt.step()
        acc += (g**2).mean(dim=1)
        start -= 0.1 * g / (acc.sqrt() + 1e-6).unsqueeze(1)
        torch.testing.assert_close(w.detach(), start)
