"""The package contract: layout, import names, import cost, the CLI."""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["sparse", "modules", "trainer", "quantize", "export", "serving"]


def _python_files():
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in {".venv", "build"} or any(p.endswith(".egg-info") for p in parts):
            continue
        yield path


def test_no_module_imports_a_bare_subpackage_name():
    offenders = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in SUBPACKAGES + ["torchrec"]:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert offenders == []


def test_every_python_folder_is_an_installed_subpackage():
    """`pip install .` ships only the packages pyproject lists: every folder must be there."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for top in SUBPACKAGES:
        assert config["package-dir"][f"recship.{top}"] == top
    expected = set()
    for top in ["recship"] + SUBPACKAGES:
        package = "recship" if top == "recship" else f"recship.{top}"
        for init in (ROOT / top).rglob("__init__.py"):
            expected.add(".".join((package,) + init.parent.relative_to(ROOT / top).parts))
    missing = sorted(expected - set(config["packages"]))
    assert missing == [], f"add these to [tool.setuptools] packages: {missing}"


def test_import_from_another_directory_is_fast_and_skips_fbgemm(tmp_path):
    code = (
        "import sys, time; t = time.process_time(); import recship, recship.serving, recship.trainer; "
        "print(time.process_time() - t); print('fbgemm_gpu' in sys.modules); print(recship.serving.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    seconds, fbgemm_loaded, serving_file = out.stdout.split()
    assert fbgemm_loaded == "False"
    assert Path(serving_file).parent.name == "serving"
    assert float(seconds) < 10


def test_datatype_converts_to_fbgemm_sparse_type():
    from recship.trainer import DataType, EmbeddingBagConfig

    for dt in DataType:
        if dt.is_table_type:
            assert dt.to_sparse_type().name == dt.name
        else:  # TorchRec's names for id / raw-byte / e4m3 dtypes: convertible, never a table's storage
            with pytest.raises(ValueError, match="not an embedding storage type"):
                EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=4, data_type=dt)
    assert [dt.name for dt in DataType if not dt.is_table_type] == ["INT64", "INT32", "UINT8", "NFP8"]
    assert DataType.parse("int4") is DataType.INT4
    with pytest.raises(ValueError, match="unknown data type 'int3'"):
        DataType.parse("int3")
    with pytest.raises(ValueError, match="quantized"):
        DataType.INT8.to_torch_dtype()


def test_cli_version_and_demo(tmp_path):
    env = dict(os.environ)
    version = subprocess.run([sys.executable, "-m", "recship", "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip().startswith("recship ")
    # into a temporary folder: the suite leaves runs/demo (the README's `make demo` folder) alone
    demo = subprocess.run([sys.executable, "-m", "recship", "demo", "--out", str(tmp_path / "demo")], capture_output=True, text=True, env=env)
    assert demo.returncode == 0, demo.stderr
    assert "demo finished: every check passed" in demo.stdout
    assert "torch.Size" not in demo.stdout and "(3, 128)" in demo.stdout


def test_cli_unknown_command_exits_2():
    out = subprocess.run([sys.executable, "-m", "recship", "nope"], capture_output=True, text=True)
    assert out.returncode == 2


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["--help"], 0), (["nope"], 2), ([], 2)])
def test_cli_answers_version_help_and_usage_errors_without_torch_in_under_a_second(argv, code):
    probe = (
        "import sys, time; t = time.process_time(); from recship.cli import main\n"
        "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
        "print('\\n@', rc, time.process_time() - t, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True)
    rc, seconds, torch_loaded = out.stdout.rsplit("@", 1)[1].split()
    assert (int(rc), torch_loaded) == (code, "False"), out.stderr
    assert float(seconds) < 1.0  # CPU seconds (a busy machine's wait for a core left out): 0.06 s here; torch alone takes ~2 s


def test_the_grpc_client_imports_without_torch():
    code = "import sys, recship.serving.client; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_every_flag_of_every_subcommand_says_what_it_does():
    import argparse

    from recship.cli import build_parser

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [
        f"recship {name} {'/'.join(a.option_strings) or a.dest}"
        for name, parser in subcommands.choices.items()
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction) and not a.help
    ]
    assert bare == []


def test_every_name_a_module_exports_exists():
    """``from recship.x import *`` works for every module: each name its ``__all__`` lists is defined there (a name
    listed but never imported fails only at a star import, far from its cause)."""
    import importlib

    from test_layers import _modules

    missing = []
    for name in _modules():
        if name.endswith("__main__"):  # the CLI's entry: it runs on import
            continue
        module = importlib.import_module(name)
        missing += [f"{name}.{n}" for n in getattr(module, "__all__", []) if not hasattr(module, n)]
    assert not missing, f"__all__ names that do not exist: {missing}"
