"""Nothing non-finite ships: export refuses NaN/inf weights (naming the table and row), non-finite dense
parameters (naming them) and non-finite validation outputs, and the manifest is strict JSON.

References: the rows and parameters the tests themselves poison (their names and indices are known here).
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from recship.export import ExportConfig, ExportError, export_model
from recship.models.dlrm import BuiltinDLRM, DLRMConfig


def _dlrm(seed: int = 0) -> BuiltinDLRM:
    torch.manual_seed(seed)
    return BuiltinDLRM(DLRMConfig(num_embeddings_per_feature=[50, 3000, 20], embedding_dim=8, dense_arch=[8], over_arch=[8]))


def _config(out, **kw):
    return ExportConfig(out=str(out), progress=False, validation_batches=1, format="torchscript", plot=False, **kw)


@pytest.mark.parametrize("value, dtype", [(math.nan, "int8"), (math.inf, "int4"), (-math.inf, "fp16"), (math.nan, "fp32"),
                                          (1e6, "fp16")])
def test_a_table_row_that_cannot_be_stored_finite_is_refused_naming_it(tmp_path, value, dtype):
    model = _dlrm()
    with torch.no_grad():
        model.sparse_arch.embedding_bag_collection.embedding_bags["t_cat_1"].weight[2345, 5] = value
    with pytest.raises(ValueError, match=r"table 't_cat_1': row 2345 (holds|spans)") as e:
        export_model(model, _config(tmp_path / "a", dtype=dtype))
    assert ("row 2345 holds" in str(e.value)) == (not math.isfinite(value))
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())  # nothing left behind


def test_non_finite_dense_parameters_are_refused_naming_them(tmp_path):
    model = _dlrm()
    with torch.no_grad():
        model.over_arch.model[0]._mlp[0]._linear.weight[0, 0] = math.nan
    with pytest.raises(ExportError, match=r"output 'logit' of the float model holds NaN or inf.*over_arch\.model\.0\._mlp\.0\._linear\.weight"):
        export_model(model, _config(tmp_path / "a"))


def test_a_corrupt_checkpoint_is_refused_by_the_cli(tmp_path):
    """A checkpoint whose table bytes were overwritten by 0xFF (NaN floats) is refused with exit 2 and the table named."""
    from recship.trainer.checkpoint_reader import CheckpointReader, _chunk_location
    from recship.trainer.train import TrainConfig, launch

    summary = launch(TrainConfig(out=str(tmp_path / "run"), steps=2, batch_size=32, num_embeddings_per_feature=[40] * 26,
                                 embedding_dim=8, dense_arch=[16], over_arch=[16], eval_every=0, eval_batches=2,
                                 checkpoint_every=0, progress=False))
    reader = CheckpointReader(summary["checkpoint"])
    md = reader._dcp_metadata()
    item = next(v for k, v in md.storage_data.items() if k.fqn == "tables/sparse_arch.embedding_bag_collection/t_cat_7/weight")
    path = reader.path / item.relative_path
    fd = os.open(path, os.O_RDWR)
    try:
        start, _ = _chunk_location(fd, item.offset, item.length)
        os.pwrite(fd, b"\xff" * 64, start + 5 * 8 * 4)  # rows 5 and 6 of [40, 8] float32
    finally:
        os.close(fd)
    result = subprocess.run([sys.executable, "-m", "recship", "export", summary["checkpoint"], "--out", str(tmp_path / "art"),
                             "--format", "torchscript"], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "table 't_cat_7': row 5 holds nan" in result.stderr, result.stderr
    assert not (tmp_path / "art").exists()


def test_the_manifest_is_strict_json(tmp_path):
    from recship.export.artifact import Manifest

    export_model(_dlrm(), _config(tmp_path / "a"))
    text = (tmp_path / "a" / "manifest.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"manifest.json holds {c}"))
    manifest = Manifest.read(tmp_path / "a")
    manifest.validation["error"] = math.nan
    with pytest.raises(ValueError, match="JSON"):
        manifest.write(tmp_path / "b")


def test_any_model_with_non_finite_dense_parameters_is_refused(tmp_path):
    from recship.models import TwoTower

    torch.manual_seed(0)
    model = TwoTower(num_users=30, num_items=40, num_countries=5, num_categories=6, dim=8)
    with torch.no_grad():
        model.item_mlp[0].bias[3] = math.inf
    with pytest.raises(ExportError, match=r"output '\w+' of the float model holds NaN or inf.*item_mlp\.0\.bias"):
        export_model(model, _config(tmp_path / "a"))


def test_a_manifest_holding_nan_is_refused_as_corrupt(small_artifact, tmp_path):
    """Python's json reads NaN; the C++ loader's JSON parser does not: both refuse such a manifest."""
    import shutil

    from recship.export.artifact import ArtifactError, open_artifact

    art = tmp_path / "a"
    shutil.copytree(small_artifact, art)
    text = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text(text.replace('"relative_diff_vs_float": ', '"relative_diff_vs_float": NaN, "was": ', 1)
                                       if '"relative_diff_vs_float": ' in text else text.replace('"error": ', '"error": NaN, "was": ', 1))
    with pytest.raises(ArtifactError, match=r"manifest.json is corrupt: NaN is not JSON"):
        open_artifact(art)


def test_nan_recorded_outputs_fail_inspect_and_the_server_serves_nothing_of_it(small_artifact, tmp_path, capsys):
    """Before, `recship inspect` said "sample self-check: ok" of an artifact whose recorded outputs were all NaN, and
    the server loaded it and answered NaN with status OK (the C++ loader's refusal: tests/cpp_loader/test_cpp_integrity.py)."""
    import shutil

    import numpy as np

    from recship.cli import main
    from recship.serving.server import Server, ServerConfig

    repo = tmp_path / "repo"
    art = repo / "dlrm" / "1"
    shutil.copytree(small_artifact, art)
    for out in sorted((art / "sample").glob("outputs.*.bin")):
        out.write_bytes(np.full(out.stat().st_size // 4, np.nan, dtype="<f4").tobytes())
    message = f"{art}: sample file 'sample/{sorted((art / 'sample').glob('outputs.*.bin'))[0].name}' holds NaN or infinity"
    assert main(["inspect", str(art)]) != 0
    captured = capsys.readouterr()
    assert "sample self-check: ok" not in captured.out and message in captured.err
    server = Server(ServerConfig(model_repo=str(repo), port=0, max_delay_ms=1))
    try:
        assert server.repo.models() == []
        (refused,) = server.repo.unavailable()
        assert (refused.model, refused.version) == ("dlrm", "1") and message in refused.reason
    finally:
        server.stop()
