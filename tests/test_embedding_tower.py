"""TorchRec's embedding towers (recship.models.layers.EmbeddingTower / EmbeddingTowerCollection /
tower_input_params): each tower gets the KJT its embedding module takes, outputs concatenated, against plain
per-row lookups with seeded inputs; TorchRec's state_dict keys."""

import pytest
import torch
from torch import nn

from recship.fx import symbolic_trace
from recship.models.layers import EmbeddingTower, EmbeddingTowerCollection, tower_input_params
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, kt):
        return self.lin(kt.values())


class Double(nn.Module):
    def forward(self, kt):
        return kt.values() * 2


class RowSums(nn.Module):
    def forward(self, jts):
        return torch.stack([torch.stack([row.sum() for row in jts["s1"].to_dense()])], 1)


def _towers():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=20, feature_names=["f1", "f2"])])
    wbc = EmbeddingBagCollection([EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=20, feature_names=["w1"])],
                                 is_weighted=True)
    ec = EmbeddingCollection([EmbeddingConfig(name="t3", embedding_dim=4, num_embeddings=20, feature_names=["s1"])])
    return ebc, wbc, ec


def test_tower_input_params():
    ebc, wbc, ec = _towers()
    assert tower_input_params(ebc) == (True, False)
    assert tower_input_params(wbc) == (False, True)
    assert tower_input_params(ec) == (True, False)
    assert tower_input_params(nn.Identity()) == (True, True)


def test_collection_concatenates_each_towers_output():
    ebc, wbc, ec = _towers()
    towers = EmbeddingTowerCollection([EmbeddingTower(ebc, Linear()), EmbeddingTower(wbc, Double()),
                                       EmbeddingTower(ec, RowSums())])
    assert list(towers.state_dict()) == [
        "towers.0.embedding.embedding_bags.t1.weight", "towers.0.interaction.lin.weight",
        "towers.0.interaction.lin.bias", "towers.1.embedding.embedding_bags.t2.weight",
        "towers.2.embedding.embeddings.t3.weight"]
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 2, 0, 1, 1, 2, 3, 0, 2])
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2", "s1"], values, lengths)
    wvalues, wlengths, weights = torch.randint(0, 20, (5,), generator=g), torch.tensor([2, 1, 2]), torch.rand(5, generator=g)
    wkjt = KeyedJaggedTensor.from_lengths_sync(["w1"], wvalues, wlengths, weights=weights)
    with torch.no_grad():
        got = towers(kjt, wkjt)

    s = towers.state_dict()
    t1 = s["towers.0.embedding.embedding_bags.t1.weight"]
    t2 = s["towers.1.embedding.embedding_bags.t2.weight"]
    t3 = s["towers.2.embedding.embeddings.t3.weight"]
    ids = {k: list(torch.split(kjt[k].values(), kjt[k].lengths().tolist())) for k in ["f1", "f2", "s1"]}
    pooled = torch.cat([torch.stack([t1[i].sum(0) for i in ids[f]]) for f in ["f1", "f2"]], 1)
    first = pooled @ s["towers.0.interaction.lin.weight"].T + s["towers.0.interaction.lin.bias"]
    wids, ws = torch.split(wvalues, [2, 1, 2]), torch.split(weights, [2, 1, 2])
    second = torch.stack([(t2[i] * w[:, None]).sum(0) for i, w in zip(wids, ws)]) * 2
    third = torch.stack([t3[i].sum() for i in ids["s1"]])[:, None]
    expected = torch.cat([first, second, third], 1)
    assert got.shape == (3, 3 + 8 + 1)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    bags = EmbeddingTowerCollection([towers.towers[0], towers.towers[1]])  # RowSums loops over rows: not traceable
    assert torch.equal(symbolic_trace(bags)(kjt, wkjt), got[:, :11])  # as an exported model's towers are traced


def test_a_tower_without_its_input_is_refused():
    ebc, wbc, _ = _towers()
    towers = EmbeddingTowerCollection([EmbeddingTower(ebc, Linear()), EmbeddingTower(wbc, Double())])
    kjt = KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], torch.tensor([1, 2]), torch.tensor([1, 0, 0, 1]))
    with pytest.raises(ValueError, match="tower 1 needs weighted_features"):
        towers(kjt)
    with pytest.raises(TypeError, match="tower 0 is a Linear"):
        EmbeddingTowerCollection([Linear()])
