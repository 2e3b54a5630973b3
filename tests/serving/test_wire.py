"""The wire reader against protobuf's own parser: random requests, edge values, odd encodings."""

import numpy as np
import pytest

from recship.serving import wire
from recship.serving.requests import RequestArrays
from recship.serving.v1 import predictor_pb2 as pb

EDGE_INT64 = [0, 1, 127, 128, 300, 2**31 - 1, 2**31, 2**63 - 1, -1, -128, -(2**31), -(2**63)]
EDGE_INT32 = [0, 1, 127, 128, 16384, 2**31 - 1, -1, -(2**31)]


def _random_request(seed):
    g = np.random.default_rng(seed)
    batch = int(g.integers(1, 9))
    features = []
    for i in range(int(g.integers(0, 6))):
        lengths = g.integers(0, 4, size=batch).tolist()
        n = sum(lengths)
        ids = [int(x) for x in g.choice(EDGE_INT64, size=n)] if g.random() < 0.5 else g.integers(0, 10**6, size=n).tolist()
        weights = g.standard_normal(n).astype(np.float32).tolist() if g.random() < 0.5 else []
        if g.random() < 0.2:
            lengths[0] = int(g.choice(EDGE_INT32))  # nonsense, but the reader must read what was sent
        features.append(pb.SparseFeature(name=f"f{i}é", lengths=lengths, ids=ids, weights=weights))
    rows, cols = int(g.integers(0, 4)), int(g.integers(0, 4))
    return pb.PredictRequest(
        model_name="dlrm-ß", model_version=int(g.choice([0, 3, 2**40, -5])), request_id=f"r{seed}",
        batch_size=int(g.choice([batch, 0, -2, 2**31 - 1])), sparse=features,
        dense=pb.DenseMatrix(rows=rows, cols=cols, values=g.standard_normal(rows * cols).astype(np.float32).tolist()),
    )


def _assert_same(got: RequestArrays, want: RequestArrays):
    for attr in ("model_name", "model_version", "request_id", "batch_size", "dense_rows", "dense_cols"):
        assert getattr(got, attr) == getattr(want, attr), attr
    np.testing.assert_array_equal(got.dense, want.dense)
    assert got.sparse.names == want.sparse.names
    for attr in ("lengths", "length_counts", "ids", "id_counts", "weights", "weight_counts"):
        a, b = getattr(got.sparse, attr), getattr(want.sparse, attr)
        assert a.dtype == b.dtype, attr
        np.testing.assert_array_equal(a, b, err_msg=attr)


@pytest.mark.parametrize("seed", range(60))
def test_decode_equals_protobuf(seed):
    msg = _random_request(seed)
    data = msg.SerializeToString()
    got = wire.decode(data)
    assert got is not None  # what protobuf writes takes the fast path
    _assert_same(got, RequestArrays.from_message(pb.PredictRequest.FromString(data)))


def test_split_packed_runs_and_unknown_fields_are_read_as_protobuf_reads_them():
    run1 = pb.SparseFeature(name="x", lengths=[1, 2], ids=[5, 300]).SerializeToString()
    run2 = pb.SparseFeature(ids=[2**40]).SerializeToString()  # a second packed run of the same field
    unknown = bytes([15 << 3 | 0, 42])  # field 15, a varint: not in the schema
    feature = run1 + run2 + unknown
    data = pb.PredictRequest(model_name="m", batch_size=2).SerializeToString() + bytes([5 << 3 | 2, len(feature)]) + feature + unknown
    want = RequestArrays.from_message(pb.PredictRequest.FromString(data))
    assert want.sparse.ids.tolist() == [5, 300, 2**40]
    assert wire.decode(data) is None  # left to protobuf...
    _assert_same(wire.read_request(data), want)  # ...with the same result


def test_unpacked_repeated_fields_are_left_to_protobuf():
    feature = bytes([1 << 3 | 2, 1]) + b"x" + bytes([2 << 3 | 0, 3])  # name "x", lengths=[3] sent unpacked
    data = bytes([5 << 3 | 2, len(feature)]) + feature
    assert wire.decode(data) is None
    assert wire.read_request(data).sparse.lengths.tolist() == [3]


@pytest.mark.parametrize("cut", [1, 5, 17])
def test_truncated_bytes_are_malformed(cut):
    data = _random_request(3).SerializeToString()
    assert len(data) > cut
    with pytest.raises(wire.Malformed):
        wire.read_request(data[:-cut])
