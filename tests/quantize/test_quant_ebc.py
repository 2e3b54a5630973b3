"""QuantEmbeddingBagCollection vs the float module: exactness, accuracy targets, ids, script/fx/save."""

import re
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from recship.quantize import QuantConfig, QuantEmbeddingBagCollection, dequantize_rows, quantize_embedding_bag_collection
from recship.sparse import KeyedJaggedTensor
from recship.trainer import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

from reference import tables_kjt


def _ebc(dims=(64, 32, 16), rows=(200, 120, 90), weighted=False, pooling=(PoolingType.SUM, PoolingType.MEAN, PoolingType.SUM), seed=0):
    torch.manual_seed(seed)
    features = [["f0"], ["f1", "f2"], ["f3"]]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=d, feature_names=features[i], pooling=p)
        for i, (d, r, p) in enumerate(zip(dims, rows, pooling))
    ]
    ebc = EmbeddingBagCollection(tables, is_weighted=weighted)
    with torch.no_grad():
        for t in tables:
            ebc.embedding_bags[t.name].weight.normal_(0, 0.1)
    return ebc


def _dequantized_float(ebc, qebc):
    """The float module holding exactly the values the quantized tables store."""
    ref = EmbeddingBagCollection(ebc.embedding_bag_configs(), is_weighted=ebc.is_weighted())
    state = {}
    for name, (data, scale_bias) in qebc.table_weights().items():
        dt = qebc.weight_types()[name]
        from recship.quantize.rowwise import QuantizedRows

        dim = ebc.embedding_bags[name].weight.shape[1]
        state[f"embedding_bags.{name}.weight"] = dequantize_rows(QuantizedRows(data, scale_bias), dt, dim)
    ref.load_state_dict(state)
    return ref


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("types", [("int8", "int4", "int2"), ("fp16", "fp32", "fp8"), ("int4", "int8", "fp16")])
def test_quantized_module_computes_exactly_on_its_stored_values(weighted, types):
    ebc = _ebc(weighted=weighted)
    per_table = dict(zip(["t0", "t1", "t2"], types))
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(table_dtypes=per_table, chunk_rows=37))
    kjt = tables_kjt(ebc.embedding_bag_configs(), 16, seed=1, min_len=3, max_len=6, weighted=weighted)
    out = qebc(kjt)
    assert out.keys() == ["f0", "f1", "f2", "f3"] and out.values().dtype == torch.float32
    torch.testing.assert_close(out.values(), _dequantized_float(ebc, qebc)(kjt).values(), atol=1e-5, rtol=1e-5)


def _rel_error(ebc, dtype, error_minimizing):
    qebc, report = quantize_embedding_bag_collection(ebc, QuantConfig(dtype=dtype, error_minimizing=error_minimizing))
    kjt = tables_kjt(ebc.embedding_bag_configs(), 256, seed=7, min_len=17, max_len=20)
    want = ebc(kjt).values()
    got = qebc(kjt).values()
    return float((got - want).norm() / want.norm()), qebc, report


def test_accuracy_targets_dim64_pooling20():
    ebc = _ebc(dims=(64, 64, 64), rows=(1000, 1000, 1000), pooling=(PoolingType.SUM,) * 3)
    fp16, _, _ = _rel_error(ebc, "fp16", False)
    int8, _, _ = _rel_error(ebc, "int8", False)
    int4, _, _ = _rel_error(ebc, "int4", False)
    int4_best, _, report = _rel_error(ebc, "int4", True)
    int2, _, report2 = _rel_error(ebc, "int2", True)
    assert fp16 <= 5e-4 and int8 <= 6e-3 and int4 <= 9e-2
    assert int4_best < int4
    assert int2 < 1.0 and all(t.pooled_relative_error > 0 for t in report2.tables)


def test_model_bytes_follow_the_row_formats():
    d = 64
    ebc = _ebc(dims=(d, d, d), rows=(500, 300, 200), pooling=(PoolingType.SUM,) * 3)
    float_bytes = sum(t.num_embeddings * d * 4 for t in ebc.embedding_bag_configs())
    padding = 128 * 3  # fbgemm pads each table
    q8, r8 = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
    q4, r4 = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int4"))
    assert q8.weight_bytes() <= (d + 4) / (4 * d) * float_bytes + padding
    assert q4.weight_bytes() <= (d / 2 + 4) / (4 * d) * float_bytes + padding
    assert r8.quantized_bytes == 1000 * (d + 4) and r4.quantized_bytes == 1000 * (d // 2 + 4)


def test_tutorial_int8_rows_are_64_plus_4_bytes_on_cpu_and_80_with_gpu_alignment():
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=64, num_embeddings=4096, feature_names=[f]) for n, f in (("product_table", "product"), ("user_table", "user"))
    ]
    ebc = EmbeddingBagCollection(tables)
    qebc, report = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
    for name, (data, scale_bias) in qebc.table_weights().items():
        assert data.dtype == torch.uint8 and data.shape[1] + scale_bias.shape[1] == 64 + 4
    assert report.row_alignment == 1
    aligned = QuantEmbeddingBagCollection(tables, False, "cpu", weight_types={t.name: DataType.INT8 for t in tables}, row_alignment=16)
    assert aligned.weight_bytes() >= 2 * 4096 * 80  # the tutorial's 80-byte rows (16-byte GPU alignment)
    assert QuantConfig(device="cuda").alignment == 16


def test_out_of_range_ids_are_rejected_not_row_zero():
    ebc = _ebc()
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1, 2, 120, 3]), lengths=torch.tensor([1, 1, 1, 1]))
    message = "feature 'f2': id 120 is out of range [0, 120)"
    with pytest.raises(ValueError, match=re.escape(message)):
        qebc(kjt)
    assert kjt.values().tolist() == [1, 2, 120, 3]  # the caller's tensor is untouched
    with pytest.raises(torch.jit.Error, match=re.escape(message)):
        torch.jit.script(qebc)(kjt)
    neg = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([-1, 2, 3, 3]), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match="feature 'f0': id -1 is out of range"):
        qebc(neg)


def test_modulo_policy_hashes_ids_into_the_table():
    ebc = _ebc()
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="fp32", id_policy={"f2": "modulo"}))
    big = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1, 2, 120 * 7 + 5, 3]), lengths=torch.tensor([1, 1, 1, 1]))
    small = KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1, 2, 5, 3]), lengths=torch.tensor([1, 1, 1, 1]))
    assert torch.equal(qebc(big).values(), qebc(small).values())
    with pytest.raises(ValueError, match="id policy must be one of"):
        quantize_embedding_bag_collection(ebc, QuantConfig(id_policy={"f2": "wrap"}))


def test_script_fx_and_state_dict_round_trip():
    ebc = _ebc(weighted=True)
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int4"))
    kjt = tables_kjt(ebc.embedding_bag_configs(), 8, seed=3, min_len=2, max_len=5, weighted=True)
    want = qebc(kjt).values()
    assert float(want.abs().sum()) > 0
    assert torch.equal(torch.jit.script(qebc)(kjt).values(), want)

    class LeafTBE(torch.fx.Tracer):
        def is_leaf_module(self, m, name):
            return type(m).__name__ == "IntNBitTableBatchedEmbeddingBagsCodegen" or super().is_leaf_module(m, name)

    graph = LeafTBE().trace(qebc)
    traced = torch.fx.GraphModule(qebc, graph)
    assert any(n.op == "call_module" and n.target.startswith("tbes.") for n in graph.nodes)
    assert torch.equal(traced(kjt).values(), want)
    # fbgemm's weights_host is not in the TBE's state_dict (the trap); the module's buffers carry it
    assert "weights_host" not in qebc.tbes[0].state_dict()
    fresh = QuantEmbeddingBagCollection(ebc.embedding_bag_configs(), True, "cpu", weight_types=qebc.weight_types(), row_alignment=None)
    assert not torch.equal(fresh(kjt).values(), want)
    fresh.load_state_dict(qebc.state_dict())
    assert torch.equal(fresh(kjt).values(), want)


def test_jit_save_load_in_a_fresh_process_without_recship(tmp_path):
    ebc = _ebc()
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(table_dtypes={"t0": "int8", "t1": "int4", "t2": "fp16"}))

    class Plain(torch.nn.Module):
        """Takes plain tensors, as exported models do."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return self.inner(KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths)).values()

    kjt = tables_kjt(ebc.embedding_bag_configs(), 4, seed=5, min_len=0, max_len=3)
    want = qebc(kjt).values()
    torch.jit.save(torch.jit.script(Plain(qebc)), str(tmp_path / "m.pt"))
    torch.save({"values": kjt.values(), "lengths": kjt.lengths(), "want": want}, tmp_path / "io.pt")
    code = textwrap.dedent(
        f"""
        import sys, torch, fbgemm_gpu
        m = torch.jit.load({str(tmp_path / 'm.pt')!r})
        io = torch.load({str(tmp_path / 'io.pt')!r})
        got = m(io["values"], io["lengths"])
        assert torch.equal(got, io["want"]), (got - io["want"]).abs().max()
        assert "recship" not in sys.modules
        print("ok", float(got.abs().sum()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok") and float(out.stdout.split()[1]) > 0


def test_auto_picks_the_smallest_type_within_budget():
    ebc = _ebc(dims=(64, 64, 64), rows=(500, 500, 500), pooling=(PoolingType.SUM,) * 3)
    with torch.no_grad():
        ebc.embedding_bags["t2"].weight[::3] *= 50  # heavy-tailed rows: a sensitive table
    for budget in (0.2, 0.03, 0.003):
        _, report = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="auto", error_budget=budget))
        for t in report.tables:
            trials = list(t.auto_trials.items())
            assert t.chosen_by == "auto" and trials[-1][0] == t.data_type
            assert trials[-1][1] <= budget or t.data_type == "FP32"
            assert all(err > budget for _, err in trials[:-1])  # every smaller type missed the budget
    _, loose = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="auto", error_budget=0.2))
    _, tight = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="auto", error_budget=0.003))
    assert loose.quantized_bytes < tight.quantized_bytes


def test_report_prints_and_serialises():
    ebc = _ebc()
    _, report = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8", table_dtypes={"t2": "fp16"}))
    text = str(report)
    assert "table | type | by" in text and "t2    | fp16 | per_table" in text
    data = json.loads(report.to_json())
    assert [t["data_type"] for t in data["tables"]] == ["INT8", "INT8", "FP16"]
    assert data["float_bytes"] == sum(t["float_bytes"] for t in data["tables"])
    for t in data["tables"]:
        assert 0 < t["mean_abs_error"] <= t["max_abs_error"]


def test_config_errors():
    with pytest.raises(ValueError, match="BF16 cannot be served"):
        QuantConfig(dtype="bf16")
    with pytest.raises(ValueError, match="unknown data type 'int3'"):
        QuantConfig(dtype="int3")
    with pytest.raises(ValueError, match="table_dtypes names tables the module does not have"):
        quantize_embedding_bag_collection(_ebc(), QuantConfig(table_dtypes={"nope": "int8"}))


def test_dtype_and_table_dtypes_are_the_only_names():
    """QuantConfig speaks ExportConfig's and the CLI's names (dtype, table_dtypes), and only those."""
    config = QuantConfig("int4", table_dtypes={"t0": "fp16"})  # dtype: the first positional argument
    assert (config.dtype, config.table_dtypes) == (DataType.INT4, {"t0": DataType.FP16})
    for earlier in ({"data_type": "int4"}, {"per_table": {"t0": "fp16"}}):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            QuantConfig(**earlier)
    _, report = quantize_embedding_bag_collection(_ebc(), config)
    assert [t.data_type for t in report.tables] == ["FP16", "INT4", "INT4"]


def test_quantized_embedding_collection_returns_each_ids_row():
    from recship.quantize import quantize_embedding_collection
    from recship.trainer import EmbeddingCollection, EmbeddingConfig

    torch.manual_seed(0)
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(name="a", num_embeddings=40, embedding_dim=16, feature_names=["x", "y"]),
            EmbeddingConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["z"]),
            EmbeddingConfig(name="c", num_embeddings=20, embedding_dim=16, feature_names=["w"]),
        ]
    )
    qec, report = quantize_embedding_collection(ec, QuantConfig(table_dtypes={"a": "int8", "b": "int4", "c": "fp16"}))
    assert len(qec.tbes) == 2  # one TBE per embedding width
    kjt = KeyedJaggedTensor(keys=["z", "w", "x", "y"], values=torch.tensor([1, 29, 0, 19, 3, 39, 2]), lengths=torch.tensor([2, 0, 1, 1, 1, 0, 1, 1]))
    out = qec(kjt)
    scripted = torch.jit.script(qec)(kjt)
    assert list(out) == ["x", "y", "z", "w"]
    from recship.quantize.rowwise import QuantizedRows

    for feature, table, dim in [("x", "a", 16), ("y", "a", 16), ("z", "b", 8), ("w", "c", 16)]:
        data, sb = qec.table_weights()[table]
        deq = dequantize_rows(QuantizedRows(data, sb), qec.weight_types()[table], dim)
        ids = kjt[feature].values()
        assert torch.equal(out[feature].values(), deq[ids])
        assert torch.equal(out[feature].lengths(), kjt[feature].lengths())
        assert torch.equal(scripted[feature].values(), out[feature].values())
    assert [t.data_type for t in report.tables] == ["INT8", "INT4", "FP16"]
    bad = KeyedJaggedTensor(keys=["x", "y", "z", "w"], values=torch.tensor([40]), lengths=torch.tensor([1, 0, 0, 0]))
    with pytest.raises(ValueError, match="feature 'x': id 40 is out of range \\[0, 40\\)"):
        qec(bad)


def test_single_group_fast_path_equals_gathered_path_and_traces():
    ebc = _ebc(pooling=(PoolingType.SUM,) * 3, weighted=True)
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
    kjt = tables_kjt(ebc.embedding_bag_configs(), 6, seed=9, min_len=1, max_len=4, weighted=True)  # keys in table order: the direct path
    shuffled = kjt.permute([3, 1, 0, 2])  # same data, other key order: the gathering path
    want = qebc(kjt).values()
    assert torch.equal(qebc(shuffled).values(), want)
    torch.testing.assert_close(want, _dequantized_float(ebc, qebc)(kjt).values(), atol=1e-5, rtol=1e-5)
    traced = torch.fx.symbolic_trace(qebc)
    assert torch.equal(traced(kjt).values(), want) and torch.equal(traced(shuffled).values(), want)
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().clone().fill_(500), lengths=kjt.lengths(), weights=kjt.weights())
    with pytest.raises(ValueError, match="feature 'f0': id 500 is out of range \\[0, 200\\)"):
        traced(bad)


def test_a_quantized_collection_reports_the_types_its_tables_are_stored_in():
    """TorchRec's quantized collections report each table's stored data_type in their configs (from_float and the
    quantizer alike); the float module's configs are left as they were."""
    from recship.quantize.modules import quantize_embedding_collection
    from recship.trainer import EmbeddingCollection, EmbeddingConfig

    ebc = _ebc()
    names = [t.name for t in ebc.embedding_bag_configs()]
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int4", table_dtypes={names[0]: "fp16"}))
    assert [t.data_type for t in qebc.embedding_bag_configs()] == [DataType.FP16] + [DataType.INT4] * (len(names) - 1)
    assert all(t.data_type == DataType.FP32 for t in ebc.embedding_bag_configs())
    assert isinstance(qebc, QuantEmbeddingBagCollection)
    ec = EmbeddingCollection([EmbeddingConfig(name="e", num_embeddings=10, embedding_dim=8)])
    qec, _ = quantize_embedding_collection(ec, QuantConfig(dtype="int8"))
    assert [t.data_type for t in qec.embedding_configs()] == [DataType.INT8]
