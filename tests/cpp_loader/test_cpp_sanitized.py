"""The C++ loader, recship_predict and recship_front once more, built with AddressSanitizer + UBSan.

cpp_loader/build.py --sanitize (CMake option RECSHIP_SANITIZE, with RECSHIP_WERROR: a warning in our
sources fails this build too, but for -Wmaybe-uninitialized, which misfires on instrumented code) builds into build/cpp_loader_sanitize, cached like the normal build (cold:
a few minutes on 2 cores). Every run writes its sanitizer reports into a folder of its own
(``log_path``); a test fails on any report, and on any answer that differs from the normal build's.
libtorch, gRPC and protobuf are not instrumented: ASan sees their heap (it replaces malloc for the whole
process) but not their own out-of-bounds accesses, which is enough for ours.

Skipped, with the reason, where the compiler cannot link the sanitizers (cmake says RECSHIP_SANITIZE).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from recship.export.artifact import Manifest

from bad_requests import bad_requests
from binaries import run_binary
from model_requests import ModelInputs, model_repo, random_request, request_body

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("cmake") is None or shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="needs cmake and a C++ compiler to build the sanitized loader",
)


def _build_module():
    """cpp_loader/build.py as a module."""
    spec = importlib.util.spec_from_file_location("cpp_build", ROOT / "cpp_loader" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sanitized() -> Path:
    """The sanitized build folder (recship_predict, and recship_front where gRPC C++ is installed)."""
    try:
        return _build_module().build(sanitize=True)
    except subprocess.CalledProcessError as e:
        output = (e.stdout or "") + (e.stderr or "")
        if "RECSHIP_SANITIZE:" in output:  # the compiler cannot link -fsanitize=address,undefined: cmake's message
            pytest.skip(" ".join(output[output.index("RECSHIP_SANITIZE:"):].split("\n\n")[0].split()))
        pytest.fail(f"the sanitized build failed (warnings are errors in it):\n{output[-6000:]}")


def test_a_compiler_that_cannot_link_the_sanitizers_is_named_in_one_message_and_asked_again(tmp_path, monkeypatch):
    """What the skip above says where libasan is missing (here: a g++ that refuses -fsanitize), each time asked."""
    compiler = tmp_path / "g++"
    compiler.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -fsanitize=*) exit 1;; esac; done\n'
                        f'exec {shutil.which(os.environ.get("CXX", "g++"))} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    for _ in range(2):  # a failed configure leaves no cache behind: the next build configures (and checks) again
        with pytest.raises(subprocess.CalledProcessError) as failed:
            _build_module().build(tmp_path / "build", sanitize=True)
        assert f"RECSHIP_SANITIZE: {compiler} cannot build and link -fsanitize=address,undefined" in " ".join(failed.value.stderr.split())
        assert not (tmp_path / "build" / "CMakeCache.txt").exists()


class Reports:
    """A folder for the sanitizer reports of the processes started with ``env``; ``check()`` fails on any."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        # Leaks are checked at exit (LeakSanitizer), but for one of torch's own: 2.13's AOTI runtime never frees the
        # handle it makes for each user-managed constant (tables.cpp aoti_constants passes aliases that own no
        # pages for that reason). A UBSan finding ends the process (-fno-sanitize-recover).
        suppressions = folder.parent / "lsan_suppressions.txt"
        suppressions.write_text("leak:aoti_torch_new_tensor_handle\n")
        self.env = {
            **os.environ,
            "ASAN_OPTIONS": f"log_path={folder}/asan:detect_leaks=1:strict_string_checks=1:check_initialization_order=1",
            "LSAN_OPTIONS": f"suppressions={suppressions}:print_suppressions=0",
            "UBSAN_OPTIONS": f"log_path={folder}/ubsan:print_stacktrace=1:halt_on_error=1",
        }

    def check(self) -> None:
        found = sorted(self.folder.iterdir())
        if found:
            pytest.fail("sanitizer reports:\n" + "\n".join(f"== {p.name}\n{p.read_text()[:6000]}" for p in found))


@pytest.fixture
def reports(tmp_path):
    r = Reports(tmp_path / "sanitizer")
    yield r
    r.check()


@pytest.fixture(scope="module")
def artifacts(small_artifacts):
    return {name: small_artifacts(name, "int8") for name in ("dlrm", "emb")}


def _body(art, seed):
    """A random valid request of 5 examples in recship_predict's JSON form (ids up to 3 times past a modulo feature's
    table). Dense is drawn as float64, as this file always drew it: the front test compares concurrent answers bitwise
    with a lone one's, which holds for its request (seed 1) so drawn, not for every request (a merged forward may
    round differently in the last bits)."""
    return request_body(*random_request(ModelInputs.of(Manifest.read(art)), 5, seed, ids=(0, 4), past_modulo=3, dense_dtype=np.float64))


def test_recship_predict_answers_as_the_normal_build_with_no_sanitizer_report(sanitized, binary, artifacts, reports, tmp_path):
    predict = sanitized / "recship_predict"
    for name, art in artifacts.items():
        want, got = run_binary(binary, art), run_binary(predict, art, env=reports.env)  # the artifact's own sample (and self-check)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout) == json.loads(want.stdout)
        for seed in range(3):
            path = tmp_path / f"{name}_{seed}.json"
            path.write_text(json.dumps(_body(art, seed)))
            want, got = run_binary(binary, art, "--request", path), run_binary(predict, art, "--request", path, env=reports.env)
            assert got.returncode == want.returncode == 0, got.stderr
            assert json.loads(got.stdout) == json.loads(want.stdout)
    got = run_binary(predict, artifacts["emb"], "--threads", 4, "--bench", 3, env=reports.env)
    assert got.returncode == 0 and "threads ok: 4" in got.stderr, got.stderr


def test_recship_predict_runs_model_pt2_with_no_sanitizer_report(sanitized, binary, small_artifacts, reports, tmp_path):
    """The AOTInductor path (its constants handed over from the mapped tables): as the normal build, from threads."""
    from recship.export.aoti import cpu_supports

    art = small_artifacts("dlrm", "int8", "cpu", "both")
    isa = Manifest.read(art).aoti.target_isa
    if not cpu_supports(isa)[0]:
        pytest.skip(f"model.pt2 targets {isa}; this CPU lacks {cpu_supports(isa)[1]}")
    path = tmp_path / "request.json"
    path.write_text(json.dumps(_body(art, 5)))
    want = run_binary(binary, art, "--request", path, "--format", "aoti")
    got = run_binary(sanitized / "recship_predict", art, "--request", path, "--format", "aoti", "--threads", 3, env=reports.env)
    assert got.returncode == want.returncode == 0 and "threads ok: 3" in got.stderr, got.stderr
    assert json.loads(got.stdout) == json.loads(want.stdout)


def test_recship_predict_refuses_bad_requests_and_flags_with_no_sanitizer_report(sanitized, binary, artifacts, reports, tmp_path):
    art = artifacts["dlrm"]
    manifest = Manifest.read(art)
    bodies = [request_body(s, d, w) for _, s, d, w in bad_requests([f.rows for f in manifest.sparse_features], manifest.num_dense)]
    good = _body(art, 0)
    for bad in ([[1.5]], [[1e30]], [["7"]], [[True]], [[2**63]], [1, 2], None):
        bodies.append({**good, "sparse": {**good["sparse"], "cat_2": bad}})
    bodies += [{**good, "dense": [[1e39] * 13] * 5}, {**good, "dense": [[0.5]] * 4 + [[0.5, 0.5]]}, [], {"sparse": {}}]
    for i, body in enumerate(bodies):
        path = tmp_path / f"bad_{i}.json"
        path.write_text(json.dumps(body))
        want, got = run_binary(binary, art, "--request", path), run_binary(sanitized / "recship_predict", art, "--request", path, env=reports.env)
        assert (got.returncode, got.stderr) == (2, want.stderr), body
    (tmp_path / "not_json.json").write_text('{"sparse": {"cat_0": [[1')
    assert run_binary(sanitized / "recship_predict", art, "--request", tmp_path / "not_json.json", env=reports.env).returncode == 2
    for flag, value in (("--bench", "x"), ("--threads", "-3"), ("--max-batch-size", "1e3")):
        assert run_binary(sanitized / "recship_predict", art, flag, value, env=reports.env).returncode == 2


@pytest.mark.parametrize("damage", ["model.pt", "manifest.json", "tables.bin", "sample/inputs.lengths.bin",
                                    "sample/inputs.values.bin", "sample/inputs.dense.bin", "sample/outputs.prob.bin"])
def test_a_damaged_artifact_is_refused_with_no_sanitizer_report(sanitized, artifacts, reports, tmp_path, damage):
    """Each file cut to 8 bytes: an artifact error (exit 1), never a read past what the file holds."""
    art = tmp_path / "damaged"
    shutil.copytree(artifacts["dlrm"], art)
    with open(art / damage, "r+b") as f:
        f.truncate(8)
    got = run_binary(sanitized / "recship_predict", art, env=reports.env)
    assert got.returncode == 1 and got.stderr.startswith("recship_predict: error: "), (got.returncode, got.stderr[-3000:])


def test_recship_front_serves_forwards_reloads_and_stops_with_no_sanitizer_report(sanitized, artifacts, reports, tmp_path, monkeypatch):
    """The front under ASan/UBSan through a real server: native Predicts from several threads (batched), refusals
    forwarded to Python (an out-of-range id, bytes that are not UTF-8), another method, a deadline that passes,
    a hot reload to version 2 (the old version retired and freed), a second front refused its taken port, stop."""
    import recship.serving.front as front
    from recship.serving import PredictClient
    from recship.serving.server import Server, ServerConfig
    from recship.serving.v1 import predictor_pb2 as pb

    binary = sanitized / "recship_front"
    if not binary.is_file():
        pytest.skip("recship_front is not built here: gRPC C++ is missing (Debian: libgrpc++-dev protobuf-compiler-grpc)")
    monkeypatch.setattr(front, "build_front", lambda: binary)
    for key in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):  # the front inherits this process's environment
        monkeypatch.setenv(key, reports.env[key])
    repo = model_repo(tmp_path / "repo", {"dlrm": artifacts["dlrm"]})
    body = _body(artifacts["dlrm"], 1)
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=5, poll_interval_s=0.2, front="cpp"))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            want = client.predict("dlrm", body["sparse"], body["dense"])
            errors = []

            def clients():
                try:
                    for _ in range(10):  # batched with the others' calls: a GEMM of more rows may round its last bit
                        got = client.predict("dlrm", body["sparse"], body["dense"])  # otherwise (bitwise alone, below)
                        assert all(np.allclose(got[k], want[k], rtol=1e-6, atol=1e-7) for k in want)
                except Exception as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=clients) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            with pytest.raises(grpc.RpcError) as refused:
                client.predict("dlrm", {**body["sparse"], "cat_0": [[10_000]] * 5}, body["dense"])
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert client.list_models() == ["dlrm"]
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = channel.unary_unary("/recship.serving.v1.Predictor/Predict", request_serializer=None, response_deserializer=None)
                bad = pb.PredictRequest(model_name="dlrm", request_id="@@").SerializeToString().replace(b"@@", b"\xff\xfe")
                for _ in range(3):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(bad, timeout=10)
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.RpcError):
                    call(client.request("dlrm", body["sparse"], body["dense"]).SerializeToString(), timeout=0.0001)
            shutil.copytree(artifacts["dlrm"], repo / "dlrm" / "2")
            deadline = time.monotonic() + 60
            while server.front.stats()["models"] and {m["version"] for m in server.front.stats()["models"]} == {"1"}:
                client.predict("dlrm", body["sparse"], body["dense"])
                assert time.monotonic() < deadline, "version 2 was not served in 60 s"
            got = client.predict("dlrm", body["sparse"], body["dense"])
            assert all(np.array_equal(got[k], want[k]) for k in want)
        with pytest.raises(OSError, match="address already in use"):
            Server(ServerConfig(model_repo=str(repo), port=server.port, front="cpp"))
    finally:
        server.stop()
