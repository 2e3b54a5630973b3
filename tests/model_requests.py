"""Requests to an exported model, and the reference answer to them: the artifact's model run in this process.

Shared by the export, serving and C++ loader tests (every folder imports it: tests/ is on sys.path). A request is
(sparse, dense, weights) as ``PredictClient.predict`` and recship_predict's JSON take them:
sparse {feature: [[ids of example 0], [ids of example 1], ...]}, dense [B, D] float32 (None for a model without
dense inputs), weights {feature: [[a weight per id of example 0], ...]} for weighted features (None for none).
"""

import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from recship.export.artifact import Manifest, aoti_runs_here, read_sample

Sparse = Dict[str, List[List[int]]]
Weights = Dict[str, List[List[float]]]
Request = Tuple[Sparse, Optional[np.ndarray], Optional[Weights]]
Seed = Union[int, np.random.Generator]  # a seed, or a generator to go on drawing from (several requests of one stream)

SMALL_ROWS = [20 + i for i in range(26)]  # table sizes of the small DLRM's features cat_0..cat_25 (tests/conftest.py)
NUM_DENSE = 13  # the DLRM's dense width


@dataclass(frozen=True)
class ModelInputs:
    """What a model's requests hold: each sparse feature's table rows, in the model's feature order; the dense width;
    the features that take a weight per id; the features whose ids the model hashes (modulo) instead of refusing."""

    rows: Dict[str, int]
    num_dense: int
    weighted: FrozenSet[str] = frozenset()
    modulo: FrozenSet[str] = frozenset()

    @staticmethod
    def of(manifest: Manifest) -> "ModelInputs":
        features = manifest.sparse_features
        return ModelInputs({f.name: f.rows for f in features}, manifest.num_dense,
                           frozenset(f.name for f in features if f.weighted),
                           frozenset(f.name for f in features if f.id_policy == "modulo"))

    @staticmethod
    def dlrm(rows: Sequence[int] = SMALL_ROWS, num_dense: int = NUM_DENSE) -> "ModelInputs":
        """recship's DLRM: unweighted features cat_0 .. cat_<n-1> of ``rows`` rows each."""
        return ModelInputs({f"cat_{i}": r for i, r in enumerate(rows)}, num_dense)


def random_request(inputs: ModelInputs, batch: int, seed: Seed, ids: Tuple[int, int] = (0, 3), past_modulo: int = 1,
                   dense_dtype: type = np.float32) -> Request:
    """A valid request of ``batch`` examples: for each example and feature, from ids[0] to ids[1] ids inside the
    feature's table (a modulo feature's up to ``past_modulo`` times its rows: the model hashes them), a weight in
    [0, 1) per id of a weighted feature, dense values in [0, 1) (drawn as ``dense_dtype``; the model takes float32).
    Drawn in that order: sparse, weights, dense."""
    g = np.random.default_rng(seed)  # a Generator comes back as it is
    low, high = ids
    sparse = {name: [g.integers(0, rows * (past_modulo if name in inputs.modulo else 1), size=g.integers(low, high + 1)).tolist()
                     for _ in range(batch)] for name, rows in inputs.rows.items()}
    weights = {name: [g.random(len(r), dtype=np.float32).tolist() for r in sparse[name]]
               for name in inputs.rows if name in inputs.weighted} or None
    dense = g.random((batch, inputs.num_dense), dtype=dense_dtype) if inputs.num_dense else None
    return sparse, dense, weights


def dlrm_request(batch: int, seed: Seed, rows: Sequence[int] = SMALL_ROWS, ids: Tuple[int, int] = (0, 3)) -> Tuple[Sparse, np.ndarray]:
    """(sparse, dense [batch, 13]) of ``random_request`` for a DLRM whose features have ``rows`` rows."""
    sparse, dense, _ = random_request(ModelInputs.dlrm(rows), batch, seed, ids)
    return sparse, dense


def sample_request(artifact: Path) -> Tuple[Sparse, np.ndarray]:
    """The artifact's recorded sample (sample/) as a request: (sparse, dense [B, D])."""
    manifest = Manifest.read(artifact)
    inputs, _ = read_sample(artifact, manifest)
    b = manifest.sample.batch_size
    lengths = inputs["lengths"].view(len(manifest.sparse_features), b).tolist()
    values, sparse, at = inputs["values"].tolist(), {}, 0
    for f, row in zip(manifest.sparse_features, lengths):
        sparse[f.name] = []
        for n in row:
            sparse[f.name].append(values[at: at + n])
            at += n
    return sparse, inputs["dense"].numpy()


def in_process(model: Any, sparse: Sparse, dense: Any = None, weights: Optional[Weights] = None,
               names: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
    """{output: array} of ``model`` (an artifact's, as open_artifact returns it) run here on a request.

    What the model takes: dense [B, D] float32 (D = 0 for None), lengths [F * B] int32 and values [N] int64
    feature-major in ``names`` order (default: the request's), and with ``weights`` a weight per id [N] float32,
    1 for the ids of a feature that has none (the model ignores those).
    """
    names = list(sparse) if names is None else list(names)
    lengths = torch.tensor([len(r) for n in names for r in sparse[n]], dtype=torch.int32)
    values = torch.tensor([i for n in names for r in sparse[n] for i in r], dtype=torch.int64)
    w = None
    if weights:
        w = torch.tensor([x for n in names for k, r in enumerate(sparse[n]) for x in (weights[n][k] if n in weights else [1.0] * len(r))],
                         dtype=torch.float32)
    d = torch.zeros(len(sparse[names[0]]), 0) if dense is None else torch.from_numpy(np.asarray(dense, dtype=np.float32))
    with torch.no_grad():
        return {k: v.cpu().numpy() for k, v in model(d, lengths, values, w).items()}


def hash_ids(sparse: Sparse, inputs: ModelInputs) -> Sparse:
    """The request with each id taken modulo its table's rows, as the loader and the server hash a modulo feature's
    ids before the model sees them (in-range ids stay as they are)."""
    return {name: [[i % inputs.rows[name] for i in r] for r in rows] for name, rows in sparse.items()}


def request_body(sparse: Sparse, dense: Any = None, weights: Optional[Weights] = None) -> Dict[str, Any]:
    """The request as recship_predict's --request JSON object: dense and weights left out when None."""
    body: Dict[str, Any] = {"sparse": sparse}
    if dense is not None:
        body["dense"] = dense.tolist() if isinstance(dense, np.ndarray) else dense
    if weights is not None:
        body["weights"] = weights
    return body


def request_file(path: Path, sparse: Sparse, dense: Any = None, weights: Optional[Weights] = None) -> Path:
    """``path``, holding ``request_body`` of the request."""
    path.write_text(json.dumps(request_body(sparse, dense, weights)))
    return path


def model_repo(root: Path, models: Mapping[str, Path]) -> Path:
    """``root``, made a model repository: a copy of each artifact of ``models`` as version 1 (root/<name>/1)."""
    for name, artifact in models.items():
        shutil.copytree(artifact, root / name / "1")
    return root


def served_fronts() -> List[str]:
    """The serving fronts to check here: "python", and "cpp" where the C++ front builds (no gRPC C++: Python alone)."""
    from recship.serving.front import FrontError, build_front

    try:
        build_front()
    except FrontError:
        return ["python"]
    return ["python", "cpp"]


Request = Tuple[Sparse, Any, Optional[Weights]]


def assert_served_as_in_process(artifact: Path, name: str, requests: Sequence[Request], wants: Sequence[Dict[str, np.ndarray]],
                                binary: Path, tmp_path: Path, model_format: str = "torchscript",
                                check: Optional[Callable[[Any, str], None]] = None) -> None:
    """Each of ``requests``, answered by every front of ``served_fronts`` (a server on a repository holding ``artifact``
    as model ``name``) and by recship_predict (``binary``), equals its ``wants`` (the artifact in process) bitwise,
    output for output. ``check(client, front)``: more calls on each front's server, after those."""
    import subprocess

    from recship.serving import PredictClient
    from recship.serving.server import Server, ServerConfig

    repo = model_repo(tmp_path / f"repo-{model_format}", {name: artifact})
    for front in served_fronts():
        server = Server(ServerConfig(model_repo=str(repo), port=0, metrics_port=0, max_delay_ms=2, front=front,
                                     model_format=model_format))
        try:
            with PredictClient(f"127.0.0.1:{server.port}") as client:
                for (sparse, dense, weights), want in zip(requests, wants):
                    got = client.predict(name, sparse, dense, weights)
                    assert set(got) == set(want), front
                    for key in want:
                        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{front} {model_format} {key}")
                if check is not None:
                    check(client, front)
        finally:
            server.stop()
    for n, ((sparse, dense, weights), want) in enumerate(zip(requests, wants)):
        path = request_file(tmp_path / f"r{n}-{model_format}.json", sparse, dense, weights)
        done = subprocess.run([str(binary), str(artifact), "--request", str(path), "--format", model_format],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        for key in want:
            got = np.asarray(answer[key], dtype=np.float32).reshape(want[key].shape)
            np.testing.assert_array_equal(got, want[key], err_msg=f"recship_predict {model_format} {key}")


def runnable_aoti(export: Callable[[], Path]) -> Path:
    """``export()``'s artifact, which must hold a model.pt2 this machine runs; else the test is skipped, saying why
    (no C++ compiler to export one, none written, or kernels this CPU or torch cannot run)."""
    import pytest

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("model.pt2 needs a C++ compiler (g++) to be exported")
    artifact = export()
    if not (artifact / "model.pt2").is_file():
        pytest.skip("the export wrote no model.pt2 (no compiler for AOTInductor)")
    runs, why = aoti_runs_here(Manifest.read(artifact))
    if not runs:
        pytest.skip(f"model.pt2 cannot run here: {why}")
    return artifact


def listening_socket(reuseport: bool) -> socket.socket:
    """A socket listening on a free loopback port (a port a server must find taken), with SO_REUSEPORT as a gRPC
    server sets it by default, or without."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s
