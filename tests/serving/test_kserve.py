"""The KServe v2 front through the real tritonclient: health, metadata, inference equal to Predict, errors, batching."""

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as triton_pb2  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as triton_grpc  # noqa: E402

from recship.serving import PredictClient  # noqa: E402
from recship.serving.server import Server, ServerConfig  # noqa: E402
from bad_requests import bad_requests  # noqa: E402
from doc_blocks import doc_block  # noqa: E402
from recship.export.artifact import Manifest  # noqa: E402
from recship.serving.requests import InvalidRequest, ModelSpec, RequestArrays, validate  # noqa: E402
from model_requests import dlrm_request, model_repo  # noqa: E402
from serving_helpers import ROWS, kserve_tensors  # noqa: E402


@pytest.fixture(scope="module")
def repo(tmp_path_factory, small_artifact):
    return model_repo(tmp_path_factory.mktemp("repo"), {"dlrm": small_artifact})


@pytest.fixture(scope="module")
def server(repo):
    s = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=5))
    yield s
    s.stop()


@pytest.fixture
def client(server):
    c = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    yield c
    c.close()


def _infer_inputs(sparse, dense, weights=None):
    inputs = []
    for name, dtype, data in kserve_tensors(sparse, dense, weights):
        t = tg.InferInput(name, list(data.shape), dtype)
        t.set_data_from_numpy(data)
        inputs.append(t)
    return inputs


def _rest_body(sparse, dense, weights=None):
    inputs = [{"name": n, "shape": list(d.shape), "datatype": t, "data": d.tolist()} for n, t, d in kserve_tensors(sparse, dense, weights)]
    return json.dumps({"id": "q1", "inputs": inputs}).encode()


def _predict(server, sparse, dense):
    with PredictClient(f"127.0.0.1:{server.port}") as c:
        return c.predict("dlrm", sparse, dense)


def test_the_proto_matches_tritonclients_copy():
    """Field numbers, types and cardinality of every message recship declares equal Triton's; the messages of
    Triton's model configuration that recship fills in part declare a subset of its fields, each the same."""
    from tritonclient.grpc import model_config_pb2

    from recship.serving import kserve

    ours = kserve.POOL.FindFileByName("inference/grpc_service.proto")
    partial = {"ModelConfig", "ModelInput", "ModelOutput", "ModelDynamicBatching", "ModelInstanceGroup", "ModelStatistics"}

    def fields(d):
        return {f.name: (f.number, f.type, f.is_repeated, f.message_type.full_name if f.message_type else None,
                         f.enum_type.full_name if f.enum_type else None) for f in d.fields}

    def compare(mine, theirs):
        got, want = fields(mine), fields(theirs)
        if mine.name in partial:
            assert got == {k: want.get(k) for k in got}, mine.full_name
        else:
            assert got == want, mine.full_name
        for nested in mine.nested_types:
            compare(nested, theirs.nested_types_by_name[nested.name])
        for enum in mine.enum_types:
            assert [(v.name, v.number) for v in enum.values] == [(v.name, v.number) for v in theirs.enum_types_by_name[enum.name].values]

    def triton(name):
        for file in (triton_pb2.DESCRIPTOR, model_config_pb2.DESCRIPTOR):
            if name in file.message_types_by_name:
                return file.message_types_by_name[name]
        raise KeyError(name)

    for name, desc in ours.message_types_by_name.items():
        compare(desc, triton(name))
    for name, enum in ours.enum_types_by_name.items():
        theirs = model_config_pb2.DESCRIPTOR.enum_types_by_name[name]
        assert [(v.name, v.number) for v in enum.values] == [(v.name, v.number) for v in theirs.values]
    theirs = triton_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours.services_by_name["GRPCInferenceService"].methods:
        other = theirs.methods_by_name[method.name]
        assert (method.input_type.full_name, method.output_type.full_name) == (other.input_type.full_name, other.output_type.full_name)


def test_health_metadata_and_index(client, repo):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("dlrm") and client.is_model_ready("dlrm", "1")
    assert not client.is_model_ready("dlrm", "2") and not client.is_model_ready("nope")
    assert client.get_server_metadata(as_json=True)["name"] == "recship"
    meta = client.get_model_metadata("dlrm", as_json=True)
    manifest = json.loads((repo / "dlrm" / "1" / "manifest.json").read_text())
    want = [(f"{f['name']}.{part}", dtype, ["-1"]) for f in manifest["sparse_features"] for part, dtype in (("lengths", "INT32"), ("values", "INT64"))]
    want.append(("dense", "FP32", ["-1", "13"]))
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == want
    assert [(o["name"], o["datatype"], o["shape"]) for o in meta["outputs"]] == [("logit", "FP32", ["-1", "1"]), ("prob", "FP32", ["-1", "1"])]
    assert meta["versions"] == ["1"]
    index = client.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["version"], m["state"]) for m in index] == [("dlrm", "1", "READY")]


@pytest.mark.parametrize("batch", [1, 5, 64])
def test_infer_equals_predict(client, server, batch):
    sparse, dense = dlrm_request(batch, batch)
    result = client.infer("dlrm", _infer_inputs(sparse, dense), model_version="1", request_id=f"r{batch}")
    want = _predict(server, sparse, dense)
    for name in ("logit", "prob"):
        np.testing.assert_array_equal(result.as_numpy(name), want[name])  # lone requests: bitwise
    response = result.get_response()
    assert response.model_version == "1" and response.id == f"r{batch}"


def test_typed_contents_and_requested_outputs(server):
    """Values in InferTensorContents (not raw bytes) work, and the answer comes back typed."""
    sparse, dense = dlrm_request(3, 7)
    req = triton_pb2.ModelInferRequest(model_name="dlrm")
    for name, rows in sparse.items():
        lengths = req.inputs.add(name=f"{name}.lengths", datatype="INT32", shape=[3])
        lengths.contents.int_contents.extend(len(r) for r in rows)
        values = req.inputs.add(name=f"{name}.values", datatype="INT64", shape=[sum(len(r) for r in rows)])
        values.contents.int64_contents.extend(int(i) for r in rows for i in r)
    d = req.inputs.add(name="dense", datatype="FP32", shape=[3, 13])
    d.contents.fp32_contents.extend(dense.reshape(-1).tolist())
    req.outputs.add(name="prob")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        response = triton_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=10)
    assert [o.name for o in response.outputs] == ["prob"] and not response.raw_output_contents
    got = np.asarray(response.outputs[0].contents.fp32_contents, dtype=np.float32).reshape(list(response.outputs[0].shape))
    np.testing.assert_array_equal(got, _predict(server, sparse, dense)["prob"])


def _without(inputs, name):
    return [i for i in inputs if i.name() != name]


def _replace(inputs, name, data, dtype):
    t = tg.InferInput(name, list(data.shape), dtype)
    t.set_data_from_numpy(data)
    return [t if i.name() == name else i for i in inputs]


def test_kserve_specific_invalid_inputs(client, server):
    """What only KServe inputs can get wrong; the request rules shared by every front are in
    test_every_front_refuses_the_shared_bad_requests_with_the_servers_words."""
    sparse, dense = dlrm_request(2, 11)
    good = _infer_inputs(sparse, dense)
    cases = [
        (_replace(good, "cat_0.lengths", np.array([1, 1], dtype=np.int64), "INT64"), "input 'cat_0.lengths' must be INT32"),
        (good + _infer_inputs({"x": [[1], [1]]}, dense)[:1] + [tg.InferInput("bogus", [1], "FP32")], "unknown input"),
        (_without(good, "cat_3.lengths"), "cat_3"),
    ]
    cases[1][0][-1].set_data_from_numpy(np.zeros(1, dtype=np.float32))
    for inputs, message in cases:
        with pytest.raises(tg.InferenceServerException) as err:
            client.infer("dlrm", inputs)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and message in err.value.message()
    with pytest.raises(tg.InferenceServerException) as err:
        client.infer("nope", good)
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert client.infer("dlrm", good).as_numpy("prob").shape == (2, 1)  # and the server keeps answering


def _batch_count(server):
    for metric in server.metrics.registry.collect():
        if metric.name == "recship_batch_examples":
            return sum(s.value for s in metric.samples if s.name.endswith("_count"))
    return 0


def test_concurrent_tritonclients_batch_together_and_get_their_own_rows(server):
    requests = [dlrm_request(1 + i % 5, 200 + i) for i in range(32)]
    want = [_predict(server, s, d) for s, d in requests]
    before = _batch_count(server)
    start = threading.Barrier(len(requests))

    def call(req):
        c = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        inputs = _infer_inputs(*req)
        start.wait()
        try:
            return c.infer("dlrm", inputs).as_numpy("prob")
        finally:
            c.close()

    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(call, requests))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w["prob"], rtol=1e-5, atol=1e-6)  # merged batches: float-rounding close
    assert _batch_count(server) - before < len(requests)  # some requests shared a forward


def test_the_docs_snippet_runs_with_only_tritonclient(server, tmp_path):
    """docs/kserve.md's tritonclient example, as shown, against a live server."""
    snippet = doc_block("tests/serving/test_kserve.py::test_the_docs_snippet_runs_with_only_tritonclient")
    assert "localhost:8500" in snippet
    out = tmp_path / "prob.json"
    script = snippet.replace("localhost:8500", f"127.0.0.1:{server.port}") + (
        "\nimport json, sys\n"
        f"json.dump(prob.tolist(), open({str(out)!r}, 'w'))\n"
        "assert not [m for m in sys.modules if m.startswith('recship')], 'the snippet must not need recship'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    sparse = {f"cat_{i}": [[0], [0]] for i in range(26)}
    want = _predict(server, sparse, np.full((2, 13), 0.5, dtype=np.float32))["prob"]
    np.testing.assert_array_equal(np.asarray(json.loads(out.read_text()), dtype=np.float32), want)


def _http(port, path, body=None):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_rest_front_health_metadata_infer_and_errors(repo):
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0))
    try:
        port = server.rest.port
        assert _http(port, "/v2/health/live") == (200, {"live": True})
        assert _http(port, "/v2/health/ready") == (200, {"ready": True})
        assert _http(port, "/v2/models/dlrm/versions/1/ready")[0] == 200
        status, meta = _http(port, "/v2/models/dlrm")
        c = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        grpc_meta = c.get_model_metadata("dlrm", as_json=True)
        c.close()
        assert status == 200 and [(i["name"], i["datatype"]) for i in meta["inputs"]] == [(i["name"], i["datatype"]) for i in grpc_meta["inputs"]]
        sparse, dense = dlrm_request(4, 31)
        body = _rest_body  # dense goes as nested lists
        status, answer = _http(port, "/v2/models/dlrm/infer", body(sparse, dense))
        assert status == 200 and answer["id"] == "q1" and answer["model_version"] == "1"
        want = _predict(server, sparse, dense)
        for out in answer["outputs"]:
            np.testing.assert_array_equal(np.asarray(out["data"], dtype=np.float32).reshape(out["shape"]), want[out["name"]])
        bad = {**sparse, "cat_4": [[ROWS[4] + 3]] * 4}
        status, answer = _http(port, "/v2/models/dlrm/infer", body(bad, dense))
        with pytest.raises(grpc.RpcError) as predict_err:
            _predict(server, bad, dense)
        assert status == 400 and answer["error"] == predict_err.value.details()
        assert _http(port, "/v2/models/nope/infer", body(sparse, dense))[0] == 404
        assert _http(port, "/v2/models/dlrm/infer", b"{not json")[0] == 400
    finally:
        server.stop()


def test_every_front_refuses_the_shared_bad_requests_with_the_servers_words(repo):
    """tests/bad_requests.py through Predict, KServe gRPC and REST: each answers the message
    validate() gives (the C++ loader is held to the same table in tests/cpp_loader)."""
    manifest = Manifest.read(repo / "dlrm" / "1")
    spec = ModelSpec.from_manifest(manifest, 512)
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0))
    try:
        client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        cases = bad_requests([f.rows for f in manifest.sparse_features], manifest.num_dense)
        for what, sparse, dense, weights in cases:
            with pytest.raises(InvalidRequest) as rule:
                validate(RequestArrays.from_message(PredictClient.request("dlrm", sparse, dense, weights)), spec)
            want = str(rule.value)
            with pytest.raises(grpc.RpcError) as predict:
                with PredictClient(f"127.0.0.1:{server.port}") as c:
                    c.predict("dlrm", sparse, dense, weights)
            assert (predict.value.code(), predict.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, want), what
            with pytest.raises(tg.InferenceServerException) as kserve:
                client.infer("dlrm", _infer_inputs(sparse, dense, weights))
            assert (kserve.value.status(), kserve.value.message()) == ("StatusCode.INVALID_ARGUMENT", want), what
            assert _http(server.rest.port, "/v2/models/dlrm/infer", _rest_body(sparse, dense, weights)) == (400, {"error": want}), what
        client.close()
    finally:
        server.stop()
