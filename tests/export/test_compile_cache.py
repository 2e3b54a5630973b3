"""model.pt2's compile cache (export/compile_cache.py).

The store (fast, no compile): entries round-trip; a corrupt one (truncated, garbage, another key inside, entry.json
broken) is refused, logged and removed; two processes storing and reading one key at once never see a torn entry;
the folder stays within its bound, least recently used first. The key (torch.export only): the same graph with
other weights keeps it, another dense width or feature count or option changes it. Exports (slow, compiles): a hit
gives a model.pt2 whose outputs equal a fresh compile's bitwise, and model.pt's; a corrupt entry is rebuilt; two
exports into one cache at once both succeed and leave one entry.
"""

import hashlib
import io
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from recship.export.compile_cache import ENTRY, PACKAGE, CompileCache, baked_constants, program_key, resolve

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                    reason="AOTInductor needs a C++ compiler (g++)")


def _package(payload: bytes) -> bytes:
    """A stand-in for a compiled package: a zip archive holding a shared library."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("model/data/aotinductor/model/model.so", payload)
    return buffer.getvalue()


def test_an_entry_round_trips_and_a_miss_is_none(tmp_path):
    cache = CompileCache(tmp_path / "c")
    assert cache.get("a" * 64) is None
    cache.put("a" * 64, _package(b"x" * 100), ["w", "b"])
    hit = cache.get("a" * 64)
    assert hit is not None and hit.package == _package(b"x" * 100) and hit.constant_fqns == ["w", "b"]
    assert CompileCache(tmp_path / "c").get("b" * 64) is None


def test_where_the_cache_is(tmp_path, monkeypatch):
    from recship.export import ExportConfig, ExportError

    monkeypatch.setenv("RECSHIP_CACHE_DIR", str(tmp_path / "env"))
    assert resolve(True).folder == tmp_path / "env" and resolve(str(tmp_path / "own")).folder == tmp_path / "own"
    assert resolve(False) is None
    monkeypatch.delenv("RECSHIP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve(True).folder == tmp_path / "xdg" / "recship" / "aoti"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve(True).folder == Path.home() / ".cache" / "recship" / "aoti"
    for bad in (3, ""):
        with pytest.raises(ExportError, match=f"compile_cache must be True, False or a folder's path, got {bad!r}"):
            ExportConfig(out=str(tmp_path / "a"), compile_cache=bad)


def _corrupt_package(entry: Path) -> None:
    (entry / PACKAGE).write_bytes((entry / PACKAGE).read_bytes()[:-10])


def _garbage_package(entry: Path) -> None:
    data = bytearray((entry / PACKAGE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (entry / PACKAGE).write_bytes(bytes(data))


def _other_key(entry: Path) -> None:
    meta = json.loads((entry / ENTRY).read_text())
    meta["key"] = "b" * 64
    (entry / ENTRY).write_text(json.dumps(meta))


def _broken_json(entry: Path) -> None:
    (entry / ENTRY).write_text("{not json")


def _not_a_package(entry: Path) -> None:  # consistent sha256, but no compiled library inside
    data = b"garbage" * 10
    meta = json.loads((entry / ENTRY).read_text())
    meta.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (entry / PACKAGE).write_bytes(data)
    (entry / ENTRY).write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, said", [
    (_corrupt_package, "another sha256"), (_garbage_package, "another sha256"), (_other_key, "holds key bbbb"),
    (_broken_json, "JSONDecodeError"), (_not_a_package, "not a zip archive"),
])
def test_a_corrupt_entry_is_refused_logged_and_removed(tmp_path, caplog, damage, said):
    cache = CompileCache(tmp_path)
    key = "a" * 64
    cache.put(key, _package(b"x" * 1000), ["w"])
    damage(tmp_path / key)
    with caplog.at_level(logging.WARNING, logger="recship.export.compile_cache"):
        assert cache.get(key) is None
    assert said in caplog.text and "refused" in caplog.text
    assert not (tmp_path / key).exists() and os.listdir(tmp_path) == []  # removed, nothing left beside it
    cache.put(key, _package(b"y" * 1000), ["w"])  # rebuilt
    assert cache.get(key).package == _package(b"y" * 1000)


def test_the_folder_keeps_its_bound_least_recently_used_first(tmp_path):
    size = len(_package(os.urandom(10_000)))
    cache = CompileCache(tmp_path, max_bytes=3 * size + 3 * 300)  # three entries (with their entry.json) fit
    for i, key in enumerate("abcd"):
        cache.put(key * 64, _package(os.urandom(10_000)), [])
        os.utime(tmp_path / (key * 64), (1000 + i, 1000 + i))
        if key == "c":
            assert cache.get("a" * 64) is not None  # a hit: a is now the most recently used
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["a", "c", "d"]  # b, the least recently used, went


def _race(folder: str, key: str, payload: bytes, rounds: int, queue) -> None:
    """Stores and reads ``key`` ``rounds`` times; puts (the packages read, the misses after its first store) on ``queue``."""
    cache = CompileCache(Path(folder))
    seen, misses = set(), 0
    for i in range(rounds):
        hit = cache.get(key)
        if hit is not None:
            seen.add(hit.package)
        elif i:
            misses += 1
        cache.put(key, payload, ["w"])
    queue.put((seen, misses))


def test_two_processes_storing_one_key_never_read_a_torn_entry(tmp_path):
    key = "a" * 64
    payloads = [_package(bytes([i]) * 50_000) for i in (1, 2)]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_race, args=(str(tmp_path), key, p, 40, queue)) for p in payloads]
    for w in workers:
        w.start()
    results = [queue.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    (stored,) = set().union(*(seen for seen, _ in results))  # whole packages only, and the first stored stays
    assert stored in payloads and [misses for _, misses in results] == [0, 0]  # once stored, never refused nor missed
    assert [p.name for p in tmp_path.iterdir()] == [key]  # no temporary folder left
    assert CompileCache(tmp_path).get(key).package == stored


# -- the key: torch.export only --------------------------------------------------------------------------------------


class _Served(nn.Module):
    """forward(dense, lengths, values, weights) like the served module: a dense MLP ending in one logit (its bias
    has one element, which inductor would inline by default) plus a pooled sum per feature."""

    def __init__(self, num_dense: int, num_features: int) -> None:
        super().__init__()
        self.num_features = num_features
        self.bottom = nn.Linear(num_dense, 4)
        self.top = nn.Linear(4 + num_features, 1)
        self.table = nn.Parameter(torch.randn(50, 1))

    def forward(self, dense, lengths, values, weights):
        batch = dense.shape[0]
        rows = self.table[values].reshape(-1)
        segment = torch.repeat_interleave(torch.arange(self.num_features * batch), lengths.long(), output_size=values.shape[0])
        pooled = torch.zeros(self.num_features * batch).index_add(0, segment, rows)
        features = torch.cat([torch.relu(self.bottom(dense)), pooled.reshape(self.num_features, batch).t()], dim=1)
        return {"logit": self.top(features)}


def _program(num_dense=3, num_features=2, seed=0):
    from recship.export.aoti_compile import export_program

    torch.manual_seed(seed)
    module = _Served(num_dense, num_features)
    example = (torch.zeros(2, num_dense), torch.ones(2 * num_features, dtype=torch.int32),
               torch.zeros(2 * num_features, dtype=torch.int64), None)
    return export_program(module, example, num_features)


def _key(num_dense=3, num_features=2, seed=0, options=None):
    return program_key(_program(num_dense, num_features, seed), options or {"cpp.threads": 1}, "x86-64-v3")


def test_the_key_is_the_graphs_not_the_weights():
    key = _key()
    assert len(key) == 64 and key == _key(seed=1)  # other weights, the one-element bias included: the same program
    others = [_key(num_dense=4), _key(num_features=3), _key(options={"cpp.threads": 2})]
    assert len({key, *others}) == 4


def test_a_package_that_leaves_out_a_used_constant_is_said_to_bake_it():
    program = _program()
    every = sorted({**program.state_dict, **program.constants})
    assert baked_constants(program, every) == []
    assert baked_constants(program, [f for f in every if f != "top.bias"]) == ["top.bias"]  # compiled in by value
    program.state_dict["top.bias"] = torch.empty(0)  # an empty tensor has no value to compile in
    assert baked_constants(program, [f for f in every if f != "top.bias"]) == []


def test_the_key_is_the_same_in_another_process():
    code = "import sys; sys.path.insert(0, sys.argv[1]); from test_compile_cache import _key; print(_key())"
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == _key()


# -- exports (compiles) ------------------------------------------------------------------------------------------------


def _tiny_dlrm(seed: int):
    from recship.models.dlrm import BuiltinDLRM, DLRMConfig

    torch.manual_seed(seed)
    return BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[30, 40, 50], embedding_dim=4, num_dense=5, dense_arch=[8],
                                  over_arch=[8]))


def _export(out: Path, seed: int, cache, fmt: str = "both") -> None:
    from recship.export import ExportConfig, export_model

    export_model(_tiny_dlrm(seed), ExportConfig(out=str(out), dtype="int8", progress=False, format=fmt, validation_batches=1,
                                                validation_batch_size=16, compile_cache=cache))


def _answers(path: Path, format: str):
    """The artifact's outputs (opened as ``format``) on its sample and on random requests of batch 1, 7 and 300."""
    from recship.export.artifact import open_artifact
    from recship.export.artifact import read_sample

    model, manifest = open_artifact(path, format=format)
    sample = read_sample(path, manifest)
    g = torch.Generator().manual_seed(4)
    rows = [f.rows for f in manifest.sparse_features]
    requests = [tuple(sample[0][k] for k in ("dense", "lengths", "values"))]
    for batch in (1, 7, 300):
        lengths = torch.randint(0, 4, (len(rows) * batch,), generator=g)
        limit = torch.tensor(rows).repeat_interleave(batch).repeat_interleave(lengths)
        requests.append((torch.rand(batch, manifest.num_dense, generator=g), lengths.to(torch.int32),
                         (torch.rand(int(lengths.sum()), generator=g) * limit).long()))
    with torch.no_grad():
        return [model(*r) for r in requests]


def _assert_bitwise(a, b):
    for x, y in zip(a, b, strict=True):
        assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


@needs_compiler
def test_a_hit_equals_a_fresh_compile_bitwise_and_a_corrupt_entry_is_rebuilt(tmp_path, caplog):
    cache = tmp_path / "cache"
    _export(tmp_path / "first", 0, str(cache))  # a miss: compiled and stored
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".lock-")]
    with caplog.at_level(logging.INFO, logger="recship.export.aoti_compile"):
        _export(tmp_path / "hit", 1, str(cache))  # the same architecture, retrained: a hit
    assert "from the compile cache" in caplog.text
    _export(tmp_path / "fresh", 1, False)  # the same model compiled afresh
    hit, fresh = _answers(tmp_path / "hit", "aoti"), _answers(tmp_path / "fresh", "aoti")
    _assert_bitwise(hit, fresh)
    _assert_bitwise(hit, _answers(tmp_path / "hit", "torchscript"))
    assert not all(torch.equal(a["logit"], b["logit"]) for a, b in zip(hit, _answers(tmp_path / "first", "aoti")))  # new weights

    _garbage_package(entry)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _export(tmp_path / "rebuilt", 1, str(cache))
    assert "refused" in caplog.text and "from the compile cache" not in caplog.text
    _assert_bitwise(_answers(tmp_path / "rebuilt", "aoti"), fresh)
    assert CompileCache(cache).get(entry.name) is not None  # stored again, whole


_CONCURRENT = """
import logging, sys
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from test_compile_cache import _export
_export(Path(sys.argv[1]), 0, sys.argv[2], "aoti")
"""


@needs_compiler
def test_two_exports_into_one_cache_at_once_both_succeed_and_one_compiles(tmp_path):
    """Two exports of one model at once: the second to reach the compile waits for the first's, then takes its entry."""
    cache = tmp_path / "cache"
    runs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT, str(tmp_path / name), str(cache), str(Path(__file__).parent)],
                             stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    errs = []
    for run in runs:
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, err
        errs.append(err)
    assert sum("from the compile cache" in err for err in errs) == 1, errs  # one compiled, the other took its entry
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == [f".lock-{entry.name}"]  # no temporary folder
    assert CompileCache(cache).get(entry.name) is not None
    _assert_bitwise(_answers(tmp_path / "a", "aoti"), _answers(tmp_path / "b", "aoti"))
