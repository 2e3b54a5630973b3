"""recship as a package index takes it and a user installs it. A clean copy of this checkout (its tracked and
untracked-but-not-ignored files) is built exactly as ``make wheel`` builds it (cpp_loader/make_wheel.py: ``python -m build``
with build isolation, the sdist and then the wheel from that sdist, then ``auditwheel repair``). The wheel must be
manylinux-tagged with torch's libraries its only external ones, every RUNPATH relative to ``$ORIGIN``, and no file
naming a folder of the build. Each of the two is installed into a fresh venv in a folder with no source tree (the
wheel as is, the sdist built by pip), where the README's quick start runs word for word; from the wheel's venv
``recship_predict`` and ``recship serve --front cpp`` answer what the artifact answers in-process here, bitwise, and
the installed headers and CMake config link a program.
"""

import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from recship.export.artifact import Manifest, open_artifact
from model_requests import dlrm_request, in_process, model_repo, request_file
from quick_start import free_port, run_quick_start

ROOT = Path(__file__).resolve().parents[1]
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
# torch's libraries: the only ones the repaired wheel may leave to the machine (cpp_loader/make_wheel.py's EXCLUDE)
TORCH_LIBS = ("libtorch*.so", "libc10*.so")


def _missing_toolchain() -> str:
    """Why the wheel cannot be built here ('' where it can)."""
    for tool in ("cmake", "c++", "git"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    for module in ("build", "auditwheel"):
        if importlib.util.find_spec(module) is None:
            return f"{module} (the dev extra) is not installed"
    if not (ROOT / ".git").exists():
        return "not a git checkout (the clean copy is its files)"
    return ""


def _run(args, timeout=300, **kw):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, args))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _cpp_mode() -> str:
    """front where this machine has gRPC C++ (the wheel must then carry recship_front), else 1."""
    return "front" if shutil.which("grpc_cpp_plugin") and shutil.which("protoc") else "1"


def _extra() -> str:
    """The fbgemm extra this machine's dev venv has (cpu or gpu)."""
    try:
        importlib.metadata.version("fbgemm-gpu-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "gpu"


@dataclass
class Dists:
    source: Path  # the clean copy they were built from
    tmp: Path  # TMPDIR of the build (its isolated environments and the sdist's unpacked copy)
    sdist: Path
    wheel: Path  # repaired
    log: str


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> Dists:
    missing = _missing_toolchain()
    if missing:
        pytest.skip(f"building the wheel needs cmake, a C++17 compiler, git and the dev extra: {missing}")
    base = tmp_path_factory.mktemp("wheel")
    source, out, tmp = base / "src", base / "dist", base / "tmp"
    tmp.mkdir()
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():  # (a tracked file deleted in the work tree is not part of the copy)
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    env = {**os.environ, "TMPDIR": str(tmp), "RECSHIP_BUILD_CPP": _cpp_mode()}
    env.pop("RECSHIP_CPP_BUILD_DIR", None)
    done = _run([sys.executable, source / "cpp_loader" / "make_wheel.py", "--outdir", out], cwd=source, env=env, timeout=1800)
    sdist, wheel = (Path(line) for line in done.stdout.strip().splitlines()[-2:])
    return Dists(source, tmp, sdist, wheel, done.stdout)


def _fresh_venv(root: Path, requirement: str) -> Path:
    """A new venv at ``root`` with ``requirement`` installed by pip, dependencies and all."""
    _run([sys.executable, "-m", "venv", root], timeout=120)
    env = {**_env(root), "RECSHIP_BUILD_CPP": _cpp_mode()}  # (the sdist's build)
    _run([root / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check", requirement], cwd=root.parent,
         env=env, timeout=1800)
    return root


@pytest.fixture(scope="module")
def venv(dists, tmp_path_factory) -> Path:
    return _fresh_venv(tmp_path_factory.mktemp("venv") / "v", f"{dists.wheel}[{_extra()}]")


@pytest.fixture(scope="module")
def sdist_venv(dists, tmp_path_factory) -> Path:
    return _fresh_venv(tmp_path_factory.mktemp("sdist-venv") / "v", f"{dists.sdist}[{_extra()}]")


def _env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RECSHIP_FBGEMM_DIR", "LD_LIBRARY_PATH")}
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}


def _site(venv: Path) -> Path:
    return venv / "lib" / PY / "site-packages"


def test_the_wheel_is_manylinux_with_torch_its_only_external_libraries(dists):
    assert "-manylinux_2_" in dists.wheel.name and dists.wheel.name.endswith("_x86_64.whl"), dists.wheel.name
    assert "cmake --build" in dists.log and "Built target recship_predict" in dists.log, "the build showed no cmake progress"
    shown = json.loads(_run([sys.executable, "-m", "auditwheel", "show", "--json", dists.wheel]).stdout)
    assert shown["sym_tag"].startswith("manylinux_2_"), shown["sym_tag"]
    assert dists.wheel.name.split("-")[-1] == f"{shown['sym_tag']}.whl"  # tagged by the glibc symbols it uses, no older
    external = sorted(shown["external_libs"])
    assert external and all(any(fnmatch.fnmatch(lib, p) for p in TORCH_LIBS) for lib in external), external


def test_the_wheel_carries_the_cpp_parts_with_relative_runpaths_and_no_build_path(dists, tmp_path):
    with zipfile.ZipFile(dists.wheel) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        scripts = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        z.extractall(tmp_path)
    tools = ["recship_predict"] + (["recship_front", "recship_load"] if _cpp_mode() == "front" else [])
    for needed in [f"recship/_cpp/bin/{t}" for t in tools] + [
            "recship/_cpp/lib/librecship_loader.so", "recship/_cpp/include/recship/model.h",
            "recship/_cpp/include/recship/serving_rules.h",  # (model.h includes it: generated, installed beside it)
            "recship/_cpp/lib/cmake/recship/recshipConfig.cmake", "recship/_cpp/lib/cmake/recship/recshipTargets.cmake",
            "recship/contract/manifest.schema.json",  # the contract's one definition, read at run time
            "recship/quantize/kernels/rowwise.c",  # compiled at first use
            "recship/serving/v1/predictor_pb2.py",  # generated by the build
            "recship/native.py"]:
        assert needed in names, f"{needed} is not in {dists.wheel.name}"
    for tool in tools:
        assert modes[f"recship/_cpp/bin/{tool}"] & 0o111, f"{tool} is not executable in the wheel"
    assert "recship_predict = recship.native:predict_main" in scripts
    # where the build ran (its copy, its isolated environments, this checkout and venv): named by no file
    build_paths = [str(dists.source), str(dists.tmp), str(ROOT), sys.prefix]
    elves = 0
    for path in sorted(p for p in tmp_path.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for found in build_paths:
            assert found.encode() not in data, f"{path.relative_to(tmp_path)} names the build's folder {found}"
        if data[:4] == b"\x7fELF":
            elves += 1
            dynamic = _run(["readelf", "-d", path]).stdout
            for line in dynamic.splitlines():
                if "(RUNPATH)" in line or "(RPATH)" in line:
                    entries = line.split("[", 1)[1].rstrip("]").split(":")
                    assert all(e.startswith("$ORIGIN") for e in entries), f"{path.relative_to(tmp_path)}: {line.strip()}"
    assert elves >= len(tools) + 1


def test_the_sdist_carries_the_sources_and_builds_the_same_wheel(dists, sdist_venv):
    with tarfile.open(dists.sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for needed in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "cpp_loader/CMakeLists.txt",
                   "cpp_loader/backend/build_backend.py", "cpp_loader/src/model.cpp", "cpp_loader/tools/front/server.cpp",
                   "protos/recship/serving/v1/predictor.proto", "recship/contract/manifest.schema.json", "serving/codegen.py",
                   "quantize/kernels/rowwise.c"):
        assert needed in names, f"{needed} is not in {dists.sdist.name}"
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    with zipfile.ZipFile(dists.wheel) as z:
        from_wheel = {n for n in z.namelist() if n.startswith("recship/") and not n.endswith("/")}  # (auditwheel adds folders)
    record = next(_site(sdist_venv).glob("recship-*.dist-info")) / "RECORD"
    from_sdist = {line.split(",")[0] for line in record.read_text().splitlines()}
    from_sdist = {n for n in from_sdist if n.startswith("recship/") and not n.endswith(".pyc")}
    assert from_sdist == from_wheel, (sorted(from_sdist - from_wheel), sorted(from_wheel - from_sdist))


@pytest.mark.parametrize("install", ["wheel", "sdist"])
def test_readme_quick_start_runs_from_a_fresh_install(install, request, tmp_path):
    venv = request.getfixturevalue("venv" if install == "wheel" else "sdist_venv")
    here = tmp_path / "empty"  # no source tree here or above it
    here.mkdir()
    where = _run([venv / "bin" / "python", "-c", "import recship; print(recship.__file__)"], cwd=here, env=_env(venv)).stdout
    assert Path(where.strip()).is_relative_to(venv), f"not the venv's recship: {where}"
    run_quick_start(venv / "bin", here, _env(venv))


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
    # the binary itself, without the wrapper's LD_LIBRARY_PATH and RECSHIP_FBGEMM_DIR (as a production program runs it):
    # torch by its RUNPATH, fbgemm_gpu beside the wheel's recship/
    direct = _run([_site(venv) / "recship" / "_cpp" / "bin" / "recship_predict", small_artifact, "--request", tmp_path / "r.json"],
                  cwd=run_dir, env=_env(venv))
    assert json.loads(direct.stdout) == got
    # the fbgemm op libraries come from $RECSHIP_FBGEMM_DIR (the wrapper sets it to the fbgemm_gpu Python imports)
    elsewhere = subprocess.run(["recship_predict", small_artifact], capture_output=True, text=True, cwd=run_dir, timeout=60,
                               env={**_env(venv), "RECSHIP_FBGEMM_DIR": str(tmp_path / "no-fbgemm")})
    assert elsewhere.returncode != 0 and f"it is not in {tmp_path / 'no-fbgemm'}" in elsewhere.stderr, elsewhere
    bad = subprocess.run(["recship_predict"], capture_output=True, text=True, cwd=run_dir, env=_env(venv), timeout=60)
    assert bad.returncode == 2 and "usage: recship_predict" in bad.stderr, bad  # the C++ tool's own usage and exit code


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

    front = _site(venv) / "recship" / "_cpp" / "bin" / "recship_front"
    if not front.is_file():
        pytest.skip("the wheel has no recship_front: gRPC C++ is not installed here (Debian: libgrpc++-dev protobuf-compiler-grpc)")
    repo = model_repo(tmp_path / "repo", {"dlrm": small_artifact})
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    port = free_port()
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
    with pytest.raises(native.NativeError, match="built with RECSHIP_BUILD_CPP=0.*make wheel"):
        native.find("recship_predict")
    (native.PACKAGED / "bin").mkdir(parents=True)  # packaged, but without the front (no gRPC C++ at build time)
    (native.PACKAGED / "bin" / "recship_predict").write_bytes(b"")
    assert native.find("recship_predict") == native.PACKAGED / "bin" / "recship_predict"
    with pytest.raises(native.NativeError, match="recship_front is not in this installation.*without gRPC C\\+\\+"):
        native.find("recship_front")
    with pytest.raises(ValueError, match="unknown C\\+\\+ tool 'recship_nope': one of recship_predict, recship_front, recship_load"):
        native.find("recship_nope")
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
