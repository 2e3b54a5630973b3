"""Behaviours of TorchRec's optimizer wrappers and DistributedModelParallel that TorchRec user code relies on
(found by running TorchRec 1.8.0's own unit tests through the import map), checked against plain torch: keyed
state_dicts of stateful state, the params-only state keys, pickling, torch's in-backward optimizers, the warmup
counter in ``state``, DMP on one local rank without a process group, ``init_parameters``, the fused_params keys."""

import io
import math

import pytest
import torch
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward

from recship import EmbeddingBagCollection, EmbeddingBagConfig
from recship.distributed import (CombinedOptimizer, DistributedModelParallel, EmbeddingBagCollectionSharder, KeyedOptimizer,
                                 KeyedOptimizerWrapper, SemisyncOptimizer, ShardingEnv, WarmupOptimizer, WarmupPolicy,
                                 WarmupStage, in_backward_optimizer_filter, init_parameters)
from recship.sparse import JaggedTensor


class _Counter:
    """An object kept in an optimizer's state that saves itself (as an optimizer module does)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self):
        return {"tensor": self.tensor}

    def load_state_dict(self, state_dict) -> None:
        self.tensor.copy_(state_dict["tensor"])


class _NoStep(KeyedOptimizer):
    def step(self, closure=None) -> None:
        pass


def test_state_dict_saves_stateful_state_and_loads_it_in_place():
    torch.manual_seed(0)
    p1, p2 = torch.randn(3), torch.randn(2)
    counter = _Counter(torch.randn(4))
    moment = torch.randn(3)
    opt = _NoStep({"a": p1, "b": p2}, {p1: {"moment": moment, "nested": {"counter": counter}, "step": 1.0}, p2: {"x": 2.0}},
                  [{"params": [p1, p2], "lr": 0.1}])
    saved = opt.state_dict()
    assert saved["state"]["a"]["nested"]["counter"] == {"tensor": counter.tensor}  # the object's state_dict, not itself
    assert saved["state"]["a"]["moment"] is moment and saved["state"]["b"] == {"x": 2.0}

    new_counter, new_moment = torch.randn(4), torch.randn(3)
    held = counter.tensor
    opt.load_state_dict({"state": {"a": {"moment": new_moment, "nested": {"counter": {"tensor": new_counter}}, "step": 7.0},
                                   "b": {"x": 3.0}}})
    assert opt.state[p1]["nested"]["counter"] is counter and counter.tensor is held  # loaded in place
    assert torch.equal(held, new_counter) and torch.equal(moment, new_moment)
    assert opt.state[p1]["step"] == 7.0 and opt.state[p2]["x"] == 3.0


def test_state_keys_must_be_params():
    p = torch.randn(2)
    with pytest.raises(ValueError, match="All state keys must be params"):
        KeyedOptimizer({"p": p}, {p: {}, "not_a_param": 1.0}, [{"params": [p]}])
    with pytest.raises(ValueError, match="All state keys must be params"):
        KeyedOptimizer({"p": p}, {torch.randn(2): {}}, [{"params": [p]}])


def _step_all(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_keyed_optimizers_pickle_whole_and_go_on_stepping_alike():
    torch.manual_seed(1)
    model = nn.Linear(4, 3)
    opt = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    _step_all(model.parameters(), 2)
    opt.step()
    reloaded = []
    for original in (opt, CombinedOptimizer([("dense", opt)])):
        buf = io.BytesIO()
        torch.save(original, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert sorted(loaded.params) == sorted(original.params)
        for key, state in original.state_dict()["state"].items():
            assert torch.equal(loaded.state_dict()["state"][key]["momentum_buffer"], state["momentum_buffer"])
        reloaded.append(loaded)
    # the reloaded optimizers step their own (reloaded) parameters exactly as the original steps the originals
    for o in (opt, *reloaded):
        _step_all(o.params.values(), 3)
        o.step()
    for loaded in reloaded:
        for key, p in loaded.params.items():
            assert torch.equal(p, opt.params[key.removeprefix("dense.")])


def test_in_backward_filter_honours_torchs_apply_optimizer_in_backward():
    torch.manual_seed(3)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=5, feature_names=[f])
                                         for t, f in (("t1", "f1"), ("t2", "f2"))])
    _apply_optimizer_in_backward(torch.optim.SGD, ebc.embedding_bags["t1"].parameters(), optimizer_kwargs={"lr": 1.0})
    assert set(dict(in_backward_optimizer_filter(ebc.named_parameters(), include=True))) == {"embedding_bags.t1.weight"}
    assert set(dict(in_backward_optimizer_filter(ebc.named_parameters()))) == {"embedding_bags.t2.weight"}


def _linear_lr(lr: float, value: float, max_iters: int, i: int) -> float:
    return lr * (value + (1 - value) * i / max_iters if i <= max_iters else 1.0)


def test_warmup_counter_is_state_and_a_resumed_warmup_goes_on_from_it():
    def make(model):
        inner = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=1.0))
        return WarmupOptimizer(inner, [WarmupStage(WarmupPolicy.LINEAR, max_iters=8, value=0.1)], lr=0.5)

    torch.manual_seed(4)
    model = nn.Linear(3, 2)
    opt = make(model)
    for _ in range(5):
        _step_all(model.parameters(), 5)
        opt.step()
    assert torch.equal(opt.state[opt.params["__warmup"]]["warmup"], torch.tensor([5, 0]))
    assert opt.state_dict()["state"]["__warmup"]["warmup"].tolist() == [5, 0]
    assert opt._optimizer._optimizer.state_dict()["state"] == {}  # the torch optimizer's own state is untouched (SGD keeps none)

    resumed_model = nn.Linear(3, 2)
    resumed = make(resumed_model)
    resumed.load_state_dict(opt.state_dict())
    for i in range(5, 12):  # both go on at the same rates, those of the schedule from iteration 5
        expected = _linear_lr(0.5, 0.1, 8, i)
        for o in (opt, resumed):
            assert math.isclose(o.param_groups[0]["lr"], expected, rel_tol=1e-12), (i, o.param_groups[0]["lr"])
            o.step()
    assert resumed.state_dict()["state"]["__warmup"]["warmup"].tolist() == [12, 1]


def test_semisync_refuses_empty_global_params():
    model = nn.Linear(2, 1)
    local = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ValueError, match="at least one global parameter"):
        SemisyncOptimizer([], local, local)
    with pytest.raises(IndexError, match="at least one global parameter"):  # what TorchRec raises there
        SemisyncOptimizer(iter([]), local, local)


def test_dmp_on_one_local_rank_without_a_process_group():
    torch.manual_seed(5)
    dense = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    x = torch.randn(6, 4)
    expected = dense(x)
    dmp = DistributedModelParallel(dense, env=ShardingEnv.from_local(1, 0), sharders=[], init_data_parallel=False)
    assert dmp.module is dense and torch.equal(dmp(x), expected)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"])])
    with pytest.raises(ValueError, match="init_process_group"):
        DistributedModelParallel(nn.Sequential(ebc), env=ShardingEnv.from_local(1, 0))
    with pytest.raises(ValueError, match="needs a process group"):
        DistributedModelParallel(dense, env=ShardingEnv.from_local(2, 0))


def test_dmp_takes_a_quantized_model_on_one_local_rank():
    from recship.quantize.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    torch.manual_seed(6)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=5, feature_names=["f"])])
    ebc.qconfig = torch.quantization.QConfig(activation=torch.quantization.PlaceholderObserver.with_args(dtype=torch.float),
                                             weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8))
    qebc = QuantEmbeddingBagCollection.from_float(ebc)
    from recship.sparse import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([0, 3, 4]), lengths=torch.tensor([2, 1]))
    expected = qebc(kjt).values()
    dmp = DistributedModelParallel(nn.Sequential(qebc), env=ShardingEnv.from_local(1, 0), sharders=[], init_data_parallel=False)
    assert dmp.module[0].device == torch.device("cpu")
    assert torch.equal(dmp(kjt).values(), expected)


def test_init_parameters_moves_and_reinitialises_as_a_fresh_module():
    torch.manual_seed(7)
    reference = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    torch.manual_seed(7)
    on_meta = nn.Sequential(nn.Linear(4, 3, device="meta"), nn.LayerNorm(3, device="meta"))
    init_parameters(on_meta, torch.device("cpu"))
    for a, b in zip(on_meta.parameters(), reference.parameters()):
        assert a.device.type == "cpu" and torch.equal(a, b)
    before = [p.detach().clone() for p in reference.parameters()]
    init_parameters(reference, torch.device("cpu"))  # already there: left as it is
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), before))


def test_to_padded_dense_weights_pads_and_truncates_as_the_values():
    g = torch.Generator().manual_seed(8)
    lengths = torch.randint(0, 5, (7,), generator=g)
    weights = torch.rand(int(lengths.sum()), generator=g)
    jt = JaggedTensor(values=torch.arange(int(lengths.sum())), weights=weights, lengths=lengths)
    for desired in (None, 2, 6):
        width = int(lengths.max()) if desired is None else desired
        expected = torch.full((7, width), -1.0)
        rows = torch.split(weights, lengths.tolist())
        for i, row in enumerate(rows):
            expected[i, :min(width, len(row))] = row[:width]
        assert torch.equal(jt.to_padded_dense_weights(desired, -1.0), expected)
    assert JaggedTensor(values=torch.ones(2), lengths=torch.tensor([2])).to_padded_dense_weights() is None


def test_fused_params_keys_and_bounds_check_mode():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode as Fbgemm

    import recship.distributed as rd

    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

    import recship

    assert rd.BoundsCheckMode is Fbgemm and rd.CacheAlgorithm is CacheAlgorithm and rd.DataType is recship.DataType
    assert rd.get_propogate_device() is True
    rd.set_propogate_device(True)
    with pytest.raises(ValueError, match="always uses the device"):
        rd.set_propogate_device(False)
    assert rd.FUSED_PARAM_LENGTHS_TO_OFFSETS_LOOKUP == "__register_lengths_to_offsets_lookup"
    assert rd.FUSED_PARAM_BOUNDS_CHECK_MODE == "__register_tbe_bounds_check_mode"
    with pytest.raises(ValueError, match="__register_tbe_bounds_check_mode"):  # training sharders refuse them by name
        EmbeddingBagCollectionSharder(fused_params={rd.FUSED_PARAM_BOUNDS_CHECK_MODE: Fbgemm.NONE}).shard(
            EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5, feature_names=["f"])]),
            {}, ShardingEnv.from_local(1, 0), torch.device("cpu"))
