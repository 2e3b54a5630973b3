"""``torchrec.inference.modules`` through the import map (tests/snippets/torchrec_inference_modules.txt): TorchRec's
quantizers give the rows of fbgemm's own row-wise quantization op (what TorchRec 1.8.0 stores; checked bit-equal
against TorchRec in a throwaway venv), the quantized FP-EBC weights ids by position before its quantized lookup,
the quantized model shards and flattens with its feature processors, and a PredictModule subclass runs as TorchRec's
docs show it."""

import copy
import json
from typing import Dict, List

import pytest
import torch
from torch import nn

from recship.names import PoolingType
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from recship.trainer.feature_processors import FeatureProcessedEmbeddingBagCollection, PositionWeightedModuleCollection
from tutorials.notebook import run_snippet

BITS = {torch.qint8: 8, torch.quint4x2: 4}


@pytest.fixture(scope="module")
def trec():
    return run_snippet("torchrec_inference_modules")


class Model(nn.Module):
    """Two pooled tables (SUM, MEAN), an unpooled one, a position-weighted FP-EBC one level down, a dense layer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=40, feature_names=["a"]),
                                           EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=30, feature_names=["b"],
                                                              pooling=PoolingType.MEAN)])
        self.ec = EmbeddingCollection([EmbeddingConfig(name="e0", embedding_dim=8, num_embeddings=20, feature_names=["c"])])
        self.sub = nn.Module()
        self.sub.fp = FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection([EmbeddingBagConfig(name="p0", embedding_dim=8, num_embeddings=25, feature_names=["d"])],
                                   is_weighted=True), PositionWeightedModuleCollection({"d": 5}))
        with torch.no_grad():
            self.sub.fp._feature_processors.position_weights["d"].copy_(torch.rand(5))
        self.dense = nn.Linear(8, 2)

    def forward(self, kjt: KeyedJaggedTensor) -> List[torch.Tensor]:
        return [self.ebc(kjt).values(), self.ec(kjt)["c"].values(), self.sub.fp(kjt).values()]


def _kjt(batch: int = 5, seed: int = 1, high: int = 20) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (4 * batch,), generator=g, dtype=torch.int32)
    values = (torch.rand(int(lengths.sum()), generator=g) * high).long()
    return KeyedJaggedTensor(keys=["a", "b", "c", "d"], values=values, lengths=lengths)


def _rows(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float rows the quantized table holds: fbgemm's own quantize / dequantize ops (min/max, fp16 scale and bias)."""
    if dtype == torch.float16:
        return weight.detach().half().float()
    bits = BITS[dtype]
    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(weight.detach().contiguous(), bits)
    return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, bits)


def _reference(model: Model, kjt: KeyedJaggedTensor, dtypes: Dict[str, torch.dtype], fp_dtype: torch.dtype) -> List[torch.Tensor]:
    """Plain torch: each table's dequantized rows, pooled per bag (position weights for the FP-EBC)."""
    jts = kjt.to_dict()

    def pooled(feature: str, rows: torch.Tensor, mode: str, weights=None) -> torch.Tensor:
        jt = jts[feature]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), jt.lengths().long().cumsum(0)])
        return torch.nn.functional.embedding_bag(jt.values(), rows, offsets[:-1], mode=mode, per_sample_weights=weights,
                                                 include_last_offset=False)

    bags = model.ebc.embedding_bags
    a = pooled("a", _rows(bags["t0"].weight, dtypes["t0"]), "sum")
    b = pooled("b", _rows(bags["t1"].weight, dtypes["t1"]), "mean")
    c = _rows(model.ec.embeddings["e0"].weight, dtypes["e0"])[jts["c"].values()]
    jt = jts["d"]
    positions = torch.cat([torch.arange(int(n)) for n in jt.lengths()])
    w = model.sub.fp._feature_processors.position_weights["d"].detach()[positions]
    fp_rows = _rows(model.sub.fp._embedding_bag_collection.embedding_bags["p0"].weight, fp_dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), jt.lengths().long().cumsum(0)])
    d = torch.nn.functional.embedding_bag(jt.values(), fp_rows, offsets[:-1], mode="sum", per_sample_weights=w)
    return [torch.cat([a, b], dim=1), c, d]


def _close(got: List[torch.Tensor], want: List[torch.Tensor]) -> None:
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-6)  # fbgemm sums a bag in its own order


@pytest.mark.parametrize("dtype,fp_dtype", [(torch.qint8, torch.qint8), (torch.quint4x2, torch.float16)])
def test_quantize_inference_model_stores_fbgemm_rows_and_keeps_the_feature_processors(trec, dtype, fp_dtype):
    model, kjt = Model(), _kjt()
    want = _reference(model, kjt, {"t0": dtype, "t1": torch.float16, "e0": dtype}, fp_dtype)
    quantized = trec["quantize_inference_model"](model, per_table_weight_dtype={"t1": torch.float16}, quantization_dtype=dtype,
                                                 fp_weight_dtype=fp_dtype)
    assert quantized is model and type(model.sub.fp).__name__ == "QuantFeatureProcessedEmbeddingBagCollection"
    assert isinstance(model.sub.fp, trec["QuantFeatureProcessedEmbeddingBagCollection"])
    _close(model(kjt), want)
    keys = set(model.state_dict())
    # TorchRec's keys: the rows, the FP-EBC's processor as feature_processor.*, the TBEs' buffers (register_tbes)
    assert {"ebc.embedding_bags.t0.weight", "ec.embeddings.e0.weight", "sub.fp.embedding_bags.p0.weight",
            "sub.fp.feature_processor.position_weights.d", "ebc.tbes.1.weights_tys", "sub.fp.tbes.0.D_offsets"} <= keys
    assert model.ebc.embedding_bags["t0"].weight.shape == (40, 16)  # int8 dim 8 + 4 bytes scale/bias, padded to 16


def test_quantize_embeddings_swaps_bag_collections_only(trec):
    model, kjt = Model(), _kjt()
    float_ec = model.ec(kjt)["c"].values()
    want = _reference(model, kjt, {"t0": torch.qint8, "t1": torch.qint8, "e0": torch.qint8}, torch.qint8)
    quantized = trec["quantize_embeddings"](model, dtype=torch.qint8, inplace=False)
    assert quantized is not model and type(quantized.ec) is EmbeddingCollection and type(model.ebc) is EmbeddingBagCollection
    assert type(quantized.sub.fp._embedding_bag_collection).__name__ == "QuantEmbeddingBagCollection"  # inner EBC swapped
    got = quantized(kjt)
    _close([got[0], got[2]], [want[0], want[2]])
    assert torch.equal(got[1], float_ec)
    with pytest.raises(ValueError, match="output_dtype"):
        trec["quantize_embeddings"](Model(), dtype=torch.qint8, inplace=True, output_dtype=torch.int8)


def test_pruned_tables_keep_their_first_rows(trec):
    model = Model()
    pruned = model.ebc.embedding_bags["t0"].weight[:10]
    trec["set_pruning_data"](model, {"t0": 10, "p0": 7})
    quantized = trec["quantize_inference_model"](model)
    assert model.ebc.embedding_bag_configs()[0].num_embeddings == 10 and model.ebc.embedding_bags["t0"].weight.shape[0] == 10
    assert model.sub.fp.embedding_bags["p0"].weight.shape[0] == 7
    kjt = _kjt(high=7)
    want = torch.nn.functional.embedding_bag(kjt["a"].values(), _rows(pruned, torch.qint8),
                                             torch.cat([torch.zeros(1, dtype=torch.long), kjt["a"].lengths().long().cumsum(0)])[:-1], mode="sum")
    torch.testing.assert_close(quantized.ebc(kjt)["a"], want, atol=2e-6, rtol=1e-6)


def test_tbe_weights_move_between_models(trec):
    one, other, kjt = trec["quantize_inference_model"](Model(0)), trec["quantize_inference_model"](Model(1)), _kjt()
    assert not torch.equal(one(kjt)[0], other(kjt)[0])
    weights = trec["get_table_to_weights_from_tbe"](one)
    assert sorted(weights) == ["e0", "p0", "t0", "t1"] and weights["t1"][0].dtype == torch.uint8
    trec["assign_weights_to_tbe"](other, weights)
    for g, w in zip(other(kjt)[:2], one(kjt)[:2]):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match="no weights for tables"):
        trec["assign_weights_to_tbe"](other, {"t0": weights["t0"]})


def test_shard_quant_model_places_and_answers_as_the_unsharded(trec):
    model, kjt = trec["quantize_inference_model"](Model()), _kjt()
    want = [v.clone() for v in model(kjt)]
    from recship.trainer import ParameterConstraints

    sharded, plan = trec["shard_quant_model"](model, world_size=2, compute_device="cpu",
                                              constraints={"p0": ParameterConstraints(sharding_types=["row_wise"])})
    got = sharded(kjt)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)  # row blocks sum in another order
    p0 = plan.get_plan_for_module("sub.fp")["p0"]
    assert p0.sharding_type == "row_wise" and [s.shard_sizes for s in p0.shards] == [[13, 8], [12, 8]]
    assert type(sharded.sub.fp).__name__ == "FeatureProcessedLookup"  # the processors stay in front of the shards
    assert {e.sharding_type for e in plan.get_plan_for_module("ebc").values()} == {"table_wise"}
    again, same = trec["shard_quant_model"](trec["quantize_inference_model"](Model()), world_size=2, compute_device="cpu",
                                            sharding_plan=plan)
    assert same is plan
    for g, w in zip(again(kjt), got):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match="does not fit"):
        trec["shard_quant_model"](trec["quantize_inference_model"](Model()), world_size=2, compute_device="cpu", ddr_cap=100)


def test_quant_sharders_shard_only_their_types(trec):
    from recship.distributed import _shard_modules
    from recship.trainer.distributed.types import ShardingEnv

    model, kjt = trec["quantize_inference_model"](Model()), _kjt()
    want = [v.clone() for v in model(kjt)]
    sharded = _shard_modules(model, env=ShardingEnv.from_local(2, 0), device="cpu",
                             sharders=[trec["QuantFeatureProcessedEmbeddingBagCollectionSharder"]()])
    assert type(sharded.ebc).__name__ == "QuantEmbeddingBagCollection"  # no sharder for it: left alone
    assert type(sharded.sub.fp).__name__ == "FeatureProcessedLookup"
    for g, w in zip(sharded(kjt), want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="fused_params keys \\['optimizer'\\]"):
        trec["QuantEmbeddingBagCollectionSharder"](fused_params={"optimizer": "sgd"})
    sharder = trec["QuantEmbeddingBagCollectionSharder"]()
    assert sharder.sharding_types("cpu") == ["table_wise", "row_wise", "column_wise"] and sharder.compute_kernels("table_wise", "cpu") == ["quant"]


def test_export_flattening_keeps_the_feature_processors(trec):
    from recship.quantize.flat import flatten_collections

    model, kjt = trec["quantize_inference_model"](Model()), _kjt()
    flat = flatten_collections(model)
    assert type(flat.sub.fp).__name__ == "FeatureProcessedLookup"
    torch.testing.assert_close(flat(kjt)[2], model(kjt)[2], atol=1e-6, rtol=0)


def test_a_predict_module_subclass_runs_as_torchrec_documents(trec):
    PredictModule, PredictFactory, BatchingMetadata = trec["PredictModule"], trec["PredictFactory"], trec["BatchingMetadata"]

    class MyPredictModule(PredictModule):
        def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
            kjt = KeyedJaggedTensor(keys=["a", "b", "c", "d"], values=batch["ids.values"], lengths=batch["ids.lengths"])
            out = self.predict_module(kjt)
            return {"default": out[0].sum(1) + out[2].sum(1), "grad": torch.tensor(torch.is_grad_enabled())}

    class MyFactory(PredictFactory):
        def create_predict_module(self) -> nn.Module:
            return MyPredictModule(trec["quantize_inference_model"](Model()))

        def batching_metadata(self):
            return {"ids": BatchingMetadata(type="sparse", device="cpu", pinned=["lengths"])}

        def result_metadata(self) -> str:
            return "dict_of_tensor"

        def run_weights_independent_tranformations(self, m):
            return m

        def run_weights_dependent_transformations(self, m):
            return m

    factory, kjt = MyFactory(), _kjt()
    module = factory.create_predict_module()
    out = module({"ids.values": kjt.values(), "ids.lengths": kjt.lengths()})
    want = Model()(kjt)
    assert not out["grad"] and not module.predict_module.training
    assert out["default"].shape == (5,)
    assert set(module.state_dict()) == set(module.predict_module.state_dict())  # no "_module." prefix
    assert json.loads(factory.batching_metadata_json()) == {"ids": {"type": "sparse", "device": "cpu", "pinned": ["lengths"]}}
    assert factory.qualname_metadata_json() == "{}" and factory.model_inputs_data() == {}
    assert dict(trec["QualNameMetadata"](need_preproc=True).__dict__) == {"need_preproc": True}
    torch.testing.assert_close(out["default"], want[0].sum(1) + want[2].sum(1), atol=0.05, rtol=0)  # int8 rows


def test_quantize_dense_halves_the_dense_children(trec):
    PredictModule = trec["PredictModule"]

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.ebc = Model().ebc
            self.mlp = nn.Linear(24, 3)

        def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
            return self.mlp(dense + self.ebc(kjt).values())

    class P(PredictModule):
        def predict_forward(self, batch):
            return self.predict_module(batch["dense"], batch["kjt"])

    module = P(Dense())
    dense = torch.rand(5, 24, generator=torch.Generator().manual_seed(3))
    kjt = _kjt()
    want = module({"dense": dense, "kjt": kjt})
    assert trec["quantize_dense"](module, torch.half) is module
    assert module.predict_module.mlp.weight.dtype == torch.float16 and module.predict_module.ebc.embedding_bags["t0"].weight.dtype == torch.float32
    got = module({"dense": dense, "kjt": kjt})
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=5e-3, rtol=5e-3)
    with pytest.raises(NotImplementedError):
        trec["quantize_dense"](P(Dense()), torch.int8)


def test_names_of_package_loaded_classes_lose_their_prefix(trec):
    trim = trec["trim_torch_package_prefix_from_typename"]
    assert trim("<torch_package_0>.recship.trainer.EmbeddingBagCollection") == "recship.trainer.EmbeddingBagCollection"
    assert trim("recship.trainer.EmbeddingBagCollection") == "recship.trainer.EmbeddingBagCollection"


def test_a_meta_model_quantizes_to_zero_rows_that_load(trec):
    model = Model()
    on_meta = copy.deepcopy(model)
    on_meta.ebc.to("meta")
    on_meta.ec.to("meta")  # as TorchRec's DLRMPredictFactory builds its tables, to load a checkpoint into
    quantized = trec["quantize_inference_model"](on_meta)
    assert quantized.ebc.embedding_bags["t0"].weight.device.type == "cpu" and not quantized.ebc.embedding_bags["t0"].weight.any()
    loaded = trec["quantize_inference_model"](model)
    quantized.load_state_dict(loaded.state_dict(), strict=True)
    kjt = _kjt()
    for g, w in zip(quantized(kjt), loaded(kjt)):
        assert torch.equal(g, w)


def test_the_dlrm_predict_factory_builds_a_scripted_sharded_module(trec):
    import types

    from recship.inference import EmbeddingBagCollection as FloatEBC, sample_batch

    sample = trec["create_training_batch"](types.SimpleNamespace(batch_size=4, num_embedding_features=30))
    keys = sample.sparse_features.keys()
    config = trec["DLRMModelConfig"](dense_arch_layer_sizes=[8, 4], dense_in_features=13, embedding_dim=4, id_list_features_keys=keys,
                                     num_embeddings_per_feature=[30] * len(keys), num_embeddings=None, over_arch_layer_sizes=[4, 1],
                                     sample_input=sample)
    torch.manual_seed(0)
    scripted = trec["DLRMPredictFactory"](config).create_predict_module(world_size=2, device="cpu")
    assert isinstance(scripted, torch.jit.ScriptModule)
    torch.manual_seed(0)  # the same steps, eager: the same dense weights, the tables' rows zero until loaded
    tables = [EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=30, feature_names=[f]) for f in keys]
    eager = trec["DLRMPredictModule"](FloatEBC(tables, device=torch.device("meta")), 13, [8, 4], [4, 1], keys,
                                      dense_device=torch.device("cpu"))
    eager, _ = trec["shard_quant_model"](trec["quantize_inference_model"](eager), world_size=2, compute_device="cpu")
    batch = sample_batch(sample, "cpu")
    got, want = scripted(batch)["default"], eager(batch)["default"]
    assert got.shape == (4,) and torch.equal(got, want)


class _Pooled(nn.Module):
    def __init__(self, fp: nn.Module) -> None:
        super().__init__()
        self.fp = fp

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.fp(kjt).values()


def test_the_quantized_fp_ebc_traces_and_scripts_whole_and_sharded(trec):
    from recship.fx import Tracer

    kjt = _kjt()
    quantized = trec["quantize_inference_model"](Model())
    sharded, _ = trec["shard_quant_model"](trec["quantize_inference_model"](Model()), world_size=2, compute_device="cpu")
    for fp in (quantized.sub.fp, sharded.sub.fp):
        module = _Pooled(fp)
        scripted = torch.jit.script(torch.fx.GraphModule(module, Tracer().trace(module)))
        assert torch.equal(scripted(kjt), module(kjt))
