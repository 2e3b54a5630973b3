"""Export quantizes rows straight into tables.bin (export/tables_writer.py StagedTables).

References: the same export with the rows in the TBEs' own memory, written by the plain
writer (its bytes and manifest), and the bytes the writer is asked to write.
"""

import json

import pytest
import torch

from recship.export import ExportConfig, export_model
from recship.export import pipeline
from recship.export import tables_writer
from recship.export.artifact import open_artifact
from recship.contract.tables import TABLES_FILE
from recship.export.tables_writer import StagedTables, TablesWriter
from recship.export.any_model import export_any_model
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.models.dlrm import BuiltinDLRM, DLRMConfig


def _models():
    torch.manual_seed(3)
    dlrm = BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[300, 7, 1000], embedding_dim=16, dense_arch=[8], over_arch=[8]))
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=d, feature_names=[f"f{i}"])
                                  for i, (n, d) in enumerate([(500, 8), (33, 24)])])
    return {"dlrm": dlrm, "module": torch.nn.Sequential(ebc)}


@pytest.mark.parametrize("kind", ["dlrm", "module"])
@pytest.mark.parametrize("fmt", ["torchscript", "both"])
def test_rows_quantized_into_the_file_equal_the_written_ones(tmp_path, monkeypatch, kind, fmt):
    model = _models()[kind] if kind == "dlrm" else _ModuleWithDense(_models()[kind])
    config = dict(dtype="int4", progress=False, validation_batches=1, format=fmt, plot=False)
    export_model(model, ExportConfig(out=str(tmp_path / "staged"), **config))
    # fbgemm's own rows, then written
    monkeypatch.setattr(pipeline, "export_any_model", lambda *args, **kw: export_any_model(*args, **{**kw, "host_rows": None}))
    export_model(model, ExportConfig(out=str(tmp_path / "written"), **config))
    staged, written = tmp_path / "staged", tmp_path / "written"
    assert (staged / TABLES_FILE).read_bytes() == (written / TABLES_FILE).read_bytes()
    a, b = (json.loads((p / "manifest.json").read_text())["tables"] for p in (staged, written))
    assert a == b
    got, manifest = open_artifact(staged, format="torchscript")
    want, _ = open_artifact(written, format="torchscript")
    g = torch.Generator().manual_seed(0)
    batch = 5
    lengths = torch.randint(0, 3, (len(manifest.sparse_features) * batch,), generator=g, dtype=torch.int32)
    rows = torch.tensor([f.rows for f in manifest.sparse_features]).repeat_interleave(batch).repeat_interleave(lengths.long())
    values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
    dense = torch.rand(batch, manifest.num_dense, generator=g)
    out_a, out_b = got(dense, lengths, values, None), want(dense, lengths, values, None)
    assert all(torch.equal(out_a[k], out_b[k]) for k in out_b)


class _ModuleWithDense(torch.nn.Module):
    """An EBC behind the any-model contract: forward(dense, features) -> Tensor."""

    num_dense = 0

    def __init__(self, seq):
        super().__init__()
        self.ebc = seq[0]

    def forward(self, dense, features):
        return self.ebc(features).values()


def test_staged_rows_are_not_written_again(tmp_path, monkeypatch):
    written = []
    real = TablesWriter.write

    def write(self, folder, staged=None):
        spec = real(self, folder, staged)
        written.append((staged is not None and staged.size > 0, spec))
        return spec

    monkeypatch.setattr(TablesWriter, "write", write)
    sizes = []
    real_open = open

    def counting_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if str(path).endswith(TABLES_FILE) and "r+" in mode:
            sizes.append(f)
        return f

    monkeypatch.setattr(tables_writer, "open", counting_open, raising=False)
    export_model(_models()["dlrm"], ExportConfig(out=str(tmp_path / "a"), dtype="int8", progress=False, validation_batches=1,
                                                 format="torchscript", plot=False))
    assert written and written[0][0], "the rows were not quantized into the staged file"
    assert sizes, "the staged file was not appended to (the rows were written anew)"


def test_a_region_no_tensor_uses_makes_the_file_be_written_anew(tmp_path):
    staged = StagedTables(tmp_path / TABLES_FILE)
    used = staged.allocate(10_000)
    used.copy_(torch.arange(10_000) % 251)
    staged.allocate(5000).fill_(7)  # a TBE copied away after quantizing: nothing refers to these bytes
    writer = TablesWriter()
    writer._add("t", used.view(100, 100), [("t", 0, 10_000, 100)])
    spec = writer.write(tmp_path, staged)
    data = (tmp_path / TABLES_FILE).read_bytes()
    assert spec.bytes == len(data) == 10_000  # the unused region is gone
    assert data == bytes((torch.arange(10_000) % 251).to(torch.uint8).tolist())
    assert [t.offset for t in spec.tensors] == [0]


def test_staged_and_appended_tensors_keep_their_offsets(tmp_path):
    staged = StagedTables(tmp_path / TABLES_FILE)
    a = staged.allocate(5000)
    a.fill_(1)
    b = staged.allocate(3)
    b.fill_(2)
    dense = torch.full((7,), 3.0)
    writer = TablesWriter()
    writer._add("b", b, [("b", 0, 3, None)])
    writer._add("dense", dense, [("dense", 0, 28, None)])
    writer._add("a", a, [("a", 0, 5000, None)])
    spec = writer.write(tmp_path, staged)
    data = (tmp_path / TABLES_FILE).read_bytes()
    offsets = {t.name: t.offset for t in spec.tensors}
    assert [t.name for t in spec.tensors] == ["a", "b", "dense"]  # in file order
    assert offsets == {"a": 0, "b": 8192, "dense": 12288} and spec.bytes == len(data) == 12288 + 28
    assert data[:5000] == b"\x01" * 5000 and data[8192:8195] == b"\x02" * 3
    assert torch.equal(torch.frombuffer(bytearray(data[12288:]), dtype=torch.float32), dense)
