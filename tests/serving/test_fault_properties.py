"""Property tests of every front: mutated requests get exactly the status an independent reference
predicts, answers that succeed equal the artifact run in-process, and a good request sent after
each one is still answered exactly.

The references below re-state the serving rules from docs/serving.md in plain Python (protobuf's own
parser for the bytes, loops for the checks); they share no code with the server's readers.
"""

import json
import math
import os
import re

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recship.export.artifact import open_artifact
from recship.serving.kserve import message
from recship.serving.server import Server, ServerConfig
from recship.serving.v1 import predictor_pb2 as pb
from model_requests import model_repo
from serving_helpers import NUM_DENSE, ROWS, front_binary, http_request

FEATURES = [f"cat_{i}" for i in range(len(ROWS))]
OUTPUTS = ("logit", "prob")
MAX_BATCH = 64
# make test: 200 fixed (derandomised) cases per test; RECSHIP_FUZZ_EXAMPLES=N explores N fresh random ones
_EXPLORE = os.environ.get("RECSHIP_FUZZ_EXAMPLES")
SETTINGS = settings(max_examples=int(_EXPLORE or 200), deadline=None, derandomize=_EXPLORE is None, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", params=["python", "cpp"])
def served(request, small_artifact, tmp_path_factory):
    """(server, the artifact in-process, a channel to the server), once per front: ``--front python`` and ``--front cpp``
    (the C++ front answers the Predicts it accepts and forwards the rest to the Python server behind it)."""
    if request.param == "cpp":
        front_binary()
    repo = model_repo(tmp_path_factory.mktemp("fuzz-repo"), {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, max_batch_size=MAX_BATCH, max_delay_ms=1, front=request.param))
    model, _ = open_artifact(repo / "dlrm" / "1")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, model, channel
    channel.close()
    server.stop()
    for front, counts in sorted(TALLY.items()):  # the cases met, by status (shown with pytest -s)
        print(f"\nfault suite {front}: {sum(counts.values())} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def _run_model(model, lengths, values, dense):
    """The artifact in-process on feature-major lengths/values in the model's feature order."""
    with torch.no_grad():
        out = model(torch.tensor(dense, dtype=torch.float32).reshape(-1, NUM_DENSE), torch.tensor(lengths, dtype=torch.int32),
                    torch.tensor(values, dtype=torch.int64), None)
    return {k: v.numpy() for k, v in out.items()}


# -- the reference rules -----------------------------------------------------------------------

def _check_batch(b, features, dense_shape, dense_values):
    """features: {name: (lengths, ids, weights)} as sent. The shared validation rules -> None (valid) or 'INVALID_ARGUMENT'."""
    if not 0 < b <= MAX_BATCH or set(features) != set(FEATURES):
        return "INVALID_ARGUMENT"
    for name, (lengths, ids, weights) in features.items():
        rows = ROWS[FEATURES.index(name)]
        if len(lengths) != b or min(lengths) < 0 or sum(lengths) != len(ids) or len(weights):
            return "INVALID_ARGUMENT"
        if any(not 0 <= i < rows for i in ids):
            return "INVALID_ARGUMENT"
    if tuple(dense_shape) != (b, NUM_DENSE) or len(dense_values) != b * NUM_DENSE:
        return "INVALID_ARGUMENT"
    if not all(math.isfinite(v) for v in dense_values):
        return "INVALID_ARGUMENT"
    return None


def _expected_outputs(model, b, features, dense_values):
    lengths = [x for f in FEATURES for x in features[f][0]]
    values = [x for f in FEATURES for x in features[f][1]]
    return _run_model(model, lengths, values, dense_values)


def expected_predict(data: bytes, model):
    """('STATUS', outputs or None) for a serialized PredictRequest."""
    try:
        m = pb.PredictRequest.FromString(data)
    except Exception:
        return "INVALID_ARGUMENT", None
    if m.model_name != "dlrm" or m.model_version not in (0, 1):
        return "NOT_FOUND", None
    names = [f.name for f in m.sparse]
    if len(set(names)) != len(names):
        return "INVALID_ARGUMENT", None
    features = {f.name: (list(f.lengths), list(f.ids), list(f.weights)) for f in m.sparse}
    status = _check_batch(m.batch_size, features, (m.dense.rows, m.dense.cols), list(m.dense.values))
    if status:
        return status, None
    return "OK", _expected_outputs(model, m.batch_size, features, list(m.dense.values))


_KSERVE_TYPES = {"INT32": ("<i4", "int_contents"), "INT64": ("<i8", "int64_contents"), "FP32": ("<f4", "fp32_contents")}


def expected_kserve(data: bytes, model):
    """('STATUS', {requested output: array} or None) for a serialized ModelInferRequest."""
    try:
        m = message("ModelInferRequest").FromString(data)
    except Exception:
        return "INVALID_ARGUMENT", None
    if m.model_version != "" and not re.fullmatch(r"[0-9]{1,18}", m.model_version):
        return "INVALID_ARGUMENT", None  # a malformed version is refused before any lookup
    if m.model_name != "dlrm" or m.model_version not in ("", "1"):
        return "NOT_FOUND", None
    bad = ("INVALID_ARGUMENT", None)
    wanted = [o.name for o in m.outputs] or list(OUTPUTS)
    if not set(wanted) <= set(OUTPUTS) or len(set(wanted)) != len(wanted):
        return bad
    raws = list(m.raw_input_contents)
    if raws and len(raws) != len(m.inputs):
        return bad
    names = [i.name for i in m.inputs]
    if len(set(names)) != len(names):
        return bad
    features, dense = {}, None
    for k, inp in enumerate(m.inputs):
        if inp.datatype not in _KSERVE_TYPES:
            return bad
        dtype, field = _KSERVE_TYPES[inp.datatype]
        if raws:
            if inp.HasField("contents") or len(raws[k]) % np.dtype(dtype).itemsize:
                return bad
            values = np.frombuffer(raws[k], dtype=dtype).tolist()
        else:
            values = list(getattr(inp.contents, field))
        shape = list(inp.shape)
        if any(d < 0 for d in shape) or math.prod(shape) != len(values):
            return bad
        if inp.name == "dense":
            if inp.datatype != "FP32" or len(shape) != 2:
                return bad
            dense = (shape, values)
            continue
        feature, _, part = inp.name.rpartition(".")
        want_type = {"lengths": "INT32", "values": "INT64", "weights": "FP32"}.get(part)
        if not feature or want_type is None or inp.datatype != want_type or len(shape) != 1:
            return bad
        features.setdefault(feature, {})[part] = values
    if dense is None:
        return bad  # this model has dense features
    b = dense[0][0]
    sent = {f: (p.get("lengths", []), p.get("values", []), p.get("weights", [])) for f, p in features.items()}
    status = _check_batch(b, sent, dense[0], dense[1])
    if status:
        return status, None
    outputs = _expected_outputs(model, b, sent, dense[1])
    return "OK", {k: outputs[k] for k in wanted}


# -- valid requests and their mutations ---------------------------------------------------------

def _valid_parts(seed: int):
    g = np.random.default_rng(seed)
    b = int(g.integers(1, 6))
    sparse = {f: [list(map(int, g.integers(0, ROWS[i], size=g.integers(0, 3)))) for _ in range(b)] for i, f in enumerate(FEATURES)}
    dense = g.random((b, NUM_DENSE), dtype=np.float32)
    return b, sparse, dense


def valid_predict(seed: int) -> pb.PredictRequest:
    b, sparse, dense = _valid_parts(seed)
    return pb.PredictRequest(
        model_name="dlrm", batch_size=b,
        sparse=[pb.SparseFeature(name=f, lengths=[len(r) for r in rows], ids=[i for r in rows for i in r]) for f, rows in sparse.items()],
        dense=pb.DenseMatrix(rows=b, cols=NUM_DENSE, values=dense.reshape(-1).tolist()),
    )


def valid_kserve(seed: int, raw: bool):
    b, sparse, dense = _valid_parts(seed)
    request = message("ModelInferRequest")(model_name="dlrm")
    tensors = [("dense", "FP32", [b, NUM_DENSE], dense.reshape(-1))]
    for f, rows in sparse.items():
        tensors.append((f"{f}.lengths", "INT32", [b], np.array([len(r) for r in rows], dtype=np.int32)))
        ids = np.array([i for r in rows for i in r], dtype=np.int64)
        tensors.append((f"{f}.values", "INT64", [len(ids)], ids))
    for name, datatype, shape, values in tensors:
        inp = request.inputs.add(name=name, datatype=datatype, shape=shape)
        dtype, field = _KSERVE_TYPES[datatype]
        if raw:
            request.raw_input_contents.append(np.asarray(values, dtype=dtype).tobytes())
        else:
            getattr(inp.contents, field).extend(np.asarray(values).tolist())
    return request


def _mutate_bytes(data: bytes, op) -> bytes:
    kind, pos = op[0], op[1] % (len(data) + 1)
    if kind == "none":
        return data
    if kind == "truncate":
        return data[:pos]
    if kind == "flip":
        return data[:pos] + bytes([data[pos] ^ op[2]]) + data[pos + 1:] if pos < len(data) else data + bytes([op[2]])
    if kind == "insert":
        return data[:pos] + op[2] + data[pos:]
    if kind == "delete":
        return data[:pos] + data[pos + op[2]:]
    return data[:pos] + data[pos:pos + op[2]] * 2  # duplicate a run


byte_mutation = st.one_of(
    st.just(("none", 0)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 16)),
    st.tuples(st.just("duplicate"), st.integers(0, 10**6), st.integers(1, 32)),
)
odd_text = st.one_of(
    st.sampled_from(["", "dlrm", "cat_0", "cat_0.lengths", "dense", "x" * 16384, "²", "1\n2", "\x00\x1b[31m", "cat_99", "logit"]),
    st.text(max_size=12),
)
odd_int = st.one_of(st.sampled_from([0, 1, -1, 2, 64, 65, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)]), st.integers(-3, 70))


def _int32(v: int) -> int:
    return max(-(2**31), min(2**31 - 1, v))


def _mutate_predict(m: pb.PredictRequest, op) -> bytes:
    kind, a, b = op
    f = m.sparse[a % len(m.sparse)]
    if kind == "model_name":
        m.model_name = b
    elif kind == "model_version":
        m.model_version = a
    elif kind == "batch_size":
        m.batch_size = _int32(b)
    elif kind == "feature_name":
        f.name = b
    elif kind == "drop_feature":
        del m.sparse[a % len(m.sparse)]
    elif kind == "repeat_feature":
        m.sparse.append(f)
    elif kind == "length":
        if len(f.lengths):
            f.lengths[0] = _int32(b)
    elif kind == "id":
        if len(f.ids):
            f.ids[0] = b
        else:
            f.ids.append(b)
    elif kind == "weights":
        f.weights.extend([0.5] * len(f.ids))
    elif kind == "dense_shape":
        m.dense.rows, m.dense.cols = (b, m.dense.cols) if a % 2 else (m.dense.rows, b)
    elif kind == "dense_value":
        m.dense.values[0] = [float("nan"), float("inf"), -1e30, 3.0][a % 4]
    elif kind == "dense_drop":
        del m.dense.values[-1]
    return m.SerializeToString()


predict_op = st.tuples(
    st.sampled_from(["none", "model_version", "batch_size", "drop_feature", "repeat_feature",
                     "length", "id", "weights", "dense_shape", "dense_value", "dense_drop"]),
    odd_int, odd_int,
) | st.tuples(st.sampled_from(["model_name", "feature_name"]), st.integers(0, 30), odd_text)


def _call(channel, method: str, data: bytes, response):
    stub = channel.unary_unary(method, request_serializer=None, response_deserializer=response.FromString)
    try:
        return "OK", stub(data, timeout=20)
    except grpc.RpcError as e:
        assert len(e.details() or "") <= 1100, "status messages are bounded"
        return e.code().name, None


def _good_predict_still_exact(channel, model, seed: int) -> None:
    request = valid_predict(seed)
    status, answer = _call(channel, "/recship.serving.v1.Predictor/Predict", request.SerializeToString(), pb.PredictResponse)
    assert status == "OK"
    _, want = expected_predict(request.SerializeToString(), model)
    for t in answer.outputs:
        np.testing.assert_array_equal(np.array(t.values, dtype=np.float32).reshape(list(t.shape)), want[t.name])


def _assert_predict(channel, model, data: bytes) -> str:
    want_status, want = expected_predict(data, model)
    status, answer = _call(channel, "/recship.serving.v1.Predictor/Predict", data, pb.PredictResponse)
    assert status == want_status
    if status == "OK":
        got = {t.name: np.array(t.values, dtype=np.float32).reshape(list(t.shape)) for t in answer.outputs}
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    return status


TALLY: dict = {}


def _count(front: str, status: str) -> None:
    TALLY.setdefault(front, {}).setdefault(status, 0)
    TALLY[front][status] += 1


@SETTINGS
@given(seed=st.integers(0, 2**16), op=byte_mutation)
def test_predict_bytes_mutated(served, seed, op):
    server, model, channel = served
    data = _mutate_bytes(valid_predict(seed).SerializeToString(), op)
    _count("Predict bytes", _assert_predict(channel, model, data))
    _good_predict_still_exact(channel, model, seed + 1)


@SETTINGS
@given(seed=st.integers(0, 2**16), op=predict_op)
def test_predict_fields_mutated(served, seed, op):
    server, model, channel = served
    data = _mutate_predict(valid_predict(seed), op)
    _count("Predict fields", _assert_predict(channel, model, data))
    _good_predict_still_exact(channel, model, seed + 1)


def _assert_kserve(channel, model, data: bytes) -> str:
    want_status, want = expected_kserve(data, model)
    status, answer = _call(channel, "/inference.GRPCInferenceService/ModelInfer", data, message("ModelInferResponse"))
    assert status == want_status
    if status == "OK":
        got = {}
        for k, out in enumerate(answer.outputs):
            if answer.raw_output_contents:
                values = np.frombuffer(answer.raw_output_contents[k], dtype="<f4")
            else:
                values = np.array(out.contents.fp32_contents, dtype=np.float32)
            got[out.name] = values.reshape(list(out.shape))
        assert list(got) == list(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    return status


def _mutate_kserve(m, op) -> bytes:
    kind, a, b = op
    inp = m.inputs[a % len(m.inputs)]
    if kind == "model_version":
        m.model_version = b
    elif kind == "model_name":
        m.model_name = b
    elif kind == "input_name":
        inp.name = b
    elif kind == "datatype":
        inp.datatype = b
    elif kind == "drop_input":
        del m.inputs[a % len(m.inputs)]
        if m.raw_input_contents:
            del m.raw_input_contents[a % len(m.raw_input_contents)]
    elif kind == "repeat_input":
        m.inputs.append(inp)
        if m.raw_input_contents:
            m.raw_input_contents.append(m.raw_input_contents[a % len(m.raw_input_contents)])
    elif kind == "shape":
        if len(inp.shape):
            inp.shape[0] = a
        else:
            inp.shape.append(a)
    elif kind == "add_dim":
        inp.shape.append(1)
    elif kind == "contents_and_raw":
        inp.contents.int64_contents.append(1)
        if not m.raw_input_contents:
            m.raw_input_contents.extend([b""] * len(m.inputs))
    elif kind == "raw_bytes" and m.raw_input_contents:
        k = a % len(m.raw_input_contents)
        m.raw_input_contents[k] = m.raw_input_contents[k][:-1] if b else m.raw_input_contents[k] + b"\x01"
    elif kind == "output":
        m.outputs.add(name=b)
    elif kind == "id" and inp.name.endswith(".values"):
        if inp.contents.int64_contents:
            inp.contents.int64_contents[0] = a
    return m.SerializeToString()


kserve_op = st.tuples(
    st.sampled_from(["model_version", "model_name", "input_name", "datatype", "output"]),
    odd_int, st.one_of(odd_text, st.sampled_from(["", "1", "01", "2", "²", "INT32", "INT64", "FP32", "BYTES", "FP64", "prob"])),
) | st.tuples(
    st.sampled_from(["none", "drop_input", "repeat_input", "shape", "add_dim", "contents_and_raw", "raw_bytes", "id"]),
    odd_int, st.sampled_from(["", "x"]),
)


@SETTINGS
@given(seed=st.integers(0, 2**16), raw=st.booleans(), op=st.one_of(byte_mutation.map(lambda o: ("bytes", o)), kserve_op.map(lambda o: ("field", o))))
def test_kserve_grpc_mutated(served, seed, raw, op):
    server, model, channel = served
    request = valid_kserve(seed, raw)
    data = _mutate_bytes(request.SerializeToString(), op[1]) if op[0] == "bytes" else _mutate_kserve(request, op[1])
    _count("KServe gRPC", _assert_kserve(channel, model, data))
    _good_predict_still_exact(channel, model, seed + 1)


# -- REST -------------------------------------------------------------------------------------

def _strict_tensor(t):
    """The reference's reading of one JSON input -> (name, datatype, shape, flat data) or None (400)."""
    if not isinstance(t, dict) or not {"name", "shape", "datatype", "data"} <= set(t):
        return None
    name, datatype, shape, data = t["name"], t["datatype"], t["shape"], t["data"]
    if not isinstance(name, str) or datatype not in _KSERVE_TYPES:
        return None
    if not isinstance(shape, list) or len(shape) > 8 or any(type(d) is not int or d < 0 or d >= 2**63 for d in shape):
        return None
    flat = data
    if not isinstance(flat, list):
        return None
    while flat and isinstance(flat[0], list):
        if not all(isinstance(x, list) for x in flat):
            return None
        flat = [x for row in flat for x in row]
    lo, hi = {"INT32": (-(2**31), 2**31 - 1), "INT64": (-(2**63), 2**63 - 1), "FP32": (None, None)}[datatype]
    for x in flat:
        if datatype == "FP32":
            if type(x) not in (int, float):
                return None
        elif type(x) is not int or not lo <= x <= hi:
            return None
    return name, datatype, shape, flat


def expected_rest(body: bytes, model):
    """(HTTP status, outputs or None) for a POST /v2/models/dlrm/infer body."""
    def reject(name):
        raise ValueError(name)

    try:
        doc = json.loads(body, parse_constant=reject)
    except (ValueError, RecursionError):
        return 400, None
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not isinstance(doc.get("id", ""), str):
        return 400, None
    request = message("ModelInferRequest")(model_name="dlrm", id=doc.get("id", ""))
    for t in doc["inputs"]:
        parsed = _strict_tensor(t)
        if parsed is None:
            return 400, None
        name, datatype, shape, flat = parsed
        inp = request.inputs.add(name=name, datatype=datatype, shape=shape)
        getattr(inp.contents, _KSERVE_TYPES[datatype][1]).extend(np.asarray(flat, dtype=_KSERVE_TYPES[datatype][0]).tolist())
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs):
        return 400, None
    for o in outputs:
        request.outputs.add(name=o["name"])
    status, want = expected_kserve(request.SerializeToString(), model)
    return {"OK": 200, "INVALID_ARGUMENT": 400, "NOT_FOUND": 404}[status], want


def valid_rest(seed: int) -> dict:
    m = valid_kserve(seed, raw=False)
    inputs = []
    for inp in m.inputs:
        field = _KSERVE_TYPES[inp.datatype][1]
        data = list(getattr(inp.contents, field))
        if inp.name == "dense":  # nested rows, as KServe allows
            data = [data[i:i + NUM_DENSE] for i in range(0, len(data), NUM_DENSE)]
        inputs.append({"name": inp.name, "shape": list(inp.shape), "datatype": inp.datatype, "data": data})
    return {"id": f"r{seed}", "inputs": inputs}


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(0, 19) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
    | st.sampled_from([0, 1, -1, 2.5, 1e30, 2**40, 2**63, True]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(["name", "shape", "datatype", "data", "x"]), children, max_size=4),
    max_leaves=8,
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list) and len(node) <= 30:
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _replace(doc, path, value):
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


rest_op = st.one_of(
    st.just(("none", 0, None)),
    st.tuples(st.just("replace"), st.integers(0, 10**6), json_value),
    st.tuples(st.just("repeat_input"), st.integers(0, 10**6), st.none()),
    st.tuples(st.just("drop_key"), st.integers(0, 10**6), st.none()),
    st.tuples(st.just("bytes"), st.integers(0, 10**6), byte_mutation),
)


def _mutate_rest(doc: dict, op) -> bytes:
    kind, k, value = op
    if kind == "bytes":
        return _mutate_bytes(json.dumps(doc).encode(), value)
    if kind == "none":
        return json.dumps(doc).encode()
    if kind == "repeat_input":
        doc["inputs"].append(doc["inputs"][k % len(doc["inputs"])])
    elif kind == "drop_key":
        inp = doc["inputs"][k % len(doc["inputs"])]
        del inp[sorted(inp)[k % len(inp)]]
    else:
        paths = list(_paths(doc))
        doc = _replace(doc, paths[k % len(paths)], value)
    return json.dumps(doc).encode()


@SETTINGS
@given(seed=st.integers(0, 2**16), op=rest_op)
def test_rest_mutated(served, seed, op):
    server, model, channel = served
    body = _mutate_rest(valid_rest(seed), op)
    want_status, want = expected_rest(body, model)
    status, headers, answer = http_request(server.rest.port, "POST", "/v2/models/dlrm/infer", body)
    assert status == want_status, answer
    doc = json.loads(answer)
    if status == 200:
        got = {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in doc["outputs"]}
        assert list(got) == list(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    else:
        assert len(doc["error"]) <= 1100
    _count("KServe REST", str(status))
    _good_predict_still_exact(channel, model, seed + 1)


# -- the in-flight budget: what a request will cost, around it -------------------------------------------------
# A server whose --max-inflight-mb is BUDGET: large valid requests, and the same with their declared shapes, batch or
# ids no longer matching their payload, whose cost lands from well under to well over the budget. The reference
# re-states docs/serving.md's rule: a request costs its bytes plus 9 times its decoded tensors (KServe: the parsed
# message's tensors once more; REST JSON: its text, 8 bytes a value of each array of at least 256 number
# characters, 24 a character of the rest); over the budget it is refused (RESOURCE_EXHAUSTED, HTTP 429) whatever
# else is wrong with it, since it is refused before it is decoded; under it, it gets what the rules above say.

BUDGET = 2 << 20
_FAST = re.compile(rb"\[[-+0-9.eE, \t\n\r]*\]")


def _ref_cost_predict(data: bytes) -> int:
    return len(data) + 8 * len(data)  # ids and values at fixed width: the bytes are the tensors


def _ref_cost_kserve(data: bytes) -> int:
    m = message("ModelInferRequest").FromString(data)
    tensors = sum(len(r) for r in m.raw_input_contents)
    for inp in m.inputs:
        c = inp.contents
        tensors += 8 * (len(c.int_contents) + len(c.int64_contents)) + 4 * len(c.fp32_contents)
    return len(data) + tensors + 8 * tensors


def _ref_cost_rest(body: bytes) -> int:
    runs = [m.group() for m in _FAST.finditer(body) if len(m.group()) >= 256]
    values = sum(r.count(b",") + 1 for r in runs)
    other = len(body) - sum(map(len, runs))
    tensors = 8 * values + 8 * (other + 1) // 2
    return len(body) + (len(body) + 8 * values + 24 * other) + 8 * tensors


def _large_parts(seed: int, per: int):
    g = np.random.default_rng(seed)
    b = int(g.integers(32, MAX_BATCH + 1))
    sparse = {f: [list(map(int, g.integers(0, ROWS[i], size=g.integers(per // 2, per + 1)))) for _ in range(b)] for i, f in enumerate(FEATURES)}
    return b, sparse, g.random((b, NUM_DENSE), dtype=np.float32)


def _large_request(kind: str, seed: int, per: int, mutation: str, k: int):
    """(bytes of a large ``kind`` request, mutated: "none", "shape" (an input declares other than its payload),
    "batch" (batch_size or dense rows off by one), "ids" (one feature's ids without their lengths))."""
    b, sparse, dense = _large_parts(seed, per)
    f = FEATURES[k % len(FEATURES)]
    if mutation == "ids":
        sparse = dict(sparse)
        extra = [1] * (1 + k % 5)
        if kind == "predict":
            m = valid_predict(0)
            m.CopyFrom(pb.PredictRequest(model_name="dlrm", batch_size=b, dense=pb.DenseMatrix(rows=b, cols=NUM_DENSE, values=dense.reshape(-1).tolist()),
                                         sparse=[pb.SparseFeature(name=n, lengths=[len(r) for r in rows],
                                                                  ids=[i for r in rows for i in r] + (extra if n == f else []))
                                                 for n, rows in sparse.items()]))
            return m.SerializeToString()
    if kind == "predict":
        m = pb.PredictRequest(model_name="dlrm", batch_size=b + (1 if mutation == "batch" else 0),
                              sparse=[pb.SparseFeature(name=n, lengths=[len(r) for r in rows], ids=[i for r in rows for i in r]) for n, rows in sparse.items()],
                              dense=pb.DenseMatrix(rows=b, cols=NUM_DENSE, values=dense.reshape(-1).tolist()))
        if mutation == "shape":
            m.dense.cols += 1
        return m.SerializeToString()
    tensors = [("dense", "FP32", [b + (1 if mutation == "batch" else 0), NUM_DENSE], dense.reshape(-1))]
    for n, rows in sparse.items():
        ids = [i for r in rows for i in r] + ([1] * (1 + k % 5) if mutation == "ids" and n == f else [])
        tensors.append((f"{n}.lengths", "INT32", [b], np.array([len(r) for r in rows], dtype=np.int32)))
        tensors.append((f"{n}.values", "INT64", [len(ids)], np.array(ids, dtype=np.int64)))
    if mutation == "shape":  # one input declares more or fewer values than it carries
        i = k % len(tensors)
        name, datatype, shape, values = tensors[i]
        tensors[i] = (name, datatype, [shape[0] + (1 if k % 2 else -1)] + shape[1:], values)
    if kind == "kserve":
        request = message("ModelInferRequest")(model_name="dlrm")
        for name, datatype, shape, values in tensors:
            getattr(request.inputs.add(name=name, datatype=datatype, shape=shape).contents, _KSERVE_TYPES[datatype][1]).extend(values.tolist())
        return request.SerializeToString()
    return json.dumps({"inputs": [{"name": n, "datatype": d, "shape": s, "data": v.tolist()} for n, d, s, v in tensors]}).encode()


@pytest.fixture(scope="module", params=["python", "cpp"])
def budgeted(request, small_artifact, tmp_path_factory):
    """(server at --max-inflight-mb 2, the artifact in-process, a channel to the server), once per front."""
    if request.param == "cpp":
        front_binary()
    repo = model_repo(tmp_path_factory.mktemp("budget-repo"), {"dlrm": small_artifact})
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, max_batch_size=MAX_BATCH, max_delay_ms=1,
                                 max_inflight_bytes=BUDGET, front=request.param))
    model, _ = open_artifact(repo / "dlrm" / "1")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, model, channel
    channel.close()
    server.stop()
    for what, counts in sorted(TALLY.items()):  # the cases met (pytest -s): each kind must have met both sides
        if what.startswith("budget"):
            print(f"\n{request.param} {what}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


@settings(SETTINGS, max_examples=int(_EXPLORE or 60))
@given(seed=st.integers(0, 2**16), kind=st.sampled_from(["predict", "kserve", "rest"]), per=st.integers(2, 90),
       mutation=st.sampled_from(["none", "none", "shape", "batch", "ids"]), k=st.integers(0, 10**6))
def test_requests_around_the_in_flight_budget_get_the_exact_status(budgeted, seed, kind, per, mutation, k):
    server, model, channel = budgeted
    data = _large_request(kind, seed, per, mutation, k)
    if kind == "predict":
        over = _ref_cost_predict(data) > BUDGET
        want_status, want = ("RESOURCE_EXHAUSTED", None) if over else expected_predict(data, model)
        status = _assert_predict(channel, model, data) if not over else _call(channel, "/recship.serving.v1.Predictor/Predict", data,
                                                                                pb.PredictResponse)[0]
        assert status == want_status
    elif kind == "kserve":
        over = _ref_cost_kserve(data) > BUDGET
        status = _call(channel, "/inference.GRPCInferenceService/ModelInfer", data, message("ModelInferResponse"))[0] if over \
            else _assert_kserve(channel, model, data)
        assert status == ("RESOURCE_EXHAUSTED" if over else expected_kserve(data, model)[0])
    else:
        over = _ref_cost_rest(data) > BUDGET
        want_status, want = (429, None) if over else expected_rest(data, model)
        status, _, answer = http_request(server.rest.port, "POST", "/v2/models/dlrm/infer", data)
        assert status == want_status, answer[:300]
        if status == 200:
            got = {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in json.loads(answer)["outputs"]}
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
        status = str(status)
    if over:
        assert server.inference.inflight_bytes == 0  # nothing held for it
    _count(f"budget {kind}", f"{'over' if over else 'under'} {mutation} {status}")
    _good_predict_still_exact(channel, model, seed + 1)
