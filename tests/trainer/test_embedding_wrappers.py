"""DebugEmbedding(Bag)Collection, PECEmbeddingCollection and ITEPEmbedding(Bag)Collection (TorchRec's
debug_embedding_modules, pec_embedding_modules, itep_embedding_modules): the wrapped collection's outputs and
state_dict under TorchRec's keys, the gradient check, the pruning step and its iteration count.

Checked against TorchRec 1.8.0 besides (not here): with the same seed the state_dicts, debug-mode and ITEP outputs
were bit-equal, and an Inf gradient raised the same message.
"""

import pytest
import torch

from recship import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from recship.trainer.embedding_wrappers import (
    DebugEmbeddingBagCollection,
    DebugEmbeddingCollection,
    ITEPEmbeddingBagCollection,
    ITEPEmbeddingCollection,
    OverlappingCheckerType,
    PECEmbeddingCollection,
)

CPU = torch.device("cpu")
BAGS = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=10, feature_names=["f2"])]
TABLES = [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"])]


def kjt(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (8,), generator=g)
    return KeyedJaggedTensor(["f1", "f2"], torch.randint(0, 10, (int(lengths.sum()),), generator=g), lengths=lengths)


@pytest.mark.parametrize("debug_mode", [False, True])
def test_debug_bags_output_and_gradient_are_the_collections(debug_mode):
    debug = DebugEmbeddingBagCollection(BAGS, CPU, debug_mode=debug_mode)
    assert list(debug.state_dict()) == ["ebc.embedding_bags.t1.weight", "ebc.embedding_bags.t2.weight"]
    assert debug.embedding_bag_configs() == BAGS
    plain = EmbeddingBagCollection(BAGS)
    plain.load_state_dict({k[len("ebc."):]: v for k, v in debug.state_dict().items()})
    features = kjt(0)
    got, want = debug(features), plain(features)
    assert got.keys() == want.keys() and got.length_per_key() == [4, 8]
    assert torch.equal(got.values(), want.values())
    target = torch.randn(want.values().shape, generator=torch.Generator().manual_seed(1))
    (got.values() * target).sum().backward()
    (want.values() * target).sum().backward()
    for name in ("t1", "t2"):
        assert torch.equal(debug.ebc.embedding_bags[name].weight.grad, plain.embedding_bags[name].weight.grad)


def test_debug_mode_names_the_feature_whose_gradient_is_not_finite():
    debug = DebugEmbeddingBagCollection(BAGS, CPU, debug_mode=True)
    out = debug(kjt(2))
    scale = torch.ones(12)
    scale[5] = float("nan")  # a column of f2
    with pytest.raises(RuntimeError, match=r"NaN/Inf detected in gradient entering ebc\[f2\]\.values"):
        (out.values() * scale).sum().backward()
    quiet = DebugEmbeddingBagCollection(BAGS, CPU, debug_mode=False)
    (quiet(kjt(2)).values() * scale).sum().backward()  # no check: the NaN reaches the table
    assert torch.isnan(quiet.ebc.embedding_bags["t2"].weight.grad).any()


def test_debug_collection():
    debug = DebugEmbeddingCollection(TABLES, CPU, debug_mode=True)
    assert list(debug.state_dict()) == ["ec.embeddings.t1.weight"]
    features = kjt(3)
    out = debug(features)
    plain = debug.ec(features)
    for f in ("f1", "f2"):
        assert torch.equal(out[f].values(), plain[f].values()) and torch.equal(out[f].lengths(), plain[f].lengths())
    with pytest.raises(RuntimeError, match=r"entering ec\[f1\]\.values"):
        (out["f1"].values() * float("inf")).sum().backward()


def test_pec_collection_is_its_collection():
    ec = EmbeddingCollection(TABLES, need_indices=True)
    pec = PECEmbeddingCollection(ec)
    assert pec.embedding_collection is ec and pec.checker_type is OverlappingCheckerType.BOOLEAN
    assert list(pec.state_dict()) == ["_embedding_collection.embeddings.t1.weight"]
    assert pec.embedding_configs() == TABLES and pec.embedding_dim() == 4 and pec.need_indices()
    features = kjt(4)
    out, want = pec(features), ec(features)
    assert list(out) == list(want) and all(torch.equal(out[f].values(), want[f].values()) for f in out)
    with pytest.raises(TypeError, match="OverlappingCheckerType"):
        PECEmbeddingCollection(ec, checker_type="boolean")


class Remap(torch.nn.Module):
    """A stand-in pruning step: ids folded onto the first rows, the iterations it saw summed in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, features, iteration):
        self.seen += iteration
        return KeyedJaggedTensor(features.keys(), features.values() % 3, lengths=features.lengths())


def test_itep_collections_look_up_the_pruned_ids_and_count_iterations():
    itep = ITEPEmbeddingBagCollection(EmbeddingBagCollection(BAGS), Remap())
    assert list(itep.state_dict()) == ["_iter", "_embedding_bag_collection.embedding_bags.t1.weight",
                                       "_embedding_bag_collection.embedding_bags.t2.weight", "_itep_module.seen"]
    assert itep.embedding_bag_configs() == BAGS
    for step in range(3):
        features = kjt(10 + step)
        folded = KeyedJaggedTensor(features.keys(), features.values() % 3, lengths=features.lengths())
        assert torch.equal(itep(features).values(), itep._embedding_bag_collection(folded).values())
    assert int(itep.state_dict()["_iter"]) == 3 and int(itep.state_dict()["_itep_module.seen"]) == 0 + 1 + 2
    ec_itep = ITEPEmbeddingCollection(EmbeddingCollection(TABLES), Remap())
    out = ec_itep(kjt(20))
    assert torch.equal(out["f1"].values(), ec_itep._embedding_collection.embeddings["t1"].weight[kjt(20)["f1"].values() % 3])
    assert int(ec_itep._iter) == 1 and ec_itep.embedding_bag_configs() == TABLES
