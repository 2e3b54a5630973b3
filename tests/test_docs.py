"""The docs a newcomer walks: the site (mkdocs.yml, docs/) builds with mkdocs --strict (no broken link or anchor),
the README stays a short landing page whose links all land, and every fenced block of the README and docs/ is run
by a test or says why it is only shown (tests/doc_blocks.py defines the markers). The README's CLI quick start and
the pages' small Python blocks run here."""

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from markdown.extensions.toc import slugify

from doc_blocks import ROOT, Block, all_blocks, doc_block, doc_blocks, pages
from quick_start import run_quick_start

README_LINES = 250
SHELL = {"", "sh", "bash", "console"}


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=120)


def test_the_site_builds_strictly(tmp_path):
    done = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "torchrec" / "index.html").exists()


@pytest.mark.parametrize("link", ["[gone](nowhere.md)", "[gone](serving.md#no-such-heading)", "[gone](#no-such-heading)"])
def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path, link):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + f"\n{link}\n")
    done = _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0, f"mkdocs --strict took {link}"
    assert "nowhere.md" in done.stderr or "no-such-heading" in done.stderr, done.stderr


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f": {page.name}" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


def _anchors(page: Path) -> List[str]:
    headings = re.findall(r"^#{1,6} (.+?)\s*$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return [slugify(h, "-") for h in headings]


def test_the_readme_is_short_and_its_links_land():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES, f"README.md has {len(text.splitlines())} lines; keep it under {README_LINES}"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local), "the README links to no page of docs/"
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"README.md links to {link}: {path or 'README.md'} has no heading '{anchor}'"


def test_the_readme_keeps_the_two_commands_and_ci():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text and "make test-fast" in text and ".ci/run" in text



def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError):  # a name inside a module (recship.distributed.RowWiseAdagrad)
        return False


def test_every_recship_name_the_pages_give_exists():
    """Each code span that is a dotted recship name (``recship.quantize.flat.FlatPooledLookup``, an entry point
    ``recship.models:dlrm``) imports and resolves: a moved or renamed name fails here, not in a reader's shell."""
    import importlib

    names = {(m.group(1), m.group(2) or "", page.name) for page in pages()
             for m in re.finditer(r"`(recship(?:\.\w+)+)(?::(\w+))?`", page.read_text())}
    assert len(names) > 30
    wrong = []
    for dotted, attr, page in sorted(names):
        if dotted.endswith(".json"):  # a file's name (the checkpoint's recship.json), not a module
            continue
        parts = dotted.split(".")
        found = next(i for i in range(len(parts), 0, -1) if _is_module(".".join(parts[:i])))
        obj = importlib.import_module(".".join(parts[:found]))
        for part in parts[found:] + ([attr] if attr else []):
            obj = getattr(obj, part, None)
        if obj is None:
            wrong.append(f"{page}: {dotted}{':' + attr if attr else ''}")
    assert not wrong, f"names the docs give that recship does not have: {wrong}"


def commands(block: Block) -> List[List[str]]:
    """What a test running a shell block's commands must name, per command: the program (recship's subcommand, a
    script, ``-m`` module, or the tool's name) and every flag it gives."""
    text = re.sub(r"\\\n", " ", block.text)
    out = []
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in a pasted line: fall back to plain words
            words = line.split("#")[0].split()
        segment: List[str] = []
        for word in [*words, ";"]:
            if word not in {"|", "&", "&&", ";", "||"}:
                segment.append(word)
                continue
            if segment:
                out.append(_names(segment))
            segment = []
    return out


def _names(words: List[str]) -> List[str]:
    env = []
    while len(words) > 1 and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the program
        env.append(words[0].split("=")[0])
        words = words[1:]
    program = os.path.basename(words[0])
    flags = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    if program == "recship" and len(words) > 1:
        return [*env, words[1], *flags]
    if program.startswith("python") or program == "torchrun":
        if "-c" in words:  # inline code: only the interpreter to name
            return [*env, program]
        rest = [w for w in words[1:] if not w.startswith("-")]
        module = words[words.index("-m") + 1] if "-m" in words else None
        return [*env, module or (rest[0] if rest else program), *flags]
    return [*env, program, *flags]


def _test_source(test: str) -> str:
    """The source of the module ``tests/x.py`` of ``tests/x.py::test_y``, after checking that it defines test_y."""
    path, _, name = test.partition("::")
    file = ROOT / path
    assert path.startswith("tests/") and file.is_file(), f"no test file {path}"
    source = file.read_text()
    defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert name in defined, f"{path} defines no {name}"
    return source


def test_every_block_is_run_by_a_test_or_marked_illustrative():
    unmarked = [b.where() for b in all_blocks() if b.kind is None]
    assert not unmarked, f"code blocks without a marker (<!-- tested-by: ... --> or <!-- illustrative: why -->): {unmarked}"
    for block in all_blocks():
        if block.kind == "illustrative":
            assert len(block.value) > 10, f"{block.where()}: say why the block is only illustrative"
            continue
        source = _test_source(block.value)
        if "doc_block" in source and block.value in source:  # the test reads the block by its marker
            continue
        assert block.lang in SHELL, f"{block.where()}: {block.value} must read this {block.lang} block with doc_block"
        for names in commands(block):
            absent = [n for n in names if n not in source]
            assert not absent, f"{block.where()}: {block.value} does not run {' '.join(names)} ({absent} not in it)"


def test_the_marker_check_tells_a_command_from_another():
    block = Block("README.md", 1, "", "recship export ckpt --model-repo r --model-name m   # a comment --no\n"
                  "python -c 'print(1)' | recship predict --request -\nX_Y=1 pip wheel --no-deps -w dist .\n", "tested-by", "x")
    assert commands(block) == [["export", "--model-repo", "--model-name"], ["python"], ["predict", "--request"],
                               ["X_Y", "pip", "--no-deps"]]


# -- blocks run here ----------------------------------------------------------------------------------------------


def _expected_prints(code: str) -> List[str]:
    """The output a block shows: the comment after each ``print(...)`` line, in order."""
    return [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+# (.+)$", code, re.M)]


PYTHON = "tests/test_docs.py::test_python_block_runs_as_shown"


@pytest.mark.parametrize("block", doc_blocks(PYTHON), ids=lambda b: b.where())
def test_python_block_runs_as_shown(block, tmp_path):
    """Each Python block marked for this test runs as pasted (seeded) and prints what its comments show."""
    code = "import torch\ntorch.manual_seed(0)\n" + block.text
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = iter(done.stdout.splitlines())
    for want in _expected_prints(block.text):  # each shown output is a line of stdout, in the order shown
        assert any(line == want for line in lines), f"{block.where()}: no line {want!r} in order in:\n{done.stdout}"


def test_readme_quick_start_runs_from_an_installed_package(tmp_path):
    """The README's CLI quick start, pasted into bash in an empty folder (only the installed package's commands on
    PATH; its ports swapped for free ones): train, export into a repository, serve, ask over REST and gRPC, stop.
    tests/test_wheel.py runs it from the wheel and the sdist too."""
    run_quick_start(Path(sys.executable).parent, tmp_path, os.environ)


def test_the_serve_config_example_sets_those_flags(tmp_path):
    """docs/serving.md's serve.yaml, read as `recship serve --config` reads it: every key lands on its flag."""
    from recship.cli import build_parser, subcommand_parser
    from recship.flags import apply_config_file

    config = tmp_path / "serve.yaml"
    config.write_text(doc_block("tests/test_docs.py::test_the_serve_config_example_sets_those_flags"))
    parser = build_parser("serve")
    apply_config_file(subcommand_parser(parser, "serve"), str(config))
    args = parser.parse_args(["serve"])
    assert (args.model_repo, args.host, args.http_port, args.metrics_port, args.max_delay_ms, args.front) == (
        "/models", "0.0.0.0", 8000, 9100, 1.0, "cpp")


def test_the_model_config_example_reads_as_shown():
    """docs/serving.md's per-model config.yaml, read by the server's reader over the default settings."""
    from recship.serving.settings import ModelSettings, VersionPolicy, read_model_config

    text = doc_block("tests/test_docs.py::test_the_model_config_example_reads_as_shown")
    s = read_model_config("config.yaml", text, ModelSettings(512, 0.0, True, 1024, None))
    assert (s.max_batch_size, s.max_delay_ms, s.max_queue, s.version_policy) == (64, 0.5, 256, VersionPolicy("latest", 2))
    assert dict(s.id_policy) == {"cat_0": "modulo", "cat_1": "reject"}


def test_loading_an_artifact_without_recship_runs_as_shown(small_artifact, tmp_path):
    """docs/export.md's recipe, on an exported DLRM, in a process that imports no recship: the filled model.pt gives
    the artifact's recorded sample outputs exactly."""
    recipe = doc_block("tests/test_docs.py::test_loading_an_artifact_without_recship_runs_as_shown")
    shown = 'art = "runs/demo/repo/dlrm/1"'
    assert shown in recipe
    check = """
import numpy as np
manifest = json.load(open(f"{art}/manifest.json"))
def read(spec):
    dtype = {"float32": "<f4", "int32": "<i4", "int64": "<i8"}[spec["dtype"]]
    return torch.from_numpy(np.fromfile(f"{art}/{spec['file']}", dtype=dtype).reshape(spec["shape"]))
inputs = {k: read(v) for k, v in manifest["sample"]["inputs"].items()}
outputs = model(inputs["dense"], inputs["lengths"], inputs["values"], inputs.get("weights"))
for name, spec in manifest["sample"]["outputs"].items():
    assert torch.equal(outputs[name], read(spec)), name
import sys
assert not [m for m in sys.modules if m.startswith("recship")]
print("ok")
"""
    code = recipe.replace(shown, f"art = {str(small_artifact)!r}") + check
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
