"""FeatureProcessedEmbeddingBagCollection with position weights (TorchRec's feature_processor_ / fp_embedding_modules):
outputs and gradients equal a plain-PyTorch reference (each id's table row times the position weight at its position in
its bag, summed per bag), eager, recship.fx-traced and TorchScripted, with TorchRec's state_dict keys."""

from typing import Dict, List

import pytest
import torch

import recship.fx
from recship.sparse import JaggedTensor, KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.feature_processors import (FeatureProcessedEmbeddingBagCollection, FeatureProcessorDictWrapper,
                                                PositionWeightedModule, PositionWeightedModuleCollection, bag_positions)

MAX = {"f0": 5, "f1": 6, "f2": 5}
ROWS = {"f0": 10, "f1": 10, "f2": 20}
TABLE = {"f0": "t0", "f1": "t0", "f2": "t1"}


def _tables() -> List[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=20, feature_names=["f2"])]


def _model(collection: bool, seed: int = 0) -> FeatureProcessedEmbeddingBagCollection:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(_tables(), is_weighted=True)
    fp = PositionWeightedModuleCollection(MAX) if collection else {f: PositionWeightedModule(n) for f, n in MAX.items()}
    model = FeatureProcessedEmbeddingBagCollection(ebc, fp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "position" in name:
                p.copy_(torch.randn(p.shape))
    return model


def _kjt(batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (3 * batch,), generator=g)
    rows = torch.tensor([ROWS[f] for f in MAX]).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
    return KeyedJaggedTensor(keys=list(MAX), values=values, lengths=lengths)


def reference(kjt: KeyedJaggedTensor, tables: Dict[str, torch.Tensor], position: Dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, 16]: per feature and example, sum over its bag of position[f][j] * tables[t][id_j] (j: the id's place in the bag)."""
    out = []
    for f, jt in kjt.to_dict().items():
        table, rows, start = tables[TABLE[f]], [], 0
        for n in jt.lengths().tolist():
            ids = jt.values()[start:start + n]
            start += n
            pooled = torch.zeros(table.shape[1])
            for j in range(n):
                pooled = pooled + position[f][j] * table[ids[j]]
            rows.append(pooled)
        out.append(torch.stack(rows))
    return torch.cat(out, dim=1)


def _reference_of(model: FeatureProcessedEmbeddingBagCollection, kjt: KeyedJaggedTensor) -> torch.Tensor:
    sd = model.state_dict()
    tables = {t: sd[f"_embedding_bag_collection.embedding_bags.{t}.weight"] for t in ("t0", "t1")}
    position = {f: sd[k] for f in MAX for k in (f"_feature_processors.position_weights.{f}", f"_feature_processors.{f}.position_weight")
                if k in sd}
    return reference(kjt, tables, position)


def test_bag_positions_count_from_each_bags_start():
    offsets = torch.tensor([0, 2, 2, 5, 6, 6])
    assert bag_positions(offsets, 6).tolist() == [0, 1, 0, 1, 2, 0]
    assert bag_positions(torch.tensor([0, 0]), 0).tolist() == []


@pytest.mark.parametrize("collection", [True, False])
def test_outputs_and_gradients_equal_the_reference(collection):
    model, kjt = _model(collection), _kjt(16, 1)
    out = model(kjt)
    assert out.keys() == ["f0", "f1", "f2"]
    torch.testing.assert_close(out.values(), _reference_of(model, kjt), atol=1e-5, rtol=1e-5)
    # gradients of the position weights: d sum(out * g) / d w_f[j] = sum over ids at position j of g . table[id]
    g = torch.randn(out.values().shape, generator=torch.Generator().manual_seed(2))
    (out.values() * g).sum().backward()
    params = dict(model.named_parameters())
    sd = {k: v.clone().requires_grad_("position" in k) for k, v in model.state_dict().items()}
    tables = {t: sd[f"_embedding_bag_collection.embedding_bags.{t}.weight"] for t in ("t0", "t1")}
    position = {f: v for k, v in sd.items() for f in MAX if "position" in k and f in k.split(".")}
    (reference(kjt, tables, position) * g).sum().backward()
    for f in MAX:
        name = next(k for k in params if "position" in k and f in k.split("."))
        torch.testing.assert_close(params[name].grad, position[f].grad, atol=1e-5, rtol=1e-5)
        assert params[name].grad.abs().sum() > 0


def test_state_dict_keys_are_torchrecs():
    keys = sorted(_model(True).state_dict())
    assert keys == ["_embedding_bag_collection.embedding_bags.t0.weight", "_embedding_bag_collection.embedding_bags.t1.weight",
                    "_feature_processors.position_weights.f0", "_feature_processors.position_weights.f1",
                    "_feature_processors.position_weights.f2"]
    assert sorted(_model(False).state_dict())[2:] == ["_feature_processors.f0.position_weight", "_feature_processors.f1.position_weight",
                                                      "_feature_processors.f2.position_weight"]
    other = _model(True, seed=3)
    other.load_state_dict(_model(True).state_dict())  # the plain dict follows the ParameterDict after a load
    kjt = _kjt(4, 5)
    assert torch.equal(other(kjt).values(), _model(True)(kjt).values())


@pytest.mark.parametrize("collection", [True, False])
def test_fx_trace_and_torchscript_give_the_eager_numbers(collection):
    model, kjt = _model(collection), _kjt(9, 4)
    eager = model(kjt).values()
    traced = recship.fx.symbolic_trace(model)
    assert torch.equal(traced(kjt).values(), eager)
    scripted = torch.jit.script(traced)
    assert torch.equal(scripted(kjt).values(), eager)
    other = _kjt(3, 6)
    assert torch.equal(scripted(other).values(), model(other).values())


def test_position_weighted_module_on_one_feature_and_its_pre_processed_input():
    pw = PositionWeightedModule(4)
    with torch.no_grad():
        pw.position_weight.copy_(torch.tensor([0.5, 2.0, 3.0, 4.0]))
    jt = JaggedTensor(values=torch.tensor([7, 8, 9, 1]), lengths=torch.tensor([2, 0, 2]))
    assert pw(jt).weights().tolist() == [0.5, 2.0, 0.5, 2.0]
    pre = JaggedTensor(values=jt.values(), lengths=jt.lengths(), weights=torch.zeros(4))
    pw.pre_process_input(pre)
    assert pre.weights().tolist() == [0.0, 1.0, 0.0, 1.0] and pw(pre).weights().tolist() == [0.5, 2.0, 0.5, 2.0]


def test_split_and_the_dict_wrapper_weight_as_the_module_does():
    model, kjt = _model(False), _kjt(5, 7)
    processors, ebc = model.split()
    assert isinstance(processors, FeatureProcessorDictWrapper) and ebc is model._embedding_bag_collection
    assert torch.equal(ebc(processors(kjt)).values(), model(kjt).values())


def test_a_collection_keys_without_position_weights_get_weight_one():
    pw = PositionWeightedModuleCollection({"f1": 3})
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 1, 1]))
    with torch.no_grad():
        pw.position_weights["f1"].copy_(torch.tensor([5.0, 6.0, 7.0]))
    assert pw(kjt).weights().tolist() == [1.0, 1.0, 5.0, 5.0]


def test_mistakes_are_value_errors():
    with pytest.raises(ValueError, match="is_weighted=True"):
        FeatureProcessedEmbeddingBagCollection(EmbeddingBagCollection(_tables()), PositionWeightedModuleCollection(MAX))
    with pytest.raises(ValueError, match="not the collection's features"):
        FeatureProcessedEmbeddingBagCollection(EmbeddingBagCollection(_tables(), is_weighted=True), {"f0": PositionWeightedModule(2)})
    with pytest.raises(ValueError, match="positive"):
        PositionWeightedModuleCollection({"f0": 0})


def test_a_variable_batch_keeps_its_inverse_indices_through_the_position_weights():
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"])], is_weighted=True)
    model = FeatureProcessedEmbeddingBagCollection(ebc, _randomised_collection({"a": 4, "b": 4}))
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 1, 2]),
                            stride_per_key_per_rank=[[2], [1]], inverse_indices=(["a", "b"], torch.tensor([[0, 1], [0, 0]])))
    out = model(kjt).values()
    table, pw = ebc.embedding_bags["t"].weight.detach(), model._feature_processors.position_weights
    a = torch.stack([pw["a"][0] * table[1] + pw["a"][1] * table[2], pw["a"][0] * table[3]])
    b = pw["b"][0] * table[4] + pw["b"][1] * table[5]
    torch.testing.assert_close(out, torch.cat([a, torch.stack([b, b])], dim=1).detach(), rtol=1e-6, atol=1e-6)


def _randomised_collection(lengths: Dict[str, int]) -> PositionWeightedModuleCollection:
    pw = PositionWeightedModuleCollection(lengths)
    with torch.no_grad():
        for p in pw.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(8)))
    return pw
