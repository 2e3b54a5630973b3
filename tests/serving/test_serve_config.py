"""`recship serve --config FILE`: every flag from YAML or JSON, command-line flags winning, bad keys refused."""

import json
import subprocess
import sys

import pytest

from recship.cli import build_parser, subcommand_parser
from recship.flags import apply_config_file
from recship.serving.cli import config_from_args
from recship.serving.settings import ServerConfig


def _parse(argv, config=None):
    parser = build_parser("serve")
    if config is not None:
        apply_config_file(subcommand_parser(parser, "serve"), str(config))
    return parser.parse_args(["serve", *argv])


def _flags():
    """Every flag of `recship serve` but --config and --help, by dest."""
    sub = subcommand_parser(build_parser("serve"), "serve")
    return {a.dest: a for a in sub._actions if a.option_strings and a.dest not in ("help", "config")}


def test_every_flag_can_come_from_the_file_in_either_spelling(tmp_path):
    values = {
        "model-repo": str(tmp_path), "host": "0.0.0.0", "port": 9001, "metrics_port": 9002, "metrics-host": "127.0.0.2",
        "http_port": 9003, "max-batch-size": 77, "max_delay_ms": 0.5, "batching": False, "max-queue": 9, "poll-interval": 0.7, "drain-delay": 1.5,
        "torch_threads": 1, "max-message-mb": 3.0, "max_inflight_mb": 5.0, "device": "cpu", "log-format": "text",
        "reflection": False, "model_format": "torchscript", "front": "cpp", "trusted-sha256": "allow.txt",
        "tls-cert": "c.pem", "tls_key": "k.pem", "tls-client-ca": "ca.pem", "model-control": "explicit", "load_model": ["a", "b"],
    }
    assert {k.replace("-", "_") for k in values} == set(_flags()), "the test names every flag of recship serve"
    config = tmp_path / "serve.yaml"
    import yaml

    config.write_text(yaml.safe_dump(values))
    args = _parse([], config)
    for key, value in values.items():
        assert getattr(args, key.replace("-", "_")) == value, key
    as_json = tmp_path / "serve.json"
    as_json.write_text(json.dumps(values))
    assert vars(_parse([], as_json)) == vars(args)


def test_command_line_flags_override_the_file_and_defaults_fill_the_rest(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model-repo: {tmp_path}\nmax-batch-size: 64\nport: 9001\n")
    args = _parse(["--port", "9100", "--max-delay-ms", "1"], config)
    assert (args.port, args.max_batch_size, args.max_delay_ms, args.max_queue) == (9100, 64, 1.0, 1024)
    got = config_from_args(args)
    assert (got.model_repo, got.port, got.max_batch_size, got.max_delay_ms) == (str(tmp_path), 9100, 64, 1.0)
    assert got.max_queue == ServerConfig(model_repo="x").max_queue


@pytest.mark.parametrize("text, message", [
    ("bogus: 1\n", "unknown key 'bogus'; the keys are these flags:"),
    ("front: go\n", "front: --front must be one of python, cpp, got 'go'"),
    ("port: abc\n", "port: --port takes an integer, got 'abc'"),
    ("batching: 'no'\n", "batching: --batching takes true or false, got 'no'"),
    ("- port\n", "expected a mapping of flags to values, got list"),
    ("port: [1, 2]\n", "port: --port takes an integer, got [1, 2]"),
    ("model-control: manual\n", "model-control: --model-control must be one of poll, explicit, got 'manual'"),
    ("port: 1\n  bad indent: x\n", "not valid YAML"),
])
def test_bad_files_are_refused_with_the_key_named(tmp_path, text, message):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    with pytest.raises(ValueError) as e:
        _parse([], config)
    assert message in str(e.value)


def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max-batch-size: lots\n")
    result = subprocess.run([sys.executable, "-m", "recship.cli", "serve", "--config", str(config)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"recship serve: error: --config {config}: max-batch-size: --max-batch-size takes an integer, got 'lots'"
    missing = subprocess.run([sys.executable, "-m", "recship.cli", "serve", "--config", str(tmp_path / "nope.yaml")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no such file" in missing.stderr
    no_repo = subprocess.run([sys.executable, "-m", "recship.cli", "serve"], capture_output=True, text=True)
    assert no_repo.returncode == 2 and "--model-repo" in no_repo.stderr  # still required without a file


def test_serve_help_is_quick_and_imports_no_torch():  # (grpc it may: recship.serving's client needs it)
    code = ("import sys, time; t = time.process_time(); from recship.cli import build_parser; build_parser('serve').format_help(); "
            "print(time.process_time() - t, 'torch' in sys.modules)")  # CPU seconds: a busy machine's wait for a core left out
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 1.0 and out[1] == "False"
