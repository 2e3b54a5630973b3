"""Triton's repository, configuration and statistics extensions through the real tritonclient (gRPC and HTTP):
explicit model control (load, unload, the index with reasons), ModelConfig, ModelStatistics, and the metrics
and Grafana dashboard built on them."""

import json
import re
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest

tg = pytest.importorskip("tritonclient.grpc")
th = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from recship.export.artifact import open_artifact  # noqa: E402
from recship.serving.server import Server, ServerConfig  # noqa: E402
from model_requests import in_process, model_repo  # noqa: E402
from serving_helpers import kserve_tensors, random_request  # noqa: E402

MAX_BATCH = 64
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "recship.json"


@pytest.fixture(scope="module")
def repo(small_artifact, tmp_path_factory):
    """a/1, a/2 and b/1 (the small DLRM), broken/1 (a manifest that is not JSON)."""
    root = model_repo(tmp_path_factory.mktemp("control-repo"), dict.fromkeys(("a", "b", "broken"), small_artifact))
    shutil.copytree(small_artifact, root / "a" / "2")
    (root / "broken" / "1" / "manifest.json").write_text("{not json")
    return root


@pytest.fixture
def explicit(repo):
    """A server under explicit model control that loaded model a at start (a fresh one per test: tests load and unload)."""
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, max_batch_size=MAX_BATCH, max_delay_ms=1,
                                 model_control="explicit", load_models=["a"]))
    yield server
    server.stop()


class Client:
    """One interface over tritonclient.grpc and tritonclient.http, so each test runs through both."""

    def __init__(self, protocol: str, server: Server) -> None:
        self.protocol = protocol
        if protocol == "grpc":
            self.c = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        else:
            self.c = th.InferenceServerClient(f"127.0.0.1:{server.rest.port}")

    def index(self, ready=False):
        got = self.c.get_model_repository_index(**({"as_json": True} if self.protocol == "grpc" else {}))
        models = got.get("models", []) if self.protocol == "grpc" else got
        out = {(m["name"], m.get("version", "")): (m.get("state", ""), m.get("reason", "")) for m in models}
        return {k: v for k, v in out.items() if v[0] == "READY"} if ready else out

    def config(self, model):
        got = self.c.get_model_config(model, **({"as_json": True} if self.protocol == "grpc" else {}))
        return got["config"] if self.protocol == "grpc" else got

    def stats(self, model=""):
        got = self.c.get_inference_statistics(model, **({"as_json": True} if self.protocol == "grpc" else {}))
        return got.get("model_stats", [])

    def infer(self, model, sparse, dense):
        mod = tg if self.protocol == "grpc" else th
        inputs = []
        for name, dtype, data in kserve_tensors(sparse, dense):
            t = mod.InferInput(name, list(data.shape), dtype)
            t.set_data_from_numpy(data)
            inputs.append(t)
        result = self.c.infer(model, inputs)
        return {k: result.as_numpy(k) for k in ("logit", "prob")}

    def close(self):
        self.c.close()


@pytest.fixture(params=["grpc", "http"])
def client(request, explicit):
    c = Client(request.param, explicit)
    yield c
    c.close()


def _refused(call, code_grpc: str, status_http: str):
    """Runs ``call`` and returns the message of the error it must raise (gRPC status name or HTTP status)."""
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() in (code_grpc, status_http), e.value
    return e.value.message()


def test_explicit_load_unload_and_the_index(client, explicit, repo):
    # start-up loaded only --load-model a, newest version; the others are listed with no state
    index = client.index()
    assert index[("a", "2")] == ("READY", "")
    # every version on disk is listed, as Triton lists them: a/1 with the reason it does not serve
    assert index[("a", "1")] == ("UNAVAILABLE", "its version policy latest: 1 leaves it out")
    assert index[("b", "")] == ("", "") and index[("broken", "")] == ("", "")
    assert client.index(ready=True) == {("a", "2"): ("READY", "")}
    assert not client.c.is_model_ready("b")
    sparse, dense = random_request(1)
    message = _refused(lambda: client.infer("b", sparse, dense), "StatusCode.NOT_FOUND", "404")
    assert "'b' is not served" in message

    client.c.load_model("b")
    assert client.c.is_model_ready("b") and client.index()[("b", "1")] == ("READY", "")
    got = client.infer("b", sparse, dense)
    want = in_process(open_artifact(repo / "b" / "1")[0], sparse, dense)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])

    message = _refused(lambda: client.c.load_model("broken"), "StatusCode.FAILED_PRECONDITION", "400")
    assert "model broken did not load" in message and "version 1" in message
    state, reason = client.index()[("broken", "1")]
    assert state == "UNAVAILABLE" and "manifest" in reason
    message = _refused(lambda: client.c.load_model("nope"), "StatusCode.NOT_FOUND", "404")
    assert "no model 'nope' in the repository" in message

    client.c.unload_model("b")
    assert not client.c.is_model_ready("b")
    assert client.index()[("b", "")] == ("UNAVAILABLE", "unloaded") and ("b", "1") not in client.index()
    _refused(lambda: client.infer("b", sparse, dense), "StatusCode.NOT_FOUND", "404")
    client.c.unload_model("b")  # not loaded: nothing to do, not an error
    assert client.c.is_model_ready("a")  # the others keep serving
    np.testing.assert_array_equal(client.infer("a", sparse, dense)["prob"], in_process(open_artifact(repo / "a" / "2")[0], sparse, dense)["prob"])
    # a load reads the repository again: a version added since is served (latest 1: the newest)
    shutil.copytree(repo / "a" / "2", repo / "a" / "3")
    try:
        client.c.load_model("a")
        assert client.index(ready=True)[("a", "3")] == ("READY", "") and ("a", "2") not in client.index(ready=True)
        assert client.index()[("a", "2")] == client.index()[("a", "1")] == ("UNAVAILABLE", "its version policy latest: 1 leaves it out")
    finally:
        shutil.rmtree(repo / "a" / "3")
        client.c.load_model("a")
    assert ("a", "2") in client.index(ready=True)


def test_load_parameters_are_refused_not_ignored(explicit):
    c = tg.InferenceServerClient(f"127.0.0.1:{explicit.port}")
    message = _refused(lambda: c.load_model("a", config=json.dumps({"max_batch_size": 8})), "StatusCode.INVALID_ARGUMENT", "400")
    assert "'config'" in message and "config.yaml" in message
    c.unload_model("a", unload_dependents=True)  # Triton's flag: recship models have no dependents
    assert not c.is_model_ready("a")
    c.load_model("a")
    assert c.is_model_ready("a")
    c.close()


def test_model_config_has_the_served_settings(client, explicit):
    config = client.config("a")
    assert config["name"] == "a" and config["platform"] == "recship_torchscript"
    assert int(config["max_batch_size"]) == MAX_BATCH
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 1000
    metadata = client.c.get_model_metadata("a", **({"as_json": True} if client.protocol == "grpc" else {}))
    assert [i["name"] for i in config["input"]] == [i["name"] for i in metadata["inputs"]]
    # Triton's convention with max_batch_size > 0: dims leave the batch out (dense [B, 13] is [13]; lengths [B], one per
    # example, is [1] reshaped to []; values [N], the request's ids, are ragged [-1]); outputs [B, 1] are [1]
    dims = {i["name"]: ([int(d) for d in i["dims"]], [int(d) for d in i["reshape"].get("shape", [])] if "reshape" in i else None,
                        bool(i.get("allow_ragged_batch", False))) for i in config["input"]}
    shapes = {i["name"]: [int(d) for d in i["shape"]] for i in metadata["inputs"]}
    assert shapes["dense"] == [-1, 13] and dims["dense"] == ([13], None, False)
    assert all(dims[n] == ([1], [], False) for n in shapes if n.endswith(".lengths")) and len(shapes) == 1 + 2 * 26
    assert all(dims[n] == ([-1], None, True) for n in shapes if n.endswith(".values"))
    assert {o["name"]: [int(d) for d in o["dims"]] for o in config["output"]} == {"logit": [1], "prob": [1]}
    assert {i["data_type"] for i in config["input"]} == {"TYPE_INT32", "TYPE_INT64", "TYPE_FP32"}
    assert [o["name"] for o in config["output"]] == ["logit", "prob"]
    assert config["parameters"]["id_policy.cat_0"] == {"string_value": "reject"}
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    _refused(lambda: client.config("nope"), "StatusCode.NOT_FOUND", "404")


def test_statistics_count_what_was_served(explicit):
    """After a known set of requests through both protocols, Triton's statistics add up exactly."""
    clients = [Client("grpc", explicit), Client("http", explicit)]
    before = {s["version"]: s for s in clients[0].stats("a")}["2"]
    examples = 0
    for seed in range(12):
        sparse, dense = random_request(100 + seed)
        clients[seed % 2].infer("a", sparse, dense)
        examples += len(dense)
    bad, dense = random_request(7)
    bad["cat_0"] = [[10_000]] + bad["cat_0"][1:]  # out of range: refused after routing, counted as a failure
    _refused(lambda: clients[0].infer("a", bad, dense), "StatusCode.INVALID_ARGUMENT", "400")
    for c in clients:
        after = {s["version"]: s for s in c.stats("a")}["2"]

        def n(stats, *path):
            for key in path:
                stats = stats.get(key, {}) if isinstance(stats, dict) else stats
            return int(stats or 0)

        assert n(after, "inference_stats", "success", "count") - n(before, "inference_stats", "success", "count") == 12
        assert n(after, "inference_stats", "fail", "count") - n(before, "inference_stats", "fail", "count") == 1
        assert n(after, "inference_count") - n(before, "inference_count") == examples
        assert n(after, "inference_stats", "queue", "count") == n(after, "inference_stats", "compute_infer", "count")
        assert n(after, "inference_stats", "success", "ns") > 0 and n(after, "last_inference") > 0
        batches = after.get("batch_stats", [])
        assert sum(n(b, "compute_infer", "count") for b in batches) == n(after, "execution_count")
        assert sum(n(b, "batch_size") * n(b, "compute_infer", "count") for b in batches) == n(after, "inference_count")
    every = {(s["name"], s["version"]) for s in clients[1].stats()}
    assert ("a", "2") in every
    for c in clients:
        _refused(lambda: c.stats("nope"), "StatusCode.NOT_FOUND", "404")
        c.close()


def test_server_metadata_lists_the_extensions(explicit):
    c = th.InferenceServerClient(f"127.0.0.1:{explicit.rest.port}")
    extensions = c.get_server_metadata()["extensions"]
    assert {"model_repository", "model_configuration", "statistics", "binary_tensor_data"} <= set(extensions)
    c.close()


def test_polling_servers_refuse_load_and_unload(repo, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(repo / "a", root / "a")
    server = Server(ServerConfig(model_repo=str(root), port=0, http_port=0))
    try:
        for client in (Client("grpc", server), Client("http", server)):
            for call in (client.c.load_model, client.c.unload_model):
                message = _refused(lambda: call("a"), "StatusCode.FAILED_PRECONDITION", "400")
                assert "--model-control explicit" in message
            assert client.c.is_model_ready("a")
            client.close()
    finally:
        server.stop()


def test_load_model_names_are_checked_at_start(repo):
    with pytest.raises(ValueError, match="--load-model nope: no such model folder"):
        Server(ServerConfig(model_repo=str(repo), port=0, model_control="explicit", load_models=["a", "nope"]))
    with pytest.raises(ValueError, match="--load-model applies with --model-control explicit"):
        ServerConfig(model_repo=str(repo), load_models=["a"])
    server = Server(ServerConfig(model_repo=str(repo), port=0, model_control="explicit", load_models=["*"]))
    try:  # every model: the broken one is listed with its reason, the rest serve
        assert sorted((s.name, s.version) for s in server.repo.versions()) == [("a", 2), ("b", 1)]
        assert [(u.model, u.version) for u in server.repo.unavailable()] == [("broken", "1")]
    finally:
        server.stop()


# -- metrics and the Grafana dashboard ----------------------------------------------------------


def _scrape(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics.port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_metrics_gauges_and_version_labels(repo, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(repo, root)
    server = Server(ServerConfig(model_repo=str(root), port=0, metrics_port=0, max_delay_ms=1))
    try:
        client = Client("grpc", server)
        sparse, dense = random_request(3)
        client.infer("a", sparse, dense)
        client.close()
        text = _scrape(server)
        assert 'recship_model_ready{model="a",version="2"} 1.0' in text
        assert 'recship_model_ready{model="broken",version="1"} 0.0' in text
        assert 'recship_model_load_failures_total{model="broken"} 1.0' in text
        assert 'recship_queue_depth{model="a",version="2"} 0.0' in text
        assert re.search(r'^recship_inflight_bytes \d', text, re.M)
        for family in ("request_seconds", "queue_seconds", "compute_seconds", "batch_examples"):
            assert f'recship_{family}_count{{model="a",version="2"}} 1.0' in text, family
    finally:
        server.stop()


def test_the_grafana_dashboard_charts_only_metrics_the_server_exports(repo, tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    used = {m for e in exprs for m in re.findall(r"\brecship_[a-z_]+", e)}
    root = tmp_path / "repo"
    shutil.copytree(repo, root)
    server = Server(ServerConfig(model_repo=str(root), port=0, metrics_port=0, max_delay_ms=1))
    try:
        client = Client("grpc", server)
        assert client.c.is_server_ready() and client.c.get_model_metadata("a")  # probes: not requests in the rate panels
        client.infer("a", *random_request(4))
        bad, dense = random_request(5)
        bad["cat_0"] = [[10_000]] + bad["cat_0"][1:]
        _refused(lambda: client.infer("a", bad, dense), "StatusCode.INVALID_ARGUMENT", "400")
        client.close()
        _scrape_text = _scrape(server)
        exported = set(re.findall(r"^(recship_[a-z_]+)", _scrape_text, re.M))
    finally:
        server.stop()
    assert used and used <= exported, sorted(used - exported)
    # the request-rate and error-ratio panels count inference calls, not health or metadata probes
    methods = set(re.findall(r'recship_requests_total\{method="([^"]+)"', _scrape_text))
    assert {"ModelInfer", "ServerReady", "ModelMetadata"} <= methods, methods
    for e in (e for e in exprs if "recship_requests_total" in e):
        patterns = re.findall(r'method=~"([^"]+)"', e)
        assert patterns and patterns.count(patterns[0]) == len(patterns), e
        counted = {m for m in methods if re.fullmatch(patterns[0].replace("\\\\", "\\"), m)}  # PromQL's string escapes undone
        assert counted == {"ModelInfer"}, (e, counted)
    assert {"recship_queue_depth", "recship_model_ready", "recship_model_load_failures_total"} <= used


# -- the REST repository routes under mutated input ----------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from serving_helpers import http_request  # noqa: E402

_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
_body = st.one_of(
    st.just(b""), st.just(b"  \n"), st.binary(max_size=16),
    _json.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["ready", "parameters", "x"]), _json, max_size=2).map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["unload_dependents", "config", "x"]), _json, max_size=2)
    .map(lambda p: json.dumps({"parameters": p}).encode()),
)
_route = st.one_of(
    st.tuples(st.sampled_from(["POST", "GET", "PUT"]), st.just("index"), st.just("")),
    st.tuples(st.sampled_from(["POST", "POST", "POST", "GET"]), st.sampled_from(["load", "unload"]),
              st.sampled_from(["b", "broken", "nope", "-x", "A" * 200, "a.b"])),
)


def _expected(method: str, route: str, name: str, body: bytes, repo: Path) -> int:
    """The HTTP status the repository routes must answer, worked out from the protocol, not from the server."""
    if method != "POST":
        return 405
    doc: object = {}
    if body.strip():
        try:
            doc = json.loads(body)
        except ValueError:
            return 400
        if not isinstance(doc, dict):
            return 400
    assert isinstance(doc, dict)
    if route == "index":
        return 200 if isinstance(doc.get("ready", False), bool) else 400
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict) or any(not (route == "unload" and k == "unload_dependents") for k in parameters):
        return 400
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", name) or not (repo / name).is_dir():
        return 404
    return 400 if (route == "load" and name == "broken") else 200


@settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(route=_route, body=_body)
def test_rest_repository_routes_mutated(explicit_module, repo, route, body):
    """Any method, body and model name on the repository routes gets exactly the status the protocol says, and
    model a (never named) keeps answering exactly meanwhile."""
    server = explicit_module
    method, kind, name = route
    path = "/v2/repository/index" if kind == "index" else f"/v2/repository/models/{name}/{kind}"
    status, _, answer = http_request(server.rest.port, method, path, body)
    assert status == _expected(method, kind, name, body, repo), answer
    doc = json.loads(answer)
    if status == 200 and kind == "index":
        assert {"name", "version", "state", "reason"} >= set().union(*[set(m) for m in doc])
        assert ("a", "2", "READY") in {(m["name"], m["version"], m["state"]) for m in doc}
    elif status != 200:
        assert isinstance(doc["error"], str) and len(doc["error"]) <= 1100
    if status == 200 and kind != "index":
        assert (name in {s.name for s in server.repo.versions()}) == (kind == "load")
    sparse, dense = random_request(len(body))
    got = Client("http", server).infer("a", sparse, dense)
    np.testing.assert_array_equal(got["prob"], in_process(open_artifact(repo / "a" / "2")[0], sparse, dense)["prob"])


@pytest.fixture(scope="module")
def explicit_module(repo):
    server = Server(ServerConfig(model_repo=str(repo), port=0, http_port=0, max_batch_size=MAX_BATCH, max_delay_ms=1,
                                 model_control="explicit", load_models=["a"]))
    yield server
    server.stop()


def test_platform_names_the_format_each_version_runs(small_artifacts, small_artifact, tmp_path):
    """recship_aoti for a version running model.pt2, recship_torchscript for one running model.pt, in ModelConfig and
    ModelMetadata alike (perf_analyzer and model_analyzer read it)."""
    from model_requests import runnable_aoti

    both = runnable_aoti(lambda: small_artifacts(format="both"))
    root = model_repo(tmp_path / "repo", {"compiled": both, "scripted": small_artifact})
    server = Server(ServerConfig(model_repo=str(root), port=0, http_port=0))
    try:
        for protocol in ("grpc", "http"):
            c = Client(protocol, server)
            for model, platform in (("compiled", "recship_aoti"), ("scripted", "recship_torchscript")):
                assert c.config(model)["platform"] == platform
                metadata = c.c.get_model_metadata(model, **({"as_json": True} if protocol == "grpc" else {}))
                assert metadata["platform"] == platform
            c.close()
    finally:
        server.stop()
