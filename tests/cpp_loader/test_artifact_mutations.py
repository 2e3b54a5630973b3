"""Property test of the artifact as a unit: a mutated copy of an exported artifact (a file truncated, extended,
a byte flipped, a file removed, a manifest field edited or removed) is loaded by Python's ``open_artifact``,
the C++ loader (``recship_predict``) and, for a subset, the server's repository (explicit model control, so a
load is synchronous). Each mutant is either refused by all of them, with the same message from Python and C++
naming the file or field, or served by all of them with outputs equal to the original's on the original
sample request (only where nothing the answer depends on changed). Never a crash, a hang, or another answer.

The counts by outcome are printed at the end (pytest -s).
"""

import collections
import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recship.export.artifact import ArtifactError, Manifest, open_artifact, read_sample

from model_requests import request_file, sample_request

_EXPLORE = os.environ.get("RECSHIP_FUZZ_EXAMPLES")
EXAMPLES = int(_EXPLORE or 120)  # ~50 s here; RECSHIP_FUZZ_EXAMPLES=N explores N fresh random ones
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=_EXPLORE is None, database=None,
                    suppress_health_check=list(HealthCheck))
SERVER_EVERY = 4  # one example in this many is also loaded by the server's repository
FILES = ["manifest.json", "model.pt", "tables.bin", "sample/inputs.dense.bin", "sample/inputs.lengths.bin",
         "sample/inputs.values.bin", "sample/outputs.logit.bin", "sample/outputs.prob.bin"]
TALLY: collections.Counter = collections.Counter()
_NUMBER = itertools.count()

# manifest fields an edit can change without changing any answer: reports and names (nothing validates by them)
HARMLESS = [("validation", "relative_diff_vs_float"), ("validation", "data"), ("quantization", "error_minimizing"), ("model", "name"),
            ("model", "version"), ("versions", "python")]
# fields a loader must refuse when they are edited to another value (sizes, checksums, files, shapes, bounds)
STRUCTURAL = [("num_dense",), ("weighted",), ("model_sha256",), ("format",), ("sample", "batch_size"),
              ("sample", "inputs", "values", "shape"), ("sample", "inputs", "dense", "dtype"),
              ("sample", "outputs", "prob", "file"), ("sample", "inputs", "lengths", "file"),
              ("sparse_features", 3, "rows"), ("sparse_features", 5, "table"), ("sparse_features", 0, "id_policy"),
              ("outputs", "prob", "shape"), ("tables", "bytes"), ("tables", "tensors", 0, "offset"),
              ("tables", "tensors", 0, "segments", 2, "sha256"), ("tables", "tensors", 0, "segments", 1, "rows"),
              ("tables", "tensors", 0, "segments", 4, "bytes"), ("versions", "torch")]


@pytest.fixture(scope="module")
def original(small_artifact, binary, tmp_path_factory):
    """The pristine artifact: its Python outputs on the sample, the sample as a recship_predict request file,
    and recship_predict's answer to it."""
    folder = tmp_path_factory.mktemp("mutants")
    art = folder / "original"
    shutil.copytree(small_artifact, art)
    model, manifest = open_artifact(art)
    inputs, _ = read_sample(art, manifest)
    with torch.no_grad():
        want = model(inputs["dense"], inputs["lengths"], inputs["values"], None)
    sparse, dense = sample_request(art)
    request = request_file(folder / "request.json", sparse, dense)
    cpp = _cpp(binary, art, request)
    assert cpp.returncode == 0, cpp.stderr
    yield {"dir": art, "folder": folder, "python": want, "inputs": inputs, "request": request, "cpp": json.loads(cpp.stdout),
           "manifest": json.loads((art / "manifest.json").read_text()), "sparse": sparse}
    for key, n in sorted(TALLY.items()):
        print(f"\nartifact mutants: {key}: {n}")
    outcomes = collections.Counter()
    for (_, _, outcome), n in TALLY.items():
        outcomes[outcome] += n
    print(f"\nartifact mutants: {sum(TALLY.values())} in all: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server on an empty repository under explicit model control: each mutant is loaded as a model of its own."""
    from recship.serving.server import Server, ServerConfig

    repo = tmp_path_factory.mktemp("mutant-repo")
    s = Server(ServerConfig(model_repo=str(repo), port=0, model_control="explicit", max_batch_size=64))
    yield s, repo
    s.stop()


def _cpp(binary, art: Path, request: Path) -> subprocess.CompletedProcess:
    # errors="replace": a JSON parser's message may quote the bytes it choked on
    return subprocess.run([str(binary), str(art), "--request", str(request), "--format", "torchscript"], capture_output=True,
                          text=True, errors="replace", timeout=120)


def _get(obj, path):
    for key in path:
        obj = obj[key]
    return obj


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.sampled_from(FILES), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("extend"), st.sampled_from(FILES), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("flip"), st.sampled_from(FILES), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    st.tuples(st.just("remove"), st.sampled_from(FILES[1:])),
    st.tuples(st.just("edit"), st.sampled_from(STRUCTURAL + HARMLESS),
              st.one_of(st.integers(-3, 100), st.sampled_from(["", "x", "modulo", "float32", "sample/outputs.logit.bin",
                                                                 "2.13.0+cpu", "t_cat_6", "0" * 64]),
                        st.lists(st.integers(0, 300), max_size=3), st.booleans(), st.none())),
    st.tuples(st.just("delete"), st.sampled_from(STRUCTURAL + HARMLESS)),
)


def _mutate(art: Path, m) -> str:
    """Applies mutation ``m`` to the artifact folder; returns the file it touched."""
    op, target = m[0], m[1]
    if op in ("edit", "delete"):
        manifest = json.loads((art / "manifest.json").read_text())
        *parents, leaf = target
        owner = _get(manifest, parents)
        if op == "edit":
            owner[leaf] = m[2]
        else:
            del owner[leaf]
        (art / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return "manifest.json"
    path = art / target
    data = path.read_bytes()
    if op == "truncate":
        path.write_bytes(data[: int(m[2] * len(data))])
    elif op == "extend":
        path.write_bytes(data + m[2])
    elif op == "flip":
        at = int(m[2] * len(data))
        path.write_bytes(data[:at] + bytes([data[at] ^ (1 << m[3])]) + data[at + 1:])
    else:
        path.unlink()
    return target


def _must_serve(original, m) -> bool:
    """Whether nothing an answer depends on changed: an edit of the exporter's reports (free-form), of a
    harmless field to another value of its type, or of any field to the value it had."""
    if m[0] != "edit":
        return False
    old = _get(original["manifest"], m[1])
    if tuple(m[1]) in HARMLESS:
        return m[1][0] in ("validation", "quantization") or type(old) is type(m[2])
    return old == m[2] and type(old) is type(m[2])


def _names_a_file(message: str, m) -> bool:
    """Whether a refusal names a file of the artifact (or the file an edited manifest field names instead)."""
    named = FILES + ([repr(m[2])] if m[0] == "edit" and isinstance(m[2], str) else [])
    return any(name in message for name in named)


@given(m=mutation)
@SETTINGS
def test_each_mutant_is_refused_everywhere_or_answers_as_the_original(original, binary, server, m):
    n = next(_NUMBER)
    art = original["folder"] / f"m{n}"
    shutil.copytree(original["dir"], art)
    try:
        _check(original, binary, server, m, n, art)
    finally:
        shutil.rmtree(art)


def _check(original, binary, server, m, n: int, art: Path) -> None:
    touched = _mutate(art, m)
    key_op = m[0] if m[0] not in ("edit", "delete") else f"{m[0]} {'harmless' if tuple(m[1]) in HARMLESS else 'field'}"

    # Python
    try:
        model, _ = open_artifact(art)
        refused = None
        with torch.no_grad():
            got = model(original["inputs"]["dense"], original["inputs"]["lengths"], original["inputs"]["values"], None)
        for name, want in original["python"].items():
            assert torch.equal(got[name], want), f"{m}: Python serves other outputs for {name}"
    except ArtifactError as e:
        refused = str(e)
        assert _names_a_file(refused, m), f"{m}: the refusal names no file: {refused}"
    # a harmless edit must be served, and so must an edit to the value the field already had
    if _must_serve(original, m):
        assert refused is None, f"{m}: a change nothing depends on was refused: {refused}"

    # C++: the same verdict, the same words
    cpp = _cpp(binary, art, original["request"])
    assert cpp.returncode in (0, 1), f"{m}: recship_predict exited {cpp.returncode}: {cpp.stderr[-2000:]}"
    if refused is None:
        assert cpp.returncode == 0, f"{m}: Python serves it, C++ refuses it: {cpp.stderr}"
        assert json.loads(cpp.stdout) == original["cpp"], f"{m}: C++ serves other outputs"
    else:
        assert cpp.returncode == 1, f"{m}: Python refuses it ({refused}), C++ serves it"
        said = cpp.stderr.strip().splitlines()[-1].removeprefix("recship_predict: error: ")
        if " is corrupt: " in refused:  # manifest.json does not parse: each JSON parser says where in its own words
            assert said.startswith(refused.split(" is corrupt: ")[0] + " is corrupt: "), f"{m}: {refused!r} vs {said!r}"
        else:
            assert said == refused, f"{m}: Python and C++ refuse it in other words"

    # the server (its repository), on a subset
    if n % SERVER_EVERY == 0:
        s, repo = server
        name = f"m{n}"
        shutil.copytree(art, repo / name / "1")
        from recship.serving.client import PredictClient
        from recship.serving.repository import ControlRefused

        try:
            s.repo.load(name)
            served = True
        except ControlRefused as e:
            served = False
            assert refused is not None and refused.replace(str(art), str(repo / name / "1")) in str(e), f"{m}: {e}"
        assert served == (refused is None), f"{m}: the server {'serves' if served else 'refuses'} it, Python does not"
        if served:
            with PredictClient(f"127.0.0.1:{s.port}") as client:
                answer = client.predict(name, original["sparse"], dense=original["inputs"]["dense"].numpy())
            for out, want in original["python"].items():
                assert np.array_equal(answer[out], want.numpy()), f"{m}: the server serves other outputs for {out}"
            s.repo.unload(name)
        shutil.rmtree(repo / name)
    TALLY[(touched, key_op, "refused" if refused else "served, equal")] += 1
