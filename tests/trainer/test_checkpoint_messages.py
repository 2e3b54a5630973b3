"""A folder that is no checkpoint to read says why in its own words: one still being written (or a save or copy cut
short) names what it has and what is missing; an empty or unrelated folder is not a checkpoint. Both used to get
"has no recship.json and no TorchRec table ..." or "recship.json is missing", which read as the wrong kind of file."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from recship.cli import main
from recship.trainer.checkpoint_reader import CheckpointError, CheckpointReader, quiet_dcp, read_metadata


@pytest.fixture(scope="module")
def dcp_files(tmp_path_factory):
    """DCP's files of a save in recship's layout (tables/<module>/<table>/weight, dense/<key>), before recship.json."""
    folder = tmp_path_factory.mktemp("ckpt") / "dcp"
    g = torch.Generator().manual_seed(0)
    state = {"tables/sparse_arch.embedding_bag_collection/t_0/weight": torch.randn(10, 4, generator=g),
             "dense/over_arch.weight": torch.randn(1, 4, generator=g)}
    quiet_dcp(dcp.save, state, checkpoint_id=str(folder), no_dist=True)
    assert (folder / ".metadata").is_file() and list(folder.glob("*.distcp"))
    return folder


def _errors(path):
    """The messages of both readers: read_metadata (resume) and CheckpointReader (export)."""
    out = []
    for read in (read_metadata, CheckpointReader):
        with pytest.raises(CheckpointError) as e:
            read(path)
        out.append(str(e.value))
    return out


def test_a_checkpoint_being_written_names_what_is_missing(dcp_files, tmp_path):
    data = shutil.copytree(dcp_files, tmp_path / "step_00000004")  # the data files written, DCP's .metadata not yet
    (data / ".metadata").unlink()
    for message in _errors(data):
        assert message == (f"{data} looks incomplete or still being written: it has DCP's data files (__0_0.distcp) but not "
                           "DCP's .metadata, written after them, nor recship.json"), message

    saved = shutil.copytree(dcp_files, tmp_path / "step_00000008.tmp-1234abcd")  # DCP done, recship.json not yet
    for message in _errors(saved):
        assert message == (f"{saved} looks incomplete or still being written (a save writes step_N.tmp-<id> and renames it "
                           "step_N once complete): recship.json is missing (a save writes it last, after DCP's files)"), message

    started = tmp_path / "step_00000012.tmp-5678abcd"
    started.mkdir()
    for message in _errors(started):
        assert "looks incomplete or still being written" in message and "nothing of it is written yet" in message, message


def test_an_empty_or_unrelated_folder_is_not_a_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for message in _errors(empty):
        assert message == f"{empty} is not a checkpoint: it is empty", message
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint")
    for message in _errors(other):
        assert message == f"{other} is not a checkpoint: it has no recship.json, no DCP .metadata and no DCP data file (*.distcp)"
        assert "still being written" not in message


def test_export_of_a_checkpoint_being_written_says_so_in_one_line(dcp_files, tmp_path, capsys):
    saved = shutil.copytree(dcp_files, tmp_path / "step_00000004")
    assert main(["export", str(saved), "--out", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "looks incomplete or still being written: recship.json is missing" in err, err
    assert "TorchRec table" not in err
