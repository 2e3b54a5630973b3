"""TorchRec's pre-processing, managed-collision and mixed pooled/sequence test fixtures (``torchrec.distributed.
test_utils.test_model`` through the import map, recship.test_models): outputs against plain-torch recomputations from
the modules' own weights, TorchRec 1.8.0's state_dict keys, and the shallow fx trace TorchRec's train pipeline takes
(every child a leaf) giving the eager outputs. In a throwaway venv the same seeds gave TorchRec 1.8.0's weights,
batches and outputs bit for bit (/tmp scripts, not in the repo)."""

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tutorials.notebook import import_map, rewrite_imports

USER_CODE = (Path(__file__).parent / "snippets" / "torchrec_test_utils_fixtures.txt").read_text()  # TorchRec user code
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def trec():
    scope: Dict[str, object] = {}
    exec(compile(rewrite_imports(USER_CODE, import_map()), "user_code", "exec"), scope)
    return scope


@dataclass
class MCConfig:  # the fields of TorchRec's ManagedCollisionConfig that a sort-ZCH table reads
    mc_type: str = "sort-zch"
    input_hash_size: int = 0


class ChildLeafTracer(torch.fx.Tracer):
    """TorchRec's train-pipeline trace of a model: every direct child module is a leaf."""

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return "." not in qualified_name or super().is_leaf_module(m, qualified_name)


def _tables(trec, count: int, prefix: str = "") -> list:
    return [trec["EmbeddingBagConfig"](num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 4, name=f"{prefix}table_{i}",
                                       feature_names=[f"{prefix}feature_{i}"]) for i in range(count)]


def _batch(trec, seed: int, tables: list, weighted: list, batch_size: int = 3, **kwargs):
    return trec["ModelInput"].generate(batch_size=batch_size, world_size=1, num_float_features=10, tables=tables,
                                       weighted_tables=weighted, random_seed=seed, **kwargs)[0]


def _bags(kjt, feature: str) -> List[torch.Tensor]:
    jt = kjt[feature]
    return list(torch.split(jt.values(), jt.lengths().tolist()))


def _pooled(weight: torch.Tensor, kjt, feature: str, weighted: bool = False) -> torch.Tensor:
    """[B, dim]: each bag's rows summed (times their weights), one bag at a time."""
    jt = kjt[feature]
    weights = list(torch.split(jt.weights(), jt.lengths().tolist())) if weighted else None
    return torch.stack([(weight[ids] * (weights[b][:, None] if weights else 1)).sum(0)
                        for b, ids in enumerate(_bags(kjt, feature))])


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def _preproc_pred(model, idlist, idscore) -> torch.Tensor:
    """TestModelWithPreproc's pred: feature_0..2 pooled by ``ebc``, weighted_feature_0 by ``weighted_ebc``."""
    bags = model.ebc.embedding_bags
    return torch.cat([_pooled(bags[f"table_{i}"].weight, idlist, f"feature_{i}") for i in range(3)]
                     + [_pooled(model.weighted_ebc.embedding_bags["weighted_table_0"].weight, idscore, "weighted_feature_0", True)], 1)


PREPROC_KEYS = ["dense.dummy_param", "dense.dummy_buffer", "dense.linear.weight", "dense.linear.bias",
                "ebc.embedding_bags.table_0.weight", "ebc.embedding_bags.table_1.weight", "ebc.embedding_bags.table_2.weight",
                "weighted_ebc.embedding_bags.weighted_table_0.weight"]


def test_preproc_selectors_keep_their_features(trec):
    batch = _batch(trec, 1, _tables(trec, 4), _tables(trec, 2, "weighted_"))
    [kept] = trec["TestPreprocNonWeighted"]()(batch.idlist_features)
    assert kept.keys() == ["feature_0", "feature_1", "feature_2"]
    for f in kept.keys():
        assert torch.equal(kept[f].values(), batch.idlist_features[f].values())
        assert torch.equal(kept[f].lengths(), batch.idlist_features[f].lengths())
    [weighted] = trec["TestPreprocWeighted"]()(batch.idscore_features)
    assert weighted.keys() == ["weighted_feature_0"]
    assert torch.equal(weighted.weights(), batch.idscore_features["weighted_feature_0"].weights())
    with pytest.raises(ValueError, match="feature_2"):
        trec["TestPreprocNonWeighted"]()(_batch(trec, 1, _tables(trec, 2), []).idlist_features)


def test_model_with_preproc_pools_the_selected_features(trec):
    tables, weighted = _tables(trec, 3), _tables(trec, 1, "weighted_")
    batch = _batch(trec, 2, _tables(trec, 4), weighted)  # feature_3 has no table: the selector drops it
    torch.manual_seed(0)
    model = trec["TestModelWithPreproc"](tables, weighted, CPU)
    assert list(model.state_dict()) == PREPROC_KEYS
    loss, pred = model(copy.deepcopy(batch))
    expected = _preproc_pred(model, batch.idlist_features, batch.idscore_features)
    assert pred.shape == (3, 8 + 12 + 16 + 8)
    _close(pred, expected)
    _close(loss, expected.sum())
    inline = trec["TestModelWithPreproc"](tables, weighted, CPU, run_postproc_inline=True)
    inline.load_state_dict(model.state_dict())
    assert torch.equal(inline(copy.deepcopy(batch))[1], pred)


def test_neg_sampling_appends_the_extra_input(trec):
    tables, weighted = _tables(trec, 3), _tables(trec, 1, "weighted_")
    batch, extra = _batch(trec, 3, tables, weighted), _batch(trec, 4, tables, weighted)
    neg = trec["TestNegSamplingModule"](extra, has_params=True)
    assert list(neg.state_dict()) == ["test_buffer", "_linear.weight", "_linear.bias"]
    before = batch.idlist_features.values().clone()
    out = neg(batch)
    assert torch.equal(out.float_features, torch.cat([batch.float_features, extra.float_features]))
    assert torch.equal(out.label, torch.cat([batch.label, extra.label]))
    assert out.idlist_features.keys() == batch.idlist_features.keys() + extra.idlist_features.keys()
    assert torch.equal(out.idlist_features.values(), torch.cat([batch.idlist_features.values(), extra.idlist_features.values()]))
    assert torch.equal(out.idscore_features.weights(), torch.cat([batch.idscore_features.weights(), extra.idscore_features.weights()]))
    assert batch.idlist_features.keys() == ["feature_0", "feature_1", "feature_2"] and torch.equal(batch.idlist_features.values(), before)
    # as TorchRec's: a key twice in the KJT reads as its last occurrence, so the model pools the extra batch's ids
    torch.manual_seed(0)
    model = trec["TestModelWithPreproc"](tables, weighted, CPU, postproc_module=trec["TestNegSamplingModule"](extra, has_params=True))
    assert list(model.state_dict()) == PREPROC_KEYS + ["_postproc_module.test_buffer", "_postproc_module._linear.weight",
                                                       "_postproc_module._linear.bias"]
    _close(model(batch)[1], _preproc_pred(model, extra.idlist_features, extra.idscore_features))


def test_position_weighted_preproc_weights_by_position(trec):
    batch = _batch(trec, 5, _tables(trec, 4), [])
    module = trec["TestPositionWeightedPreprocModule"]({"feature_1": 20, "feature_3": 30}, CPU)
    assert list(module.state_dict()) == ["fp_proc.position_weights.feature_1", "fp_proc.position_weights.feature_3"]
    with torch.no_grad():
        for w in module.fp_proc.position_weights.values():
            w.copy_(torch.rand(w.shape, generator=torch.Generator().manual_seed(w.numel())))
    out = module(batch)
    assert out.idlist_features.keys() == ["feature_1", "feature_3"]  # TorchRec's processor keeps only its features
    for f in ("feature_1", "feature_3"):
        jt, lengths = out.idlist_features[f], batch.idlist_features[f].lengths()
        positions = torch.cat([torch.arange(int(n)) for n in lengths])
        assert torch.equal(jt.values(), batch.idlist_features[f].values())
        assert torch.equal(jt.weights(), module.fp_proc.position_weights[f][positions])
    assert batch.idlist_features.weights_or_none() is None  # the input is copied, not changed


def test_collection_args_reach_the_nested_module(trec):
    tables, weighted = _tables(trec, 3), _tables(trec, 1, "weighted_")
    batch, extra = _batch(trec, 6, tables, weighted), _batch(trec, 7, tables, weighted)
    seen = {}

    class Nested(nn.Module):
        def forward(self, input, as_list, as_dict):
            seen.update(as_list=as_list, as_dict=as_dict)
            return as_dict["tensor_from_postproc"]

    model = trec["TestModelWithPreprocCollectionArgs"](tables, weighted, CPU, trec["TestNegSamplingModule"](extra), Nested())
    assert list(model.state_dict()) == PREPROC_KEYS + ["_postproc_module_outer.test_buffer"]
    _, pred = model(batch)
    assert seen["as_list"][0] == 1 and seen["as_list"][1] is batch.float_features and seen["as_dict"]["const"] == 1
    assert seen["as_dict"]["tensor_from_input"] is batch.float_features
    assert seen["as_dict"]["tensor_from_postproc"] is seen["as_list"][2]
    _close(pred, _preproc_pred(model, extra.idlist_features, extra.idscore_features))


def test_preproc_models_trace_as_the_train_pipeline_does(trec):
    """TorchRec's pipeline trace (children as leaves) works on these models, and the graph computes eager's output."""
    tables, weighted = _tables(trec, 3), _tables(trec, 1, "weighted_")
    batch, extra = _batch(trec, 8, tables, weighted), _batch(trec, 9, tables, weighted)

    class Nested(nn.Module):
        def forward(self, input, as_list, as_dict):
            return as_dict["tensor_from_postproc"]

    models = [trec["TestModelWithPreproc"](tables, weighted, CPU),
              trec["TestModelWithPreproc"](tables, weighted, CPU, run_postproc_inline=True),
              trec["TestModelWithPreproc"](tables, weighted, CPU, postproc_module=trec["TestNegSamplingModule"](extra)),
              trec["TestModelWithPreproc"](tables, weighted, CPU, postproc_module=trec["TestPositionWeightedPreprocModule"](
                  {f"feature_{i}": 30 for i in range(3)}, CPU)),
              trec["TestModelWithPreprocCollectionArgs"](tables, weighted, CPU, trec["TestNegSamplingModule"](extra), Nested())]
    for model in models:
        graph = torch.fx.GraphModule(model, ChildLeafTracer().trace(model))
        called = {str(n.target) for n in graph.graph.nodes if n.op == "call_module"}
        assert {"postproc_nonweighted", "postproc_weighted", "ebc", "weighted_ebc"} <= called
        eager, traced = model(copy.deepcopy(batch)), graph(copy.deepcopy(batch))
        assert torch.equal(eager[1], traced[1]) and torch.equal(eager[0], traced[0])


ZCH_TABLE_BUFFERS = ["_output_segments_tensor", "_current_iter_tensor", "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping",
                     "_mch_counts", "_mch_last_access_iter"]


def test_zch_sparse_arch_remaps_then_pools(trec):
    tables, weighted = _tables(trec, 2), _tables(trec, 1, "weighted_")
    zch = {t.name: MCConfig("sort-zch", 1000) for t in tables + weighted}
    torch.manual_seed(0)
    arch = trec["TestEBCSparseArchZCH"](tables, weighted, CPU, zch, return_remapped=True)
    mc = "._managed_collision_collection._managed_collision_modules."
    assert list(arch.state_dict()) == (
        [f"ebc{mc}{t}.{b}" for t in ("table_0", "table_1") for b in ZCH_TABLE_BUFFERS]
        + ["ebc._embedding_module.embedding_bags.table_0.weight", "ebc._embedding_module.embedding_bags.table_1.weight"]
        + [f"weighted_ebc{mc}weighted_table_0.{b}" for b in ZCH_TABLE_BUFFERS]
        + ["weighted_ebc._embedding_module.embedding_bags.weighted_table_0.weight"])
    batch = _batch(trec, 10, tables, weighted)
    arch.train()
    out = arch(batch.idlist_features, batch.idscore_features, batch_size=5)
    assert out.keys() == ["feature_0", "feature_1", "weighted_feature_0"] and out.values().shape == (5, 8 + 12 + 8)
    assert torch.equal(out.values()[3:], torch.zeros(2, 28))  # padded to batch_size
    _, remapped = arch.ebc(batch.idlist_features)  # the same ids again: the slots they got
    _, w_remapped = arch.weighted_ebc(batch.idscore_features)
    for f, rows in (("feature_0", 10), ("feature_1", 20)):
        raw, ids = batch.idlist_features[f].values(), remapped[f].values()
        assert int(ids.min()) >= 0 and int(ids.max()) < rows
        for value in raw.unique():  # one raw id, one row
            assert ids[raw == value].unique().numel() == 1
    weights = arch.ebc._embedding_module.embedding_bags
    expected = torch.cat([_pooled(weights["table_0"].weight, remapped, "feature_0"), _pooled(weights["table_1"].weight, remapped, "feature_1"),
                          _pooled(arch.weighted_ebc._embedding_module.embedding_bags["weighted_table_0"].weight, w_remapped,
                                  "weighted_feature_0", True)], 1)
    _close(out.values()[:3], expected)
    arch.eval()
    _close(arch(batch.idlist_features, batch.idscore_features).values(), expected)
    alone = trec["TestEBCSparseArchZCH"](tables, [], CPU, zch)  # no weighted tables (TorchRec fails unpacking None)
    assert alone(batch.idlist_features).keys() == ["feature_0", "feature_1"]
    with pytest.raises(ValueError, match="no entry for table 'table_1'"):
        trec["TestEBCSparseArchZCH"](tables, [], CPU, {"table_0": MCConfig()})
    with pytest.raises(NotImplementedError, match="mp-zch"):
        trec["TestEBCSparseArchZCH"](tables, [], CPU, {t.name: MCConfig("mp-zch") for t in tables})
    with pytest.raises(ValueError, match="Unknown mc_type"):
        trec["TestEBCSparseArchZCH"](tables, [], CPU, {t.name: MCConfig("other") for t in tables})
    nn_zch = trec["TestSparseNN"](tables=tables, weighted_tables=weighted, zch_kwargs=zch)  # on meta, as TorchRec's
    assert type(nn_zch.sparse).__name__ == "TestEBCSparseArchZCH" and nn_zch.sparse.ebc._embedding_module.embedding_bags["table_0"].weight.is_meta


def _mixed_tables(trec) -> list:
    bag, seq = trec["EmbeddingBagConfig"], trec["EmbeddingConfig"]
    return [bag(num_embeddings=10, embedding_dim=4, name="table_0", feature_names=["feature_0"]),
            seq(num_embeddings=20, embedding_dim=8, name="table_1", feature_names=["feature_1"]),
            bag(num_embeddings=30, embedding_dim=12, name="table_2", feature_names=["feature_2"]),
            seq(num_embeddings=40, embedding_dim=8, name="table_3", feature_names=["feature_3", "feature_4"])]


def _sequences(weight: torch.Tensor, kjt, feature: str, length: int = 20) -> torch.Tensor:
    """[B, length * dim]: each example's embeddings, cut or zero-padded to ``length``, flattened."""
    rows = []
    for ids in _bags(kjt, feature):
        seq = weight[ids[:length]]
        rows.append(torch.cat([seq, seq.new_zeros(length - seq.shape[0], weight.shape[1])]).flatten())
    return torch.stack(rows)


def _swish_ln(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    return x * torch.sigmoid(F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps))


def test_mixed_model_pads_sequences_and_pools_bags(trec):
    tables = _mixed_tables(trec)
    batch = _batch(trec, 13, tables, [], batch_size=4, tables_pooling=[3, 25, 4, 15])  # feature_1's bags pass 20 ids
    torch.manual_seed(0)
    model = trec["TestMixedEmbeddingSparseArch"](tables)
    assert list(model.state_dict()) == ["dummy_ones", "ebc.embedding_bags.table_0.weight", "ebc.embedding_bags.table_2.weight",
                                        "ec.embeddings.table_1.weight", "ec.embeddings.table_3.weight", "dense.dummy_param",
                                        "dense.dummy_buffer", "dense.linear.weight", "dense.linear.bias", "over.linear.weight",
                                        "over.linear.bias"]
    idlist, bags, seqs = batch.idlist_features, model.ebc.embedding_bags, model.ec.embeddings
    assert max(len(b) for b in _bags(idlist, "feature_1")) > 20
    sparse = torch.cat([_pooled(bags["table_0"].weight, idlist, "feature_0"), _pooled(bags["table_2"].weight, idlist, "feature_2"),
                        _sequences(seqs["table_1"].weight, idlist, "feature_1"), _sequences(seqs["table_3"].weight, idlist, "feature_3"),
                        _sequences(seqs["table_3"].weight, idlist, "feature_4")], 1)
    got = model.sparse_forward(batch)
    assert got.shape == (4, 4 + 12 + 3 * 20 * 8)
    _close(got, sparse)
    dense = F.linear(batch.float_features, model.dense.linear.weight, model.dense.linear.bias)
    over = F.linear(torch.cat([dense, sparse], 1), model.over.linear.weight, model.over.linear.bias)
    pred = torch.sigmoid(over.mean(1)) + 1
    model.train()
    loss, train_pred = model(batch)
    _close(train_pred, pred)
    _close(loss, F.binary_cross_entropy_with_logits(pred, batch.label))
    model.eval()
    _close(model(batch), pred)
    from recship.fx import symbolic_trace  # TorchRec's whole-model trace works on this model
    assert torch.equal(symbolic_trace(model)(batch), model(batch))


def test_mixed_large_activation_over_arch(trec):
    tables = _mixed_tables(trec)
    batch = _batch(trec, 14, tables, [], batch_size=2)
    model = trec["TestMixedEmbeddingSparseArch"](tables, over_arch_clazz=trec["TestMixedSequenceOverArchLargeActivation"],
                                                 over_arch_kwargs={"large_activation_dim": 24, "over_arch_hidden_layers": 2},
                                                 dense_arch_hidden_sizes=[6])
    layers = model.over.overarch
    assert [type(m).__name__ for m in layers] == ["Linear", "SwishLayerNorm"] * 3 + ["Linear"]
    assert layers[0].in_features == 8 + 4 + 12 + 3 * 20 * 8 and layers[0].out_features == 24 and layers[-1].out_features == 16
    assert "over.overarch.1.norm.0.weight" in model.state_dict() and "dense.hidden_layers.0.weight" in model.state_dict()
    with torch.no_grad():  # LayerNorms away from their identity start
        for m in layers[1::2]:
            m.norm[0].weight.uniform_(0.5, 1.5)
            m.norm[0].bias.uniform_(-0.5, 0.5)
    x = torch.cat([model.dense(batch.float_features), model.sparse_forward(batch)], 1)
    for i in range(0, 6, 2):
        x = _swish_ln(F.linear(x, layers[i].weight, layers[i].bias), layers[i + 1].norm[0])
    x = F.linear(x, layers[6].weight, layers[6].bias)
    model.eval()
    _close(model(batch), torch.sigmoid(x.mean(1)) + 1)
    plain = trec["TestMixedSequenceOverArch"]([tables[0]], [tables[1]], [], max_sequence_length=5, dense_arch_out_size=3,
                                              over_arch_out_size=7)
    assert (plain.linear.in_features, plain.linear.out_features) == (3 + 4 + 5 * 8, 7)


def test_mixed_model_one_kind_of_table_and_bad_arguments(trec):
    tables = _mixed_tables(trec)
    batch = _batch(trec, 15, tables, [], batch_size=2)
    sequences_only = trec["TestMixedEmbeddingSparseArch"]([tables[1]])
    assert sequences_only.ebc is None and sequences_only.sparse_forward(batch).shape == (2, 20 * 8)
    bags_only = trec["TestMixedEmbeddingSparseArch"]([tables[0], tables[2]])
    assert bags_only.ec is None and bags_only.sparse_forward(batch).shape == (2, 16)
    with pytest.raises(ValueError, match="enable_activation_stashing"):
        trec["TestMixedEmbeddingSparseArch"](tables, enable_activation_stashing=True)
    with pytest.raises(ValueError, match="Unsupported table type"):
        trec["TestMixedEmbeddingSparseArch"]([object()])
    with pytest.raises(ValueError, match="large_activation_dim"):
        trec["TestMixedSequenceOverArchLargeActivation"](tables[:1], [], [], large_activation_dim=0)


def test_sequence_tables_draw_in_torchrecs_order(trec):
    """Table by table: nn.Embedding's normal_ draw, then the config's uniform init (TorchRec's order, which the mixed
    model's seeded weights rely on)."""
    tables = [t for t in _mixed_tables(trec) if isinstance(t, trec["EmbeddingConfig"])]
    torch.manual_seed(3)
    model = trec["TestMixedEmbeddingSparseArch"](tables)
    torch.manual_seed(3)
    for t in tables:
        drawn = torch.empty(t.num_embeddings, t.embedding_dim).normal_()
        drawn.uniform_(-(1 / t.num_embeddings) ** 0.5, (1 / t.num_embeddings) ** 0.5)
        assert torch.equal(model.ec.embeddings[t.name].weight, drawn)
