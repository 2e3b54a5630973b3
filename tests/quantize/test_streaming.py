"""The streaming quantization API: choose_types and quantize_into, checked against quantize_rows block by block."""

import pytest
import torch

from recship.quantize import BlockView, QuantConfig, QuantEmbeddingBagCollection, TypeChoice, choose_types, quantize_into
from recship.quantize.rowwise import QuantizedRows, dequantize_rows, quantize_rows, row_bytes
from recship.trainer import DataType, EmbeddingBagConfig


def _tables():
    return [EmbeddingBagConfig(name=f"t{i}", num_embeddings=r, embedding_dim=d, feature_names=[f"f{i}"])
            for i, (r, d) in enumerate([(40, 8), (33, 16), (50, 12)])]


def _weights(tables, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=g) * 0.1 for t in tables}


def test_choose_types_reads_only_the_auto_tables_and_says_why():
    tables, weights = _tables(), _weights(_tables())
    loaded = []

    def load(name):
        loaded.append(name)
        return weights[name]

    config = QuantConfig(dtype="int4", table_dtypes={"t1": "auto", "t2": "fp16"}, error_budget=0.01)
    choices = choose_types(tables, load, config)
    assert loaded == ["t1"]
    assert (choices["t0"].data_type, choices["t0"].chosen_by, choices["t0"].auto_trials) == (DataType.INT4, "default", {})
    assert (choices["t2"].data_type, choices["t2"].chosen_by) == (DataType.FP16, "per_table")
    auto = choices["t1"]
    assert auto.chosen_by == "auto"
    # the smallest type within budget: every smaller candidate tried failed it, the chosen one met it
    assert auto.auto_trials[auto.data_type.name] <= 0.01
    assert all(err > 0.01 for name, err in auto.auto_trials.items() if name != auto.data_type.name)


def test_choose_types_rejects_unknown_tables():
    with pytest.raises(ValueError, match="nope"):
        choose_types(_tables(), lambda name: None, QuantConfig(table_dtypes={"nope": "int8"}))


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.FP16])
def test_quantize_into_blocks_equals_quantizing_each_block(data_type):
    """Four blocks (two row blocks x two column blocks) hold what quantize_rows gives for each block; the report's
    errors are those of the dequantized blocks, whatever the chunk size."""
    t = EmbeddingBagConfig(name="t", num_embeddings=37, embedding_dim=16, feature_names=["f"])
    weight = torch.randn(37, 16, generator=torch.Generator().manual_seed(3))
    row_cuts, col_cuts = [(0, 20), (20, 37)], [(0, 8), (8, 16)]
    blocks = []
    for r0, r1 in row_cuts:
        for c0, c1 in col_cuts:
            data = torch.zeros(r1 - r0, row_bytes(data_type, c1 - c0) - (4 if data_type.bits < 16 else 0), dtype=torch.uint8)
            scale_bias = torch.zeros(r1 - r0, 4, dtype=torch.uint8) if data_type.bits < 16 else None
            blocks.append(BlockView(slice(r0, r1), slice(c0, c1), data, scale_bias))
    config = QuantConfig(dtype=data_type, chunk_rows=7)
    report = quantize_into(0, t, weight, TypeChoice(data_type, "default"), blocks, config)
    errors = torch.zeros_like(weight)
    for b in blocks:
        want = quantize_rows(weight[b.rows, b.cols], data_type, config.error_minimizing)
        assert torch.equal(b.data, want.data)
        if b.scale_bias is not None:
            assert torch.equal(b.scale_bias, want.scale_bias)
        errors[b.rows, b.cols] = (dequantize_rows(QuantizedRows(b.data, b.scale_bias), data_type, b.cols.stop - b.cols.start)
                                  - weight[b.rows, b.cols]).abs()
    assert report.max_abs_error == pytest.approx(float(errors.max()), rel=1e-6)
    assert report.mean_abs_error == pytest.approx(float(errors.double().mean()), rel=1e-6)
    assert (report.table, report.data_type, report.rows, report.dim) == ("t", data_type.name, 37, 16)
    assert report.quantized_bytes == 37 * row_bytes(data_type, 16, config.alignment)


def test_quantize_into_fills_a_collections_storage():
    """One whole-table block per table of a QuantEmbeddingBagCollection: its stored rows are quantize_rows' rows."""
    tables = _tables()
    weights = _weights(tables, seed=1)
    config = QuantConfig(dtype="int8", row_alignment=16)
    choices = choose_types(tables, weights.__getitem__, config)
    module = QuantEmbeddingBagCollection(tables, False, "cpu", weight_types={n: c.data_type for n, c in choices.items()}, row_alignment=16)
    views = module.table_weights()
    for i, t in enumerate(tables):
        quantize_into(i, t, weights[t.name], choices[t.name], [BlockView(slice(None), slice(None), *views[t.name])], config)
    for t in tables:
        data, scale_bias = module.table_weights()[t.name]
        want = quantize_rows(weights[t.name], DataType.INT8, config.error_minimizing)
        assert torch.equal(data, want.data) and torch.equal(scale_bias, want.scale_bias)


def test_row_bytes_pads_to_the_alignment():
    assert row_bytes(DataType.INT4, 12) == 6 + 4
    assert row_bytes(DataType.INT4, 12, alignment=16) == 16
    assert row_bytes(DataType.FP16, 8, alignment=16) == 16
    assert row_bytes(DataType.FP32, 5, alignment=8) == 24
