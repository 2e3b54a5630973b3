"""``recship inspect``'s feature table: which features carry per-id weights, read from the manifest."""

import json
import shutil
from typing import Dict

from recship.cli import main


def _weighted_column(text: str) -> Dict[str, str]:
    """feature -> its "weighted" cell, from inspect's feature table (header row "feature | table | ...")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("feature "))
    header = [c.strip() for c in lines[start].split("|")]
    column = header.index("weighted")
    table = {}
    for line in lines[start + 2:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) != len(header):
            break
        table[cells[0]] = cells[column]
    return table


def test_inspect_says_which_features_are_weighted(small_artifacts, tmp_path, capsys):
    assert main(["inspect", str(small_artifacts("emb"))]) == 0
    assert _weighted_column(capsys.readouterr().out) == {"x": "yes", "y": "yes", "z": "yes"}

    assert main(["inspect", str(small_artifacts("dlrm"))]) == 0
    dlrm = _weighted_column(capsys.readouterr().out)
    assert len(dlrm) == 26 and set(dlrm.values()) == {"no"}

    # per feature, as the manifest records it: the same artifact with y's ids unweighted
    mixed = tmp_path / "mixed"
    shutil.copytree(small_artifacts("emb"), mixed)
    manifest = json.loads((mixed / "manifest.json").read_text())
    for f in manifest["sparse_features"]:
        if f["name"] == "y":
            f["weighted"] = False
    (mixed / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(mixed)]) == 0
    assert _weighted_column(capsys.readouterr().out) == {"x": "yes", "y": "no", "z": "yes"}
