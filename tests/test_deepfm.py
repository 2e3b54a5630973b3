"""TorchRec's DeepFM (``recship.models.layers.DeepFM`` / ``FactorizationMachine``, ``recship.models.deepfm``): the
modules against plain-torch formulas with seeded inputs, TorchRec's state_dict keys, and a SimpleDeepFMNN exported
by ``recship export`` answering as in process."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from model_requests import in_process
from recship.export import ExportConfig, export_model
from recship.export.artifact import open_artifact
from recship.models.deepfm import FMInteractionArch, ModelInput, SimpleDeepFMNN, SimpleDeepFMNNWrapper
from recship.models.layers import DeepFM, FactorizationMachine
from recship.sparse import KeyedJaggedTensor, KeyedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig

FEATURES = ["f1", "f2", "f3"]


def _embeddings(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 2, 3, generator=g), torch.randn(4, 5, generator=g), torch.randn(4, 3, 2, 2, generator=g)]


def _pairwise(x):
    """sum over i < j of x_i x_j, one row at a time, in float64."""
    x = x.double()
    return torch.stack([sum(row[i] * row[j] for i in range(len(row)) for j in range(i + 1, len(row))) for row in x])


def test_factorization_machine_is_the_sum_over_pairs():
    embs = _embeddings(0)
    got = FactorizationMachine()(embs)
    assert got.shape == (4, 1)
    flat = torch.cat([e.reshape(4, -1) for e in embs], 1)
    torch.testing.assert_close(got.double().squeeze(1), _pairwise(flat), rtol=1e-5, atol=1e-4)
    assert list(FactorizationMachine().state_dict()) == []


@pytest.mark.parametrize("module", ["fm", "deepfm"])
def test_fx_traced_and_scripted_as_eager(module):
    """fx-traceable then TorchScriptable, as TorchRec's: the traced graph calls the flatten-and-concatenate step as a
    leaf, so it does not depend on the list it is traced with; an empty list is refused by all three."""
    torch.manual_seed(0)
    m = FactorizationMachine() if module == "fm" else DeepFM(nn.Linear(6 + 5 + 12, 2))
    gm = torch.fx.symbolic_trace(m)
    scripted = torch.jit.script(gm)
    embs = _embeddings(2)
    for f in (gm, scripted):
        torch.testing.assert_close(f(embs), m(embs), rtol=0, atol=0)
    for f in (m, gm, scripted):
        with pytest.raises(Exception, match="at least one embedding tensor"):
            f([])


def test_deepfm_applies_its_module_to_the_flattened_embeddings():
    torch.manual_seed(0)
    embs = _embeddings(1)
    deep = DeepFM(dense_module=nn.Linear(6 + 5 + 12, 3))
    flat = torch.cat([e.reshape(4, -1) for e in embs], 1)
    assert torch.equal(deep(embs), deep.dense_module(flat))
    assert list(deep.state_dict()) == ["dense_module.weight", "dense_module.bias"]
    with pytest.raises(ValueError, match="at least one"):
        deep([])


def _ebc(dims=(8, 8)):
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name="t1", embedding_dim=dims[0], num_embeddings=50, feature_names=["f1", "f3"]),
        EmbeddingBagConfig(name="t2", embedding_dim=dims[1], num_embeddings=40, feature_names=["f2"])])


def model(device=None):
    return SimpleDeepFMNN(num_dense_features=5, embedding_bag_collection=_ebc(), hidden_layer_size=12, deep_fm_dimension=6)


def _kjt(seed, batch):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * batch,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths), torch.rand(batch, 5, generator=g)


def test_simple_deepfm_matches_its_formula_and_torchrec_keys():
    torch.manual_seed(2)
    m = model()
    assert list(m.state_dict()) == [
        "sparse_arch.embedding_bag_collection.embedding_bags.t1.weight",
        "sparse_arch.embedding_bag_collection.embedding_bags.t2.weight",
        "dense_arch.model.0.weight", "dense_arch.model.0.bias", "dense_arch.model.2.weight", "dense_arch.model.2.bias",
        "inter_arch.deep_fm.dense_module.0.weight", "inter_arch.deep_fm.dense_module.0.bias",
        "over_arch.model.0.weight", "over_arch.model.0.bias"]
    kjt, dense = _kjt(3, 6)
    s = m.state_dict()
    tables = {"f1": s["sparse_arch.embedding_bag_collection.embedding_bags.t1.weight"],
              "f3": s["sparse_arch.embedding_bag_collection.embedding_bags.t1.weight"],
              "f2": s["sparse_arch.embedding_bag_collection.embedding_bags.t2.weight"]}
    pooled = {f: torch.stack([tables[f][ids].sum(0) for ids in kjt[f].to_dense()]) for f in FEATURES}
    relu = torch.relu
    d = relu(relu(dense @ s["dense_arch.model.0.weight"].T + s["dense_arch.model.0.bias"])
             @ s["dense_arch.model.2.weight"].T + s["dense_arch.model.2.bias"])
    flat = torch.cat([d] + [pooled[f] for f in ["f1", "f3", "f2"]], 1)  # the tables' feature order
    deep = relu(flat @ s["inter_arch.deep_fm.dense_module.0.weight"].T + s["inter_arch.deep_fm.dense_module.0.bias"])
    fm = _pairwise(flat).float().unsqueeze(1)
    expected = torch.sigmoid(torch.cat([d, deep, fm], 1) @ s["over_arch.model.0.weight"].T + s["over_arch.model.0.bias"])
    with torch.no_grad():
        got = m(dense, kjt)
    assert got.shape == (6, 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_wrapper_takes_a_model_input_and_trains_on_its_label():
    """SimpleDeepFMNNWrapper(ModelInput): training, (BCE-with-logits of the prediction against the label, the
    prediction), as TorchRec's; eval, the prediction; ModelInput's ``dummy`` tensors travel with ``to``."""
    torch.manual_seed(3)
    wrapper = SimpleDeepFMNNWrapper(num_dense_features=5, embedding_bag_collection=_ebc(), hidden_layer_size=12,
                                    deep_fm_dimension=6)
    kjt, dense = _kjt(4, 6)
    label = torch.rand(6, generator=torch.Generator().manual_seed(5))
    batch = ModelInput(float_features=dense, idlist_features=kjt, idscore_features=None, label=label, dummy=[torch.ones(2)])
    moved = batch.to(torch.device("cpu"), dense_only=True)
    assert moved.idlist_features is kjt and torch.equal(moved.dummy[0], torch.ones(2))
    assert batch.size_in_bytes() == dense.numel() * 4 + label.numel() * 4 + kjt.size_in_bytes() + 2 * 4
    loss, pred = wrapper(batch)
    plain = SimpleDeepFMNN(5, wrapper.sparse_arch.embedding_bag_collection, 12, 6)
    plain.load_state_dict(wrapper.state_dict())
    want = plain(dense, kjt)
    torch.testing.assert_close(pred, want, rtol=0, atol=0)
    torch.testing.assert_close(loss, nn.functional.binary_cross_entropy_with_logits(want.squeeze(), label), rtol=0, atol=0)
    wrapper.eval()
    torch.testing.assert_close(wrapper(batch), want, rtol=0, atol=0)


def test_fm_interaction_without_sparse_features_is_the_dense_input():
    dense = torch.rand(3, 4)
    arch = FMInteractionArch(fm_in_features=4, sparse_feature_names=[], deep_fm_dimension=2)
    assert arch(dense, KeyedTensor(keys=[], length_per_key=[], values=torch.empty(3, 0))) is dense


def test_simple_deepfm_refuses_tables_of_different_widths():
    with pytest.raises(ValueError, match=r"same embedding_dim, got \[4, 8\]"):
        SimpleDeepFMNN(5, _ebc((8, 4)), 12, 6)


def test_exported_simple_deepfm_answers_as_in_process(tmp_path):
    torch.manual_seed(1)
    m = model()
    export_model(m, ExportConfig(out=str(tmp_path / "a"), dtype="fp32", progress=False, validation_batches=1,
                                 validation_batch_size=16, format="torchscript"))
    artifact, _ = open_artifact(tmp_path / "a")
    g = np.random.default_rng(0)
    sparse = {f: [g.integers(0, 40, size=g.integers(0, 4)).tolist() for _ in range(7)] for f in FEATURES}
    dense = g.random((7, 5), dtype=np.float32)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert [f["name"] for f in manifest["sparse_features"]] == ["f1", "f3", "f2"]  # the tables' order
    got = in_process(artifact, sparse, dense, names=["f1", "f3", "f2"])["output"]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES, values=torch.tensor([i for f in FEATURES for r in sparse[f] for i in r], dtype=torch.int64),
        lengths=torch.tensor([len(r) for f in FEATURES for r in sparse[f]]))
    with torch.no_grad():
        expected = m(torch.from_numpy(dense), kjt).numpy()
    assert got.shape == (7, 1)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
