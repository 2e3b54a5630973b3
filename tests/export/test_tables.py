"""The tables file (export/tables.py): tables stored once, mapped, verified per table, shared between equal versions.

References: the same artifact in the old layout (format 1: model.pt with its tables inside, rebuilt here
from the format-2 one), plain file sizes, /proc/self/maps and VmRSS of this process.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.export.artifact import FORMAT_V1, ArtifactError, Manifest, file_sha256, open_artifact
from recship.export.tables import TABLES_FILE
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from recship.trainer.dlrm import DLRM, DLRMConfig


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """``medium(seed) -> Path``: a DLRM with 4 tables x 20,000 x 64 (5.4 MB of INT8 rows), model.pt only."""
    made = {}

    def build(seed: int = 0) -> Path:
        if seed not in made:
            torch.manual_seed(seed)
            model = DLRM(DLRMConfig(num_embeddings_per_feature=[20_000] * 4, embedding_dim=64, dense_arch=[32], over_arch=[16]))
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


def _request(manifest: Manifest, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(manifest.sparse_features) * batch,), generator=g, dtype=torch.int32)
    rows = torch.tensor([f.rows for f in manifest.sparse_features]).repeat_interleave(batch).repeat_interleave(lengths.long())
    values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
    weights = torch.rand(values.numel(), generator=g) if manifest.weighted else None
    return torch.rand(batch, manifest.num_dense, generator=g), lengths, values, weights


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


@pytest.mark.parametrize("batch", [1, 7, 513])
@pytest.mark.parametrize("kind", ["dlrm", "weighted"])
def test_outputs_equal_the_format_1_artifact_bitwise(medium, small_artifacts, tmp_path, kind, batch):
    art = medium() if kind == "dlrm" else small_artifacts(model="emb")
    old = _as_format_1(art, tmp_path / "v1")
    new_model, manifest = open_artifact(art)
    old_model, _ = open_artifact(old)
    dense, lengths, values, weights = _request(manifest, batch, seed=batch)
    with torch.no_grad():
        got, want = new_model(dense, lengths, values, weights), old_model(dense, lengths, values, weights)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


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


def _rss_kib() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:")).split()[1])


def _mapped(path: Path) -> bool:
    return str(path / TABLES_FILE) in Path("/proc/self/maps").read_text()


def test_two_versions_with_equal_tables_share_their_pages(medium, tmp_path):
    v1, v2 = _copy(medium(), tmp_path / "1"), _copy(medium(), tmp_path / "2")
    table_kib = Manifest.read(v1).tables.bytes // 1024
    first, _ = open_artifact(v1)
    before = _rss_kib()
    second, _ = open_artifact(v2)
    grown = _rss_kib() - before
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
    model = DLRM(DLRMConfig(num_embeddings_per_feature=[500] * 3, embedding_dim=16, dense_arch=[8], over_arch=[8]))
    config = dict(repo=str(tmp_path), model_name="m", dtype="int8", progress=False, validation_batches=1, format="torchscript",
                  plot=False)
    export_model(model, ExportConfig(**config))
    export_model(model, ExportConfig(**config))
    v1, v2 = tmp_path / "m" / "1" / TABLES_FILE, tmp_path / "m" / "2" / TABLES_FILE
    assert v1.stat().st_ino == v2.stat().st_ino and v1.stat().st_nlink == 2
    with torch.no_grad():
        model.over_arch[0].bias += 1.0  # only the dense layers change: still one file
    export_model(model, ExportConfig(**config))
    assert (tmp_path / "m" / "3" / TABLES_FILE).stat().st_ino == v1.stat().st_ino
    open_artifact(tmp_path / "m" / "3")
    with torch.no_grad():
        next(iter(model.sparse_arch.parameters())).add_(1.0)
    export_model(model, ExportConfig(**config))  # other tables: a file of its own
    assert (tmp_path / "m" / "4" / TABLES_FILE).stat().st_ino != v1.stat().st_ino
    open_artifact(tmp_path / "m" / "4")
