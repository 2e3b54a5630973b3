"""TorchRec's embedding_configs / embedding_modules names beyond the collections (recship re-exports them at the top
level): the new config fields (carried, or refused where recship has no kernel), the eviction-policy dataclasses, the
enum conversions, output names, inverse-index helpers and the collection interfaces; against hand-written
expectations and plain indexing with seeded inputs."""

import pytest
import torch

import recship
from recship import (BaseEmbeddingConfig, CountBasedEvictionPolicy, DataType, EmbeddingBagCollection,
                     EmbeddingBagCollectionInterface, EmbeddingBagConfig, EmbeddingCollection,
                     EmbeddingCollectionInterface, EmbeddingConfig, EmbeddingTableConfig, FeatureScoreBasedEvictionPolicy,
                     PoolingType, TimestampBasedEvictionPolicy)


def test_new_fields_are_carried_and_unsupported_ones_refused():
    c = EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", need_pos=True, input_dim=3, total_num_buckets=2)
    assert (c.need_pos, c.input_dim, c.total_num_buckets) == (True, 3, 2)
    assert isinstance(c, BaseEmbeddingConfig)
    for field, value in [("use_virtual_table", True), ("enable_embedding_update", True), ("stash_weights", True),
                         ("num_embeddings_post_pruning", 5), ("virtual_table_eviction_policy", CountBasedEvictionPolicy())]:
        with pytest.raises(ValueError, match=f"{field}=.* is not supported by recship"):
            EmbeddingConfig(num_embeddings=10, embedding_dim=4, name="t", **{field: value})
    with pytest.raises(ValueError, match="total_num_buckets must be a positive int or None, got 0"):
        EmbeddingBagConfig(num_embeddings=10, embedding_dim=4, name="t", total_num_buckets=0)
    table = EmbeddingTableConfig(num_embeddings=10, embedding_dim=4, name="t", is_weighted=True, embedding_names=["x"])
    assert table.pooling is PoolingType.SUM and table.is_weighted and not table.has_feature_processor


def test_eviction_policies_fill_their_inference_defaults():
    count = CountBasedEvictionPolicy(eviction_threshold=9)
    assert count.inference_eviction_threshold == 9
    count.init_metaheader_config(DataType.FP16, 8)
    count.init_metaheader_config(DataType.FP32, 16)  # once set, kept
    assert (count.get_meta_header_len(), count.get_embedding_dim()) == (8, 8)  # 16 bytes of fp16
    score = FeatureScoreBasedEvictionPolicy(training_id_keep_count=7, enable_auto_feature_score_collection=True)
    assert (score.max_inference_id_num_per_rank, score.feature_score_mapping, score.inference_eviction_ttl_mins) == (7, {}, 0)
    assert TimestampBasedEvictionPolicy().inference_eviction_ttl_mins == 24 * 60


def test_enum_conversions():
    assert [recship.data_type_to_dtype(d) for d in (DataType.FP32, DataType.FP16, DataType.BF16, DataType.INT8,
                                                   DataType.INT4, DataType.INT2)] == [
        torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.quint4x2, torch.quint2x4]
    with pytest.raises(ValueError, match="FP8"):
        recship.data_type_to_dtype(DataType.FP8)
    assert recship.dtype_to_data_type(torch.quint8) is DataType.INT8
    assert recship.dtype_to_data_type(torch.half) is DataType.FP16
    others = {DataType.INT64: torch.int64, DataType.INT32: torch.int32, DataType.UINT8: torch.uint8,
              DataType.NFP8: torch.float8_e4m3fn}  # TorchRec's id / byte / e4m3 members, both ways
    for data_type, dtype in others.items():
        assert recship.data_type_to_dtype(data_type) is dtype
        assert recship.dtype_to_data_type(dtype) is data_type
    with pytest.raises(ValueError, match="Invalid data type torch.complex64"):
        recship.dtype_to_data_type(torch.complex64)
    assert recship.data_type_to_sparse_type(DataType.INT4).name == "INT4"
    assert recship.data_type_to_sparse_type(DataType.UINT8).name == "INT8"  # as TorchRec's
    assert recship.data_type_to_sparse_type(DataType.NFP8).name == "NFP8"
    with pytest.raises(ValueError, match="INT64 names no fbgemm"):
        recship.data_type_to_sparse_type(DataType.INT64)
    assert [recship.pooling_type_to_str(p) for p in (PoolingType.SUM, PoolingType.MEAN)] == ["sum", "mean"]
    with pytest.raises(ValueError, match="Unsupported pooling type"):
        recship.pooling_type_to_str(PoolingType.NONE)
    from recship.names import ShardingType

    mode = recship.pooling_type_to_pooling_mode
    assert mode(PoolingType.MEAN).name == "MEAN" and mode(PoolingType.NONE).name == "NONE"
    assert mode(PoolingType.MEAN, ShardingType.ROW_WISE).name == "SUM"  # row-wise divides after its all-to-all
    assert mode(PoolingType.MEAN, ShardingType.TABLE_WISE).name == "MEAN"


def test_embedding_names_by_table_mark_shared_features():
    tables = [EmbeddingBagConfig(name="a", num_embeddings=5, embedding_dim=2, feature_names=["f", "g"]),
              EmbeddingBagConfig(name="b", num_embeddings=5, embedding_dim=3, feature_names=["g", "h"])]
    assert recship.get_embedding_names_by_table(tables) == [["f", "g@a"], ["g@b", "h"]]


def test_inverse_index_helpers_match_plain_indexing():
    g = torch.Generator().manual_seed(0)
    inverse = torch.randint(0, 3, (3, 4), generator=g)
    got = recship.reorder_inverse_indices((["h", "f", "g"], inverse), ["f", "g@a", "h"])
    assert torch.equal(got, torch.stack([inverse[1], inverse[2], inverse[0]]))
    assert recship.reorder_inverse_indices(None, ["f"]).numel() == 0
    with pytest.raises(ValueError, match=r"no row for \['x'\]"):
        recship.reorder_inverse_indices((["f"], inverse[:1]), ["x"])
    pooled = [torch.randn(3, 2, generator=g), torch.randn(3, 3, generator=g)]
    rows = torch.randint(0, 3, (2, 4), generator=g)
    expected = torch.cat([pooled[0][rows[0]], pooled[1][rows[1]]], 1)
    assert torch.equal(recship.process_pooled_embeddings(pooled, rows), expected)
    assert torch.equal(recship.process_pooled_embeddings(pooled, torch.empty(0)), torch.cat(pooled, 1))


def test_collections_implement_torchrecs_interfaces():
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4)])
    ec = EmbeddingCollection([EmbeddingConfig(name="u", num_embeddings=10, embedding_dim=4)], use_gather_select=True,
                             use_gather_select_per_sharding={"row_wise": False})
    assert isinstance(ebc, EmbeddingBagCollectionInterface) and isinstance(ec, EmbeddingCollectionInterface)
    assert ec.use_gather_select() and ec.use_gather_select_per_sharding() == {"row_wise": False}
    with pytest.raises(TypeError, match="use_gather_select must be a bool"):
        EmbeddingCollection([EmbeddingConfig(name="u", num_embeddings=10, embedding_dim=4)], use_gather_select=1)
    with pytest.raises(TypeError, match="abstract"):
        EmbeddingBagCollectionInterface()
