"""The wheel built with its C++ parts (setup.py, RECSHIP_BUILD_CPP=1), installed into a fresh venv, used with no
source tree: ``recship_predict`` on PATH and ``recship serve --front cpp`` answer what the artifact answers
in-process here, bitwise; the installed headers and CMake config link a program (find_package(recship)).

The wheel is built from a copy of the files the Dockerfile's builder copies (plus cpp_loader/), with the C++ built
in this checkout's cached build/cpp_loader (RECSHIP_CPP_BUILD_DIR; the `binary` fixture's): seconds when it is
built already. The venv sees the dev venv's torch, fbgemm_gpu, grpc... through a .pth file (not the dev venv's
recship: its editable finder is a .pth file of that folder, which a path added by a .pth does not run).
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from recship.export.artifact import Manifest, open_artifact
from model_requests import dlrm_request, in_process, model_repo, request_file

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "protos", "recship", "sparse", "modules", "trainer", "quantize", "export",
           "models", "serving", "cpp_loader"]


def _missing_toolchain() -> str:
    """Why the C++ cannot be built here ('' where it can)."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        import nlohmann_json  # noqa: F401  (the C++ build reads its headers)
    except ImportError:
        return "nlohmann-json (the dev extra) is not installed"
    return ""




def _run(args, timeout=300, **kw):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, args))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    from recship.native import NativeError, find

    missing = _missing_toolchain()
    if missing:
        pytest.skip(f"the C++ build needs cmake, a C++17 compiler and nlohmann-json: {missing}")
    find("recship_predict")  # configures build/cpp_loader against this checkout (not the copy) where it is not yet
    try:  # where this checkout builds the front, the wheel must carry it (the Docker image's mode)
        find("recship_front")
        mode = "front"
    except NativeError:
        mode = "1"
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    env = {**os.environ, "RECSHIP_BUILD_CPP": mode, "RECSHIP_CPP_BUILD_DIR": str(ROOT / "build" / "cpp_loader"),
           "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", out, src], cwd=src, env=env, timeout=900)
    (built,) = out.glob("recship-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (--no-deps) and the dev venv's site-packages on its path."""
    root = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", root], timeout=120)
    python = root / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "dev_site_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", wheel], timeout=300)
    return root


def _env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RECSHIP_FBGEMM_DIR", "LD_LIBRARY_PATH")}
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}


def test_the_wheel_carries_the_cpp_parts_and_is_platform_tagged(wheel):
    assert not wheel.name.endswith("-none-any.whl"), f"{wheel.name}: a wheel with binaries must name its platform"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        scripts = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for needed in ("recship/_cpp/bin/recship_predict", "recship/_cpp/lib/librecship_loader.so", "recship/_cpp/include/recship/model.h",
                   "recship/_cpp/include/recship/serving_rules.h",  # (model.h includes it: generated, installed beside it)
                   "recship/_cpp/lib/cmake/recship/recshipConfig.cmake", "recship/_cpp/lib/cmake/recship/recshipTargets.cmake",
                   "recship/contract/manifest.schema.json",  # the contract's one definition, read at run time
                   "recship/native.py"):
        assert needed in names, f"{needed} is not in {wheel.name}"
    assert modes["recship/_cpp/bin/recship_predict"] & 0o111, "recship_predict is not executable in the wheel"
    assert "recship_predict = recship.native:predict_main" in scripts


def test_installed_recship_predict_on_path_equals_in_process_bitwise(venv, small_artifact, tmp_path):
    run_dir = tmp_path / "elsewhere"  # no source tree here or above it
    run_dir.mkdir()
    where = _run([venv / "bin" / "python", "-c", "import recship, recship.native as n; print(recship.__file__); print(n.find('recship_predict'))"],
                 cwd=run_dir, env=_env(venv)).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), f"not the venv's recship: {where}"
    assert shutil.which("recship_predict", path=_env(venv)["PATH"]) == str(venv / "bin" / "recship_predict")

    manifest = Manifest.read(small_artifact)
    sparse, dense = dlrm_request(5, 7)
    done = _run(["recship_predict", small_artifact, "--request", request_file(tmp_path / "r.json", sparse, dense)], cwd=run_dir, env=_env(venv))
    got = json.loads(done.stdout)
    want = in_process(open_artifact(small_artifact)[0], sparse, dense, names=manifest.feature_names)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k], dtype=np.float32).reshape(want[k].shape), want[k], err_msg=k)
    # the fbgemm op libraries come from $RECSHIP_FBGEMM_DIR (the wrapper sets it to the fbgemm_gpu Python imports)
    elsewhere = subprocess.run(["recship_predict", small_artifact], capture_output=True, text=True, cwd=run_dir, timeout=60,
                               env={**_env(venv), "RECSHIP_FBGEMM_DIR": str(tmp_path / "no-fbgemm")})
    assert elsewhere.returncode != 0 and f"it is not in {tmp_path / 'no-fbgemm'}" in elsewhere.stderr, elsewhere
    bad = subprocess.run(["recship_predict"], capture_output=True, text=True, cwd=run_dir, env=_env(venv), timeout=60)
    assert bad.returncode == 2 and "usage: recship_predict" in bad.stderr, bad  # the C++ tool's own usage and exit code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_exe(pid: int) -> list:
    """The executables of ``pid``'s child processes."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                out.append(os.readlink(f"/proc/{entry}/exe"))
        except (OSError, ValueError):
            continue
    return out


def test_installed_recship_serve_front_cpp_answers_as_in_process_bitwise(venv, small_artifact, tmp_path):
    from recship.serving import PredictClient
    from recship.serving.client import outputs_of

    front = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "recship" / "_cpp" / "bin" / "recship_front"
    if not front.is_file():
        pytest.skip("the wheel has no recship_front: gRPC C++ is not installed here (Debian: libgrpc++-dev protobuf-compiler-grpc)")
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    port = _free_port()
    server = subprocess.Popen([venv / "bin" / "recship", "serve", "--model-repo", repo, "--host", "127.0.0.1", "--port", str(port),
                               "--front", "cpp"],
                              cwd=run_dir, env=_env(venv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sparse, dense = dlrm_request(4, 11)
        model = open_artifact(repo / "dlrm" / "1", format="torchscript")[0]
        with PredictClient(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 180
            while True:
                assert server.poll() is None, f"recship serve exited ({server.returncode}): {server.stdout.read()[-3000:]}"
                try:
                    response = client.stub.Predict(PredictClient.request("dlrm", sparse, dense), timeout=5)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            got = outputs_of(response)
            want = in_process(model, sparse, dense)
            assert sorted(got) == sorted(want) == ["logit", "prob"]
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert str(front) in _children_exe(server.pid), f"the server's children run {_children_exe(server.pid)}, not {front}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_installed_cmake_config_links_a_program(venv, small_artifact, tmp_path):
    prefix = _run([venv / "bin" / "python", "-m", "recship.native", "cmake-prefix"], cwd=tmp_path, env=_env(venv)).stdout.strip()
    assert Path(prefix).is_relative_to(venv), prefix
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy2(ROOT / "cpp_loader" / "example" / "main.cpp", app / "main.cpp")
    (app / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.18)\nproject(app CXX)\nset(CMAKE_CXX_STANDARD 17)\n"
        "find_package(recship CONFIG REQUIRED)\nadd_executable(app main.cpp)\ntarget_link_libraries(app PRIVATE recship::loader)\n")
    _run(["cmake", "-S", app, "-B", app / "build", f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"], cwd=tmp_path)
    _run(["cmake", "--build", app / "build"], cwd=tmp_path)
    env = _run([venv / "bin" / "python", "-c", "import json, recship.native as n; print(json.dumps(n.runtime_env()))"],
               cwd=tmp_path, env=_env(venv)).stdout
    done = _run([app / "build" / "app", small_artifact], cwd=tmp_path, env=json.loads(env))
    want = np.fromfile(small_artifact / Manifest.read(small_artifact).sample.outputs["prob"].file, dtype="<f4")[0]
    assert f"prob[0] = {want:.6g}" in done.stdout


def test_without_packaged_binaries_nor_a_source_checkout_find_says_how_to_get_them(tmp_path, monkeypatch):
    import recship.native as native

    monkeypatch.setattr(native, "PACKAGED", tmp_path / "site-packages" / "recship" / "_cpp")
    monkeypatch.setattr(native, "SOURCE_BUILD_SCRIPT", tmp_path / "site-packages" / "cpp_loader" / "build.py")
    with pytest.raises(native.NativeError, match="built without RECSHIP_BUILD_CPP.*RECSHIP_BUILD_CPP=1"):
        native.find("recship_predict")
    (native.PACKAGED / "bin").mkdir(parents=True)  # packaged, but without the front (no gRPC C++ at build time)
    (native.PACKAGED / "bin" / "recship_predict").write_bytes(b"")
    assert native.find("recship_predict") == native.PACKAGED / "bin" / "recship_predict"
    with pytest.raises(native.NativeError, match="recship_front is not in this installation.*without gRPC C\\+\\+"):
        native.find("recship_front")
    with pytest.raises(ValueError, match="unknown C\\+\\+ tool 'recship_load'"):
        native.find("recship_load")
    with pytest.raises(native.NativeError, match="not installed with recship"):
        native.cmake_prefix()


def test_runtime_env_puts_the_imported_torch_first_and_names_fbgemm(monkeypatch):
    import fbgemm_gpu
    import torch

    from recship.native import runtime_env

    env = runtime_env({"LD_LIBRARY_PATH": "/x/lib", "PATH": "/bin"})
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [str(Path(torch.__file__).parent / "lib"), "/x/lib"]
    assert env["RECSHIP_FBGEMM_DIR"] == str(Path(fbgemm_gpu.__file__).parent)
    assert env["PATH"] == "/bin"
    assert runtime_env({"RECSHIP_FBGEMM_DIR": "/mine"})["RECSHIP_FBGEMM_DIR"] == "/mine"
