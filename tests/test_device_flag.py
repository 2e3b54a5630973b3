"""``--device``: the same choices (cpu, cuda, auto) and meaning (auto: cuda where torch sees a GPU, else cpu) in
``recship train``, ``recship export`` and ``recship serve``."""

import pytest
import torch

from recship.cli import build_parser, main
from recship.export.config import ExportConfig
from recship.serving.cli import config_from_args
from recship.serving.settings import ServerConfig
from recship.trainer.config import TrainConfig

COMMANDS = {"train": ["train"], "export": ["export", "ckpt", "--out", "o"], "serve": ["serve", "--model-repo", "r"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("device", ["cpu", "cuda", "auto"])
def test_every_command_takes_the_same_devices(command, device):
    parsed = build_parser().parse_args(COMMANDS[command] + ["--device", device])
    assert parsed.device == device


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unknown_device_is_refused_naming_it(command, capsys):
    try:
        code = main(COMMANDS[command] + ["--device", "tpu"])
    except SystemExit as e:  # argparse's own choices check (serve)
        code = e.code
    assert code == 2
    assert "'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_is_cuda_where_torch_sees_a_gpu_else_cpu(gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    want = "cuda" if gpu else "cpu"
    assert TrainConfig(device="auto").use_cuda() is gpu
    assert ServerConfig(model_repo=str(tmp_path), device="auto").device == want
    args = build_parser().parse_args(["serve", "--model-repo", str(tmp_path), "--device", "auto"])
    assert config_from_args(args).device == want
    if not gpu:  # ExportConfig checks that the cuda shards it asks for exist
        assert ExportConfig(out=str(tmp_path / "o"), device="auto").device == "cpu"


def test_auto_resolves_to_cpu_here_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert ServerConfig(model_repo=str(tmp_path), device="auto").device == "cpu"
    assert ExportConfig(out=str(tmp_path / "o"), device="auto").device == "cpu"
    assert TrainConfig(device="auto").use_cuda() is False


def test_an_unknown_device_in_a_config_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="'tpu'"):
        ServerConfig(model_repo=str(tmp_path), device="tpu")
    with pytest.raises(ValueError, match="'tpu'"):
        ExportConfig(out=str(tmp_path / "o"), device="tpu")
