"""The tables file (export/tables_writer.py writes it, export/tables.py maps it): tables stored once, mapped, verified per table, shared between equal versions.

References: the same artifact in the old layout (format 1: model.pt with its tables inside, rebuilt here
from the format-2 one) run in-process, plain file sizes, /proc/self/maps and VmRSS of this process.
"""

import gc
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.export.artifact import FORMAT_V1, ArtifactError, Manifest, file_sha256, open_artifact
from recship.contract.tables import TABLES_FILE
from recship.models import TwoTower
from recship.models.dlrm import BuiltinDLRM, DLRMConfig

from model_requests import ModelInputs, in_process, model_repo, random_request, request_file


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """``medium(seed) -> Path``: a DLRM with 4 tables x 20,000 x 64 (5.4 MB of INT8 rows), model.pt only."""
    made = {}

    def build(seed: int = 0) -> Path:
        if seed not in made:
            torch.manual_seed(seed)
            model = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[20_000] * 4, embedding_dim=64, dense_arch=[32], over_arch=[16]))
            out = tmp_path_factory.mktemp("tables") / f"dlrm-{seed}"
            export_model(model, ExportConfig(out=str(out), dtype="int8", progress=False, validation_batches=1, format="torchscript",
                                             plot=False))
            made[seed] = out
        return made[seed]

    return build


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _segment(manifest: Manifest, index: int = 3):
    """(tensor, segment) of the ``index``-th table in the tables file."""
    pairs = [(t, s) for t in manifest.tables.tensors for s in t.segments if s.rows is not None]
    return pairs[index]


def _assert_bitwise(got, want, where: str) -> None:
    """The same outputs, each of the same shape and bits (torch.equal); a failure names the largest difference."""
    assert got.keys() == want.keys(), where
    for k in want:
        a, b = torch.from_numpy(np.asarray(got[k], dtype=np.float32)), torch.from_numpy(want[k])
        assert a.shape == b.shape, f"{where} {k}: shape {tuple(a.shape)}, want {tuple(b.shape)}"
        assert torch.equal(a, b), f"{where} {k}: max |difference| {(a - b).abs().max().item():.3g}"


def _as_format_1(src: Path, dst: Path) -> Path:
    """The artifact as format 1 wrote it: model.pt with its tables inside, no tables.bin, no model.pt2."""
    model, manifest = open_artifact(src, format="torchscript")
    dst.mkdir()
    torch.jit.save(model, str(dst / "model.pt"))
    shutil.copytree(src / "sample", dst / "sample")
    raw = manifest.to_dict()
    raw.update(format=FORMAT_V1, model_sha256=file_sha256(dst / "model.pt"))
    for key in ("tables", "aoti"):
        raw.pop(key, None)
    (dst / "manifest.json").write_text(json.dumps(raw))
    return dst


def test_the_folder_costs_its_tables_once(medium):
    art = medium()
    manifest = Manifest.read(art)
    rows = sum(s.bytes for t in manifest.tables.tensors for s in t.segments if s.rows is not None)
    assert 4 * 20_000 * 68 <= rows <= 4 * (20_000 * 68 + 128)  # INT8 rows: 64 bytes + fp16 scale and bias, tables padded to 128
    folder = sum(f.stat().st_size for f in art.rglob("*") if f.is_file())
    assert folder <= 1.15 * rows, f"{folder} bytes on disk for {rows} bytes of tables"
    assert (art / "model.pt").stat().st_size < 0.05 * rows  # the program and the dense layers only


@pytest.fixture(scope="module")
def two_tower(tmp_path_factory) -> Path:
    """The example two-tower model (recship.models:TwoTower: 300 users, 500 items, dim 16; an EmbeddingCollection
    beside two EmbeddingBagCollections), INT8, model.pt only."""
    torch.manual_seed(0)
    model = TwoTower(num_users=300, num_items=500, num_countries=20, num_categories=30, dim=16, num_dense=4)
    out = tmp_path_factory.mktemp("tables") / "two_tower"
    export_model(model, ExportConfig(out=str(out), dtype="int8", progress=False, validation_batches=1, validation_batch_size=32,
                                     format="torchscript", plot=False))
    return out


@pytest.fixture(scope="module")
def kinds(medium, two_tower, small_artifacts, tmp_path_factory):
    """{kind: (the format-2 artifact, the same rebuilt in format 1)} for the DLRM of ``medium``, the two-tower and
    the weighted EmbeddingBagCollection of ``small_artifacts(model="emb")``. Read-only."""
    root = tmp_path_factory.mktemp("format_1")
    arts = {"dlrm": medium(), "two_tower": two_tower, "weighted": small_artifacts(model="emb")}
    return {kind: (art, _as_format_1(art, root / kind)) for kind, art in arts.items()}


BATCHES = [1, 7, 513]  # 513: past the default max_batch_size of the server and recship_predict (raised to 1024 below)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", ["dlrm", "two_tower", "weighted"])
def test_outputs_equal_the_format_1_artifact_bitwise(kinds, kind, batch):
    """In-process Python: the format-2 artifact answers what its format-1 rebuild answers, bitwise."""
    art, old = kinds[kind]
    new_model, manifest = open_artifact(art)
    old_model, _ = open_artifact(old)
    request = random_request(ModelInputs.of(manifest), batch, seed=batch)
    _assert_bitwise(in_process(new_model, *request), in_process(old_model, *request), f"{kind} batch {batch}")


@pytest.fixture(scope="module")
def repo(kinds, tmp_path_factory) -> Path:
    """A model repository of the three format-2 artifacts, each as version 1 of its kind. Read-only."""
    return model_repo(tmp_path_factory.mktemp("tables-repo"), {kind: art for kind, (art, _) in kinds.items()})


def _assert_answers_equal_format_1(kinds, answer) -> None:
    """``answer(kind, sparse, dense, weights) -> {output: array}`` equals, bitwise, the kind's format-1 rebuild run
    in-process, for every kind and batch."""
    for kind, (_, old) in kinds.items():
        old_model, manifest = open_artifact(old)
        for batch in BATCHES:
            request = random_request(ModelInputs.of(manifest), batch, seed=batch)
            _assert_bitwise(answer(kind, *request), in_process(old_model, *request), f"{kind} batch {batch}")


@pytest.mark.parametrize("front", ["python", "cpp"])
def test_served_outputs_equal_the_format_1_artifact_bitwise(kinds, repo, front):
    """``recship serve --front F`` on the repository of the three format-2 artifacts (one server for every kind and
    batch) answers, bitwise, what each format-1 rebuild answers in-process here."""
    from recship.serving import PredictClient
    from recship.serving.front import FrontError, build_front
    from recship.serving.server import Server, ServerConfig

    if front == "cpp":
        try:
            build_front()
        except FrontError as e:
            pytest.skip(f"the C++ front cannot be built here: {e}")
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_batch_size=1024, max_delay_ms=1, front=front))
    try:
        with PredictClient(f"127.0.0.1:{server.port}") as client:
            _assert_answers_equal_format_1(kinds, lambda kind, sparse, dense, weights: client.predict(kind, sparse, dense, weights, timeout=60))
        # the C++ front answered every Predict itself: one of a model it failed to load would reach the Python server
        counted = {kind: server.metrics.requests.labels("Predict", kind, "1", "OK")._value.get() for kind in kinds}
        assert counted == {kind: 0 if front == "cpp" else len(BATCHES) for kind in kinds}
    finally:
        server.stop()  # and frees its models (tables equal to medium()'s, which a later test must find unshared)


def test_cpp_loader_outputs_equal_the_format_1_artifact_bitwise(kinds, repo, binary, tmp_path):
    """recship_predict (the C++ loader's CLI) on each format-2 artifact answers, bitwise, what its format-1 rebuild
    answers in-process here."""

    def answer(kind, sparse, dense, weights):
        request = request_file(tmp_path / "request.json", sparse, dense, weights)
        result = subprocess.run([str(binary), str(repo / kind / "1"), "--request", str(request),
                                 "--max-batch-size", "1024"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)  # {output: nested lists of the output's shape}

    _assert_answers_equal_format_1(kinds, answer)


def test_a_flipped_byte_is_refused_naming_the_table(medium, tmp_path):
    art = _copy(medium(), tmp_path / "a")
    manifest = Manifest.read(art)
    tensor, segment = _segment(manifest)
    with open(art / TABLES_FILE, "r+b") as f:
        f.seek(tensor.offset + segment.offset + segment.bytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(ArtifactError, match=rf"table '{segment.name}' .* has sha256 [0-9a-f]{{64}}, the manifest says {segment.sha256}"):
        open_artifact(art)


def test_a_truncated_tables_file_is_refused_naming_the_table(medium, tmp_path):
    art = _copy(medium(), tmp_path / "a")
    manifest = Manifest.read(art)
    tensor, segment = _segment(manifest, 2)
    os.truncate(art / TABLES_FILE, tensor.offset + segment.offset + 10)
    with pytest.raises(ArtifactError, match=rf"the manifest says {manifest.tables.bytes} \(truncated: table '{segment.name}'"):
        open_artifact(art)
    (art / TABLES_FILE).unlink()
    with pytest.raises(ArtifactError, match=r"tables.bin cannot be read"):
        open_artifact(art)


def test_another_versions_tables_are_refused(medium, tmp_path):
    art = _copy(medium(0), tmp_path / "a")
    shutil.copy(medium(1) / TABLES_FILE, art / TABLES_FILE)
    first = _segment(Manifest.read(art), 0)[1]
    with pytest.raises(ArtifactError, match=rf"table '{first.name}' .* the file is corrupt or from another artifact"):
        open_artifact(art)


def test_a_manifest_rewritten_for_other_tables_is_refused_by_the_model_file(medium, tmp_path):
    """tables.bin and the manifest's checksums both of another export: model.pt still pins its own tables."""
    art = _copy(medium(0), tmp_path / "a")
    other = Manifest.read(medium(1))
    shutil.copy(medium(1) / TABLES_FILE, art / TABLES_FILE)
    manifest = Manifest.read(art)
    manifest.tables = other.tables
    manifest.write(art)
    with pytest.raises(ArtifactError, match=r"model.pt was exported with other tables than manifest.json describes"):
        open_artifact(art, check=False)


def _rss_file_kib() -> int:
    """This process's resident file-backed pages (where mapped tables live; a model's program and heap are anonymous)."""
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("RssFile:")).split()[1])


def _mapped(path: Path) -> bool:
    return str(path / TABLES_FILE) in Path("/proc/self/maps").read_text()


def test_two_versions_with_equal_tables_share_their_pages(medium, tmp_path):
    v1, v2 = _copy(medium(), tmp_path / "1"), _copy(medium(), tmp_path / "2")
    table_kib = Manifest.read(v1).tables.bytes // 1024
    first, _ = open_artifact(v1)
    before = _rss_file_kib()
    second, _ = open_artifact(v2)
    grown = _rss_file_kib() - before
    assert grown < 0.2 * table_kib, f"the second version added {grown} KiB ({table_kib} KiB of tables)"
    assert _mapped(v1) and not _mapped(v2)
    weights = {n: b.data_ptr() for n, b in first.named_buffers() if n.endswith("tbe.weights")}
    assert weights and weights == {n: b.data_ptr() for n, b in second.named_buffers() if n.endswith("tbe.weights")}
    del first, second
    import gc

    gc.collect()
    assert not _mapped(v1)  # the last version using them is gone: unmapped
    third, _ = open_artifact(v2)  # nothing live to share: v2's own file, verified
    assert _mapped(v2)


def test_a_format_1_artifact_still_loads(small_artifact, tmp_path):
    old = _as_format_1(small_artifact, tmp_path / "v1")
    assert not (old / TABLES_FILE).exists()
    model, manifest = open_artifact(old)
    assert manifest.format == FORMAT_V1 and manifest.tables is None


def test_a_corrupt_copy_of_live_tables_is_refused(medium, tmp_path):
    """Sharing pages with a loaded version never skips checking a version's own file."""
    v1, v2 = medium(), _copy(medium(), tmp_path / "2")
    first, manifest = open_artifact(v1)
    tensor, segment = _segment(manifest, 1)
    with open(v2 / TABLES_FILE, "r+b") as f:
        f.seek(tensor.offset + segment.offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ArtifactError, match=rf"table '{segment.name}'"):
        open_artifact(v2)


def test_an_unchanged_export_into_a_repository_links_the_tables_file(tmp_path):
    torch.manual_seed(3)
    model = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[500] * 3, embedding_dim=16, dense_arch=[8], over_arch=[8]))
    config = dict(repo=str(tmp_path), model_name="m", dtype="int8", progress=False, validation_batches=1, format="torchscript",
                  plot=False)
    export_model(model, ExportConfig(**config))
    export_model(model, ExportConfig(**config))
    v1, v2 = tmp_path / "m" / "1" / TABLES_FILE, tmp_path / "m" / "2" / TABLES_FILE
    assert v1.stat().st_ino == v2.stat().st_ino and v1.stat().st_nlink == 2
    with torch.no_grad():
        model.over_arch.model[1].bias += 1.0  # only the dense layers change: still one file
    export_model(model, ExportConfig(**config))
    assert (tmp_path / "m" / "3" / TABLES_FILE).stat().st_ino == v1.stat().st_ino
    open_artifact(tmp_path / "m" / "3")
    with torch.no_grad():
        next(iter(model.sparse_arch.parameters())).add_(1.0)
    export_model(model, ExportConfig(**config))  # other tables: a file of its own
    assert (tmp_path / "m" / "4" / TABLES_FILE).stat().st_ino != v1.stat().st_ino
    open_artifact(tmp_path / "m" / "4")


@pytest.mark.parametrize("shards", [1, 2])
def test_each_tables_segment_holds_its_own_rows(tmp_path, shards):
    """In a TBE whose first table is looked up by two features (fbgemm keeps one weights offset per feature), a
    byte flipped in the next table's first row is refused naming that table, not the one before it. The row's
    bytes come from the quantized module's own views of its storage, not from the tables file's map."""
    from recship.quantize import QuantConfig, quantize_embedding_bag_collection
    from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=16, feature_names=["x", "y"]),
              EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["z"]),
              EmbeddingBagConfig(name="c", num_embeddings=20, embedding_dim=4, feature_names=["u", "v", "w"])]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables)
    art = tmp_path / "a"
    export_model(ebc, ExportConfig(out=str(art), dtype="int8", progress=False, validation_batches=1, format="torchscript", plot=False,
                                   shards=shards, sharding="row_wise" if shards > 1 else None))
    qebc, _ = quantize_embedding_bag_collection(ebc, QuantConfig(dtype="int8"))
    for name, (data, scale_bias) in qebc.table_weights().items():
        storage = torch.empty(0, dtype=torch.uint8).set_(data.untyped_storage())
        start = min(data.storage_offset(), scale_bias.storage_offset())
        first_row = storage[start : start + data.stride(0)].numpy().tobytes()
        copy = _copy(art, tmp_path / f"flipped-{name}")
        raw = bytearray((copy / TABLES_FILE).read_bytes())
        at = raw.find(first_row)
        assert at >= 0 and raw.find(first_row, at + 1) < 0, f"table {name}'s first row is not in the file exactly once"
        raw[at + len(first_row) // 2] ^= 0x10
        (copy / TABLES_FILE).write_bytes(bytes(raw))
        shown = f"{name}@0" if shards > 1 else name
        with pytest.raises(ArtifactError, match=rf"tables\.bin: table '{shown}' \(bytes"):
            open_artifact(copy)


def _mapped_bytes(path: Path) -> int:
    """Bytes of this process's mappings of the file ``path``."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5] in (str(path), f"{path} (deleted)"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            total += end - start
    return total


def test_a_shared_tensor_keeps_only_its_own_pages_of_the_other_version_mapped(tmp_path):
    """Versions that share one small constant (a TBE's offsets, equal across retrains) and differ in their tables:
    the newer version takes the constant from the older one, which must not keep the older one's file mapped once it
    is gone (a whole-file mapping did, for as long as the newer version lived: its tables in memory, its blocks on
    disk). A tensor smaller than a page is a copy; a larger one has a mapping of its own."""
    from recship.export.tables import map_tables
    from recship.export.tables_writer import TablesWriter

    small = torch.arange(26, dtype=torch.int64)
    folders = []
    for seed in (1, 2):
        writer = TablesWriter()
        writer.add_aoti({"offsets": small, "rows": torch.randn(1000, 64, generator=torch.Generator().manual_seed(seed))})
        folder = tmp_path / str(seed)
        folder.mkdir()
        folders.append((folder, writer.write(folder)))
    (old, old_spec), (new, new_spec) = folders
    older = map_tables(old, old_spec)
    assert _mapped_bytes(old / TABLES_FILE) >= 1000 * 64 * 4
    newer = map_tables(new, new_spec)
    assert newer["offsets"].data_ptr() == older["offsets"].data_ptr()  # shared
    assert torch.equal(newer["offsets"], small) and not torch.equal(newer["rows"], older["rows"])
    del older
    gc.collect()
    (old / TABLES_FILE).unlink()  # the old version removed from the repository
    assert _mapped_bytes(old / TABLES_FILE) == 0, "the old version's tables are still mapped through a shared constant"
    assert torch.equal(newer["offsets"], small)
    del newer
    gc.collect()
    assert _mapped_bytes(old / TABLES_FILE) == 0 and _mapped_bytes(new / TABLES_FILE) == 0
