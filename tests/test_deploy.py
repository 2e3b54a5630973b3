"""The deployment kit (deploy/): the manifests and the Dockerfile against the real server.

- every manifest parses and has its kind and apiVersion;
- the arguments each one passes to `recship serve` (the Dockerfile's ENTRYPOINT + CMD, the containers'
  args) go through recship's own argument parser, so a misspelt or removed flag fails here;
- a server is started with each set of arguments (ports 0, localhost) and every probe, healthcheck and
  metrics path of the manifest is fetched from the listener its port names: each must answer 200;
- declared container ports, EXPOSE, Service targets and annotations must equal the ports in the args;
- the Dockerfile's builder steps run here (its COPY lines into a clean folder, its `pip wheel`), the
  wheel must hold the generated gRPC stubs and the `recship` console script, and installs with --no-deps.
`docker build` itself is not run (no daemon in CI).
"""

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import yaml

from recship.serving.cli import add_arguments, config_from_args
from recship.serving.server import Server

from model_requests import model_repo

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
KINDS = {
    "kserve/servingruntime.yaml": [("serving.kserve.io/v1alpha1", "ServingRuntime")],
    "kserve/inferenceservice.yaml": [("serving.kserve.io/v1beta1", "InferenceService")],
    "k8s/deployment.yaml": [("apps/v1", "Deployment")],
    "k8s/service.yaml": [("v1", "Service")],
}
KSERVE_MODEL_MOUNT = "/mnt/models"  # where KServe's storage initializer puts the storageUri


# ---------------------------------------------------------------- helpers


def manifest(rel: str) -> List[Dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / rel).read_text()) if doc is not None]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise argparse's message instead of printing it and exiting
        raise ValueError(message)


def serve_args(argv: List[str], where: str) -> argparse.Namespace:
    """``argv`` (the words after ``recship serve``) parsed by the server's real parser."""
    parser = _Parser(prog="recship serve")
    add_arguments(parser)
    try:
        return parser.parse_args([str(a) for a in argv])
    except ValueError as e:
        pytest.fail(f"{where}: `recship serve {' '.join(map(str, argv))}` does not parse: {e}")


def listeners(args: argparse.Namespace) -> Dict[int, str]:
    """port -> which listener the args put there (grpc, rest, metrics)."""
    out = {args.port: "grpc"}
    for port, name in ((args.http_port, "rest"), (args.metrics_port, "metrics")):
        if port is not None:
            assert port not in out, f"port {port} given to two listeners"
            out[port] = name
    return out


def http_get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class Running:
    """A server started from a manifest's args, with its ports moved to 0 and its host to localhost."""

    def __init__(self, args: argparse.Namespace, repo: Path) -> None:
        self.args = args
        self.server = Server(dataclasses.replace(  # the mapping recship.serving.cli.run uses
            config_from_args(args), model_repo=str(repo), host="127.0.0.1", port=0,
            metrics_port=None if args.metrics_port is None else 0, metrics_host=None,
            http_port=None if args.http_port is None else 0,
        ))

    def real_port(self, port: int) -> int:
        """The port the test server really listens on for the manifest's ``port``."""
        kind = listeners(self.args).get(port)
        assert kind is not None, f"port {port} is none of the server's listeners {listeners(self.args)}"
        return {"grpc": lambda: self.server.port, "rest": lambda: self.server.rest.port,
                "metrics": lambda: self.server.metrics.port}[kind]()

    def assert_http(self, port: int, path: str, where: str) -> None:
        kind = listeners(self.args).get(port)
        assert kind in ("rest", "metrics"), f"{where}: HTTP on port {port}, which is the {kind or 'no'} listener"
        status = http_get(self.real_port(port), path)
        assert status == 200, f"{where}: GET {path} on the {kind} port answered {status}"

    def assert_grpc_health(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.server.port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self.server.stop(grace=0)


@pytest.fixture(scope="module")
def repo(small_artifact, tmp_path_factory):
    """A model repository as the manifests expect it: <model>/<version>/."""
    return model_repo(tmp_path_factory.mktemp("deploy-repo"), {"dlrm": small_artifact})


@pytest.fixture
def running(repo):
    started: List[Running] = []

    def start(args: argparse.Namespace) -> Running:
        r = Running(args, repo)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def probes(container: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    return [(name, container[name]) for name in ("startupProbe", "livenessProbe", "readinessProbe") if name in container]


def container_port(container: Dict[str, Any], port: Any) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"port {port!r} names none of the container's ports {named}"
    return named[port]


# ---------------------------------------------------------------- the Dockerfile, parsed


class Dockerfile:
    """Instructions of deploy/Dockerfile as (stage, INSTRUCTION, rest), continuations joined, ARG defaults known."""

    def __init__(self, path: Path) -> None:
        self.instructions: List[Tuple[str, str, str]] = []
        self.args: Dict[str, str] = {}
        self.stage_base: Dict[str, str] = {}
        lines, buf = [], ""
        for raw in path.read_text().splitlines():
            s = raw.strip()
            if not s or s.startswith("#"):  # (Docker drops comment lines inside continuations too)
                continue
            if s.endswith("\\"):
                buf += s[:-1] + " "
                continue
            lines.append(buf + s)
            buf = ""
        assert not buf, "the Dockerfile ends inside a continuation"
        stage = ""
        for line in lines:
            word, _, rest = line.partition(" ")
            word, rest = word.upper(), rest.strip()
            if word == "ARG":
                name, _, default = rest.partition("=")
                self.args.setdefault(name, default)
            if word == "FROM":
                m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
                assert m, f"FROM {rest}"
                stage = m.group(2) or str(len(self.stage_base))
                self.stage_base[stage] = self.expand(m.group(1))
            self.instructions.append((stage, word, rest))

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.args.get(m.group(1), m.group(0)), text)

    def get(self, word: str, stage: Optional[str] = None) -> List[str]:
        return [rest for st, w, rest in self.instructions if w == word and (stage is None or st == stage)]

    def exec_form(self, word: str) -> List[str]:
        (rest,) = self.get(word)[-1:]  # the last one counts
        value = json.loads(rest)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{word} must be the JSON (exec) form"
        return value

    @property
    def final_stage(self) -> str:
        return list(self.stage_base)[-1]


DOCKERFILE = Dockerfile(DEPLOY / "Dockerfile")


def image_args() -> argparse.Namespace:
    entrypoint, cmd = DOCKERFILE.exec_form("ENTRYPOINT"), DOCKERFILE.exec_form("CMD")
    assert entrypoint == ["recship", "serve"], entrypoint
    # the `recship` console script's own parser, with the subcommand, as the container runs it
    from recship.cli import build_parser

    try:
        build_parser("serve").parse_args(entrypoint[1:] + cmd)
    except SystemExit:
        pytest.fail(f"ENTRYPOINT + CMD do not parse: {entrypoint + cmd}")
    return serve_args(cmd, "Dockerfile CMD")


# ---------------------------------------------------------------- manifests


@pytest.mark.parametrize("rel", sorted(KINDS))
def test_manifest_parses_with_its_kind(rel):
    docs = manifest(rel)
    assert [(d.get("apiVersion"), d.get("kind")) for d in docs] == KINDS[rel]
    for d in docs:
        assert d["metadata"]["name"], f"{rel}: no metadata.name"


def test_every_yaml_file_is_covered():
    assert sorted(str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.yaml")) == sorted(KINDS)


def test_servingruntime_args_probes_and_ports_against_a_running_server(running):
    (runtime,) = manifest("kserve/servingruntime.yaml")
    spec = runtime["spec"]
    assert {"name": "recship"}.items() <= spec["supportedModelFormats"][0].items()
    # it advertises only what the port it declares speaks: REST (KServe routes to that one port)
    assert spec["protocolVersions"] == ["v2"]
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container"
    assert "command" not in container, "the image's ENTRYPOINT (recship serve) runs: only args are given"
    args = serve_args(container["args"], "ServingRuntime args")
    assert args.model_repo == KSERVE_MODEL_MOUNT, "KServe mounts the storageUri at /mnt/models"
    assert args.host == "0.0.0.0"
    assert args.http_port is not None and args.metrics_port is not None

    # Knative routes to one declared port and rewrites HTTP probes to it: it must be the REST one
    (declared,) = container["ports"]
    assert declared["name"] == "http1" and declared["containerPort"] == args.http_port, declared
    server = running(args)
    seen = set()
    for name, probe in probes(container):
        get = probe["httpGet"]
        assert container_port(container, get["port"]) == declared["containerPort"], f"{name}: probe port != the declared port"
        server.assert_http(container_port(container, get["port"]), get["path"], f"ServingRuntime {name}")
        seen.add((name, get["path"]))
    assert {("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")} <= seen
    notes = spec["annotations"]
    assert int(notes["prometheus.kserve.io/port"]) == args.metrics_port
    server.assert_http(args.metrics_port, notes["prometheus.kserve.io/path"], "ServingRuntime prometheus annotation")
    server.assert_grpc_health()  # and the gRPC port the args name answers inside the pod
    assert container["securityContext"]["runAsNonRoot"] is True


def test_inferenceservice_uses_the_runtime():
    (runtime,) = manifest("kserve/servingruntime.yaml")
    (container,) = runtime["spec"]["containers"]
    args = serve_args(container["args"], "ServingRuntime args")
    for isvc in manifest("kserve/inferenceservice.yaml"):
        model = isvc["spec"]["predictor"]["model"]
        assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
        assert model.get("runtime", runtime["metadata"]["name"]) == runtime["metadata"]["name"]
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
        assert model["storageUri"]
        for port in model.get("ports", []):  # an override must still point at a listener of the args
            want = {"h2c": args.port, "http1": args.http_port}[port["name"]]
            assert port["containerPort"] == want, port


def test_deployment_and_service_against_a_running_server(running):
    (deployment,) = manifest("k8s/deployment.yaml")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert "command" not in container, "the image's ENTRYPOINT (recship serve) runs: only args are given"
    args = serve_args(container["args"], "Deployment args")
    assert args.host == "0.0.0.0"
    declared = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert declared == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert args.model_repo in mounts, f"--model-repo {args.model_repo} is not a mounted volume {mounts}"
    assert mounts[args.model_repo] in {v["name"] for v in pod["spec"]["volumes"]}
    security = {**pod["spec"].get("securityContext", {}), **container.get("securityContext", {})}
    assert security["runAsNonRoot"] is True and security["runAsUser"] == image_uid()
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]

    server = running(args)
    seen = set()
    for name, probe in probes(container):
        get = probe["httpGet"]
        server.assert_http(container_port(container, get["port"]), get["path"], f"Deployment {name}")
        seen.add((name, get["path"]))
    assert {("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")} <= seen
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == args.metrics_port
    server.assert_http(args.metrics_port, notes["prometheus.io/path"], "Deployment prometheus annotation")
    server.assert_grpc_health()

    (service,) = manifest("k8s/service.yaml")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), "the Service selects no pod"
    targets = {container_port(container, p["targetPort"]) for p in service["spec"]["ports"]}
    assert {args.port, args.http_port} <= targets <= set(listeners(args)), targets


# ---------------------------------------------------------------- Dockerfile


def image_uid() -> int:
    users = DOCKERFILE.get("USER", DOCKERFILE.final_stage)
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user.isdigit(), f"USER {user}: a numeric UID, so that Kubernetes' runAsNonRoot can check it"
    return int(user)


def test_dockerfile_runs_serve_as_non_root_with_matching_ports(running):
    stage = DOCKERFILE.final_stage
    # one Debian release for both: the runtime installs the gRPC C++ libraries the builder's recship_front linked
    assert DOCKERFILE.stage_base == {"builder": "python:3.11-slim-bookworm", "runtime": "python:3.11-slim-bookworm"}
    words = [w for st, w, _ in DOCKERFILE.instructions if st == stage]
    assert "USER" in words and words.index("USER") < words.index("ENTRYPOINT"), "USER must come before ENTRYPOINT"
    uid = image_uid()
    assert uid != 0
    assert any(f"--uid {uid}" in run for run in DOCKERFILE.get("RUN", stage)), f"no user created with UID {uid}"

    args = image_args()
    assert args.host == "0.0.0.0"
    assert DOCKERFILE.get("VOLUME", stage) == [args.model_repo]
    exposed = {int(p.split("/")[0]) for rest in DOCKERFILE.get("EXPOSE", stage) for p in rest.split()}
    assert exposed == set(listeners(args)), f"EXPOSE {exposed} vs the CMD's ports {listeners(args)}"

    # the HEALTHCHECK's own command, run against a server started from the CMD's args
    (health,) = DOCKERFILE.get("HEALTHCHECK", stage)
    command = json.loads(health[health.index("CMD") + 3:].strip())
    assert command[0] == "python", command
    (url,) = re.findall(r"http://[^'\"\s]+", " ".join(command))
    port, path = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/\S*)", url).groups()
    assert int(port) == args.http_port, f"HEALTHCHECK port {port}, CMD --http-port {args.http_port}"
    assert path == "/v2/health/ready"
    server = running(args)
    live = [c.replace(url, f"http://127.0.0.1:{server.server.rest.port}{path}") for c in command]
    done = subprocess.run([sys.executable] + live[1:], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"HEALTHCHECK failed on a ready server: {done.stderr[-2000:]}"
    server.assert_http(args.metrics_port, "/metrics", "Dockerfile metrics port")
    server.assert_grpc_health()

    # and the same command fails on a server that is not ready (no model): a HEALTHCHECK that cannot fail is no check
    server.server.inference.accepting = False
    done = subprocess.run([sys.executable] + live[1:], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, "HEALTHCHECK passed on a server that answers 503"
    server.server.inference.accepting = True


def test_dockerfile_pins_match_pyproject():
    runs = " ".join(DOCKERFILE.get("RUN"))
    # the builder installs the build requirements itself (its wheel builds without build isolation)
    build_requires = PYPROJECT["build-system"]["requires"]
    (builder_install,) = [r for r in DOCKERFILE.get("RUN", "builder") if r.startswith("pip install") and "setuptools==" in r]
    assert sorted(shlex.split(builder_install)[3:]) == sorted(build_requires)
    # the C++ build's own (RECSHIP_BUILD_CPP): nlohmann-json at pyproject's pin (fbgemm_gpu is opened at run time)
    builder_runs = " ".join(DOCKERFILE.get("RUN", "builder"))
    extras = PYPROJECT["project"]["optional-dependencies"]
    for pin in [d for d in extras["dev"] if d.startswith("nlohmann-json==")]:
        assert pin in builder_runs.split(), f"the builder does not install {pin}"
    assert not [pin for pin in extras["cpu"] + extras["gpu"] if pin in builder_runs.split()], "the C++ build needs no fbgemm_gpu"
    # torch comes from TORCH_INDEX_URL (CPU or CUDA build) at the version pyproject pins
    (torch_pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch==")]
    assert f"--index-url ${{TORCH_INDEX_URL}} {torch_pin}" in runs
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert DOCKERFILE.args["EXTRA"] == "cpu" and {"cpu", "gpu"} <= set(extras)
    assert "recship-*.whl)[${EXTRA}]" in runs


def test_dockerfile_builds_the_wheel_and_it_installs(tmp_path):
    """The builder stage's COPY and RUN lines, run here: a clean source folder, the wheel, a --no-deps install."""
    src, wheels, site = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    workdir = (DOCKERFILE.get("WORKDIR", "builder") or ["/"])[-1]
    src.mkdir()
    for rest in DOCKERFILE.get("COPY", "builder"):
        *sources, dest = shlex.split(rest)
        assert not any(s.startswith("--") for s in sources), rest
        target = src / Path(dest).relative_to(workdir) if dest.startswith("/") else src / dest
        for s in sources:
            origin = ROOT / s
            assert origin.exists(), f"COPY {s}: not in the repository"
            if origin.is_dir():
                shutil.copytree(origin, target if len(sources) == 1 else target / origin.name, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target / origin.name)
    # a clean checkout has no generated stubs: the build must make them
    for generated in (src / "serving" / "v1").glob("*"):
        if generated.name != "__init__.py":
            generated.unlink()

    for rest in DOCKERFILE.get("RUN", "builder"):
        words = shlex.split(rest)
        if words[0] == "apt-get":  # the C++ build's system packages (cmake, g++, gRPC C++): not installed by this test
            continue
        if words[:2] == ["pip", "install"]:  # the build requirements: here they must already be installed (offline)
            for requirement, before in zip(words[2:], words[1:]):
                if requirement.startswith("-") or before == "--index-url":
                    continue
                name, _, version = requirement.partition("==")
                try:
                    installed = metadata.version(name)
                except metadata.PackageNotFoundError:
                    pytest.skip(f"{name} is not installed here, and installing it needs the network")
                assert installed.split("+")[0] == version, f"{name}: {installed} installed, the Dockerfile pins {version}"
        elif words[:2] == ["pip", "wheel"]:
            command = [sys.executable, "-m", "pip"] + [str(wheels) if w == "/wheels" else w for w in words[1:]]
            assert "--no-build-isolation" in command, "build isolation would download the build requirements"
            # without the C++ parts (RECSHIP_BUILD_CPP=0): tests/test_wheel.py builds those, from a clean copy
            done = subprocess.run(command, cwd=src, capture_output=True, text=True, timeout=240,
                                  env={**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                                       "RECSHIP_BUILD_CPP": "0"})
            assert done.returncode == 0, f"{rest}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        else:
            pytest.fail(f"the builder stage runs a step this test does not know: RUN {rest}")

    (wheel,) = wheels.glob("recship-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for needed in ("recship/__init__.py", "recship/cli.py", "recship/serving/cli.py", "recship/serving/server.py", "recship/serving/rest.py",
                       "recship/serving/v1/predictor_pb2.py", "recship/serving/v1/predictor_pb2_grpc.py",
                       "recship/serving/v1/kserve_descriptor.py", "recship/serving/v1/serving_rules.py"):
            assert needed in names, f"{needed} is not in {wheel.name}"
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert re.search(r"^recship\s*=\s*recship\.cli:main$", z.read(info).decode(), re.MULTILINE)
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        assert {"cpu", "gpu"} <= set(re.findall(r"^Provides-Extra: (\S+)$", meta, re.MULTILINE))

    # the runtime stage installs this wheel; here without its dependencies (torch would need the network)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for needed in ("recship/__init__.py", "recship/serving/v1/predictor_pb2.py", "recship/serving/v1/kserve_descriptor.py"):
        assert (site / needed).is_file(), needed
    # the installed package's CLI (not this checkout's) parses the image's ENTRYPOINT + CMD
    check = ("import sys, recship, recship.serving.v1.predictor_pb2 as pb; from recship.cli import build_parser; "
             "assert recship.__file__.startswith(sys.argv[1]) and pb.__file__.startswith(sys.argv[1]), recship.__file__; "
             "build_parser('serve').parse_args(sys.argv[2:])")
    argv = DOCKERFILE.exec_form("ENTRYPOINT")[1:] + DOCKERFILE.exec_form("CMD")
    done = subprocess.run([sys.executable, "-c", check, str(site)] + argv, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)})
    assert done.returncode == 0, done.stderr[-3000:]
