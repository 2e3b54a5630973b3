"""recship.contract: a leaf package (no torch, numpy or other recship module), its schema the one definition both
loaders obey (shared vectors, answered alike by Python and by the C++ loader, word for word), and the repository
layout's version folders."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recship.contract.manifest import ArtifactError, Manifest, check_manifest
from recship.contract.repository import parse_version, version_folders
from recship.contract.rules import first_broken
from recship.contract.schema import KEYWORDS, problems, schema
from recship.contract.tables import shard_name, split_shard, split_table_name, table_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_vectors import BASES, CASES, apply, base, cases  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODULES = ["recship.contract", "recship.contract.manifest", "recship.contract.repository", "recship.contract.rules",
           "recship.contract.schema", "recship.contract.tables"]


@pytest.mark.parametrize("cwd", ["checkout", "elsewhere"])
def test_importing_the_contract_loads_no_torch_numpy_nor_other_recship_module(tmp_path, cwd):
    """From the source checkout (its recship/ first on sys.path) and from elsewhere (the installed package: here the
    editable install; tests/test_wheel.py checks the wheel carries the schema): the schema loads as package data."""
    code = ("import json, sys, recship; before = set(sys.modules)\n"
            f"for name in {MODULES!r}: __import__(name)\n"
            "from recship.contract.schema import schema\n"
            "assert schema()['title'].startswith('recship artifact manifest')\n"
            "print(json.dumps([sorted(set(sys.modules) - before), sys.modules['recship.contract'].__file__]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT if cwd == "checkout" else tmp_path)
    assert done.returncode == 0, done.stderr
    loaded, file = json.loads(done.stdout)
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "numpy", "fbgemm_gpu")], loaded
    assert [m for m in loaded if m.startswith("recship")] == sorted(MODULES)
    assert Path(file) == ROOT / "recship" / "contract" / "__init__.py"


def test_the_schema_uses_only_keywords_both_loaders_know():
    """schema.py has words for each keyword (KEYWORDS); the C++ interpreter knows the same set and refuses others."""
    used, patterned = set(), []

    def walk(node):
        if isinstance(node, dict):
            used.update(node)
            if "pattern" in node:
                patterned.append(node)
            for key, value in node.items():
                if key in ("properties", "$defs"):
                    for sub in value.values():
                        walk(sub)
                elif key in ("prefixItems", "allOf"):
                    for sub in value:
                        walk(sub)
                elif key in ("items", "if", "then", "else", "additionalProperties"):
                    walk(value)

    walk(schema())
    assert used <= KEYWORDS, used - KEYWORDS
    assert all("maxLength" in node for node in patterned), patterned  # the reading both loaders need (schema.py)
    cpp = (ROOT / "cpp_loader" / "src" / "schema.cpp").read_text()
    block = re.search(r"kKeywords = \{(.*?)\};", cpp, re.S).group(1)
    assert set(re.findall(r'"([^"]+)"', block)) == KEYWORDS
    assert schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_the_vectors_are_current():
    """tests/contract/vectors/cases.json is what make_vectors.py makes (run it after changing the schema or a base)."""
    assert json.loads(CASES.read_text()) == cases()


def _answer(manifest):
    """recship.contract's answer: every schema problem, or else the first broken rule."""
    found = problems(manifest)
    if not found:
        broken = first_broken(manifest)
        found = [broken] if broken is not None else []
    return [{"pointer": p.pointer, "rule": p.rule, "message": p.message} for p in found]


def test_python_answers_every_vector():
    wrong = []
    for case in json.loads(CASES.read_text()):
        answer = [(p["pointer"], p["rule"]) for p in _answer(apply(base(case["base"]), case["patch"]))]
        expect = case["expect"]
        if (answer != []) if expect is None else ((expect["pointer"], expect["rule"]) not in answer):
            wrong.append((case["name"], expect, answer[:3]))
    assert wrong == [], wrong[:5]


def test_a_refusal_names_the_file_the_field_and_how_many_more():
    raw = base("dlrm")
    raw["sparse_features"][3]["rows"] = 0
    with pytest.raises(ArtifactError, match=r"^art/manifest.json: sparse_features\[3\]\.rows must be >= 1$"):
        check_manifest(raw, "art")
    del raw["num_dense"]
    raw["sharding"]["device"] = "tpu"
    with pytest.raises(ArtifactError, match=r"^art/manifest.json: num_dense is missing \(and 2 more\)$"):
        check_manifest(raw, "art")


def _cpp_answers(binary, manifests, tmp_path):
    """recship_check_manifest's answers (built beside recship_predict), with the error Model::load would raise."""
    files = []
    for i, m in enumerate(manifests):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "manifest.json").write_text(json.dumps(m))
        files.append(tmp_path / str(i) / "manifest.json")
    done = subprocess.run([binary.parent / "recship_check_manifest", *files], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return files, [json.loads(line) for line in done.stdout.splitlines()]


def _python_error(manifest, folder):
    try:
        check_manifest(manifest, folder)
    except ArtifactError as e:
        return str(e)
    return None


def _assert_alike(binary, manifests, names, tmp_path):
    files, answers = _cpp_answers(binary, manifests, tmp_path)
    assert len(answers) == len(manifests)
    differ = [(name, _answer(m)[:2], cpp["problems"][:2]) for name, m, cpp in zip(names, manifests, answers)
              if cpp["problems"] != _answer(m) or cpp["error"] != _python_error(m, str(Path(cpp["file"]).parent))]
    assert differ == [], differ[:3]


def test_cpp_answers_every_vector_as_python_does(binary, tmp_path):
    """Every vector: the same problems (field, rule, words, order) and the same refusal from both loaders."""
    vectors = json.loads(CASES.read_text())
    _assert_alike(binary, [apply(base(c["base"]), c["patch"]) for c in vectors], [c["name"] for c in vectors], tmp_path)


def _mutations(m, rng, count):
    """``count`` random edits of a valid manifest: a field anywhere removed, or set to a random JSON value."""
    values = [None, True, False, 0, -1, 1, 7, 2**63, 2**63 - 1, 1.0, 2.5, "", "x", "B", "float32", "recship.artifact/1", "0" * 64,
              [], [1], ["B", 1], {}, {"x": 1}]
    paths = []

    def walk(value, where):
        paths.append(where)
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
        for key, child in children:
            walk(child, where + (key,))

    walk(m, ())
    out = []
    for _ in range(count):
        edited = json.loads(json.dumps(m))
        where = rng.choice(paths[1:])
        parent = edited
        for key in where[:-1]:
            parent = parent[key]
        if rng.random() < 0.2:
            del parent[where[-1]]
        else:
            parent[where[-1]] = rng.choice(values)
        out.append((f"{'/'.join(map(str, where))}", edited))
    return out


def test_very_long_strings_are_refused_alike_without_a_crash(binary, tmp_path):
    """Strings far past their maxLength (the C++ regex engine would overflow its stack on them): refused by length."""
    manifests = []
    for where in (("op_libraries", 0), ("sample", "inputs", "dense", "file"), ("model_sha256",)):
        for text in ("a" * 1_000_000, "/" + "\\" * 1_000_000):
            m = base("dlrm")
            parent = m
            for key in where[:-1]:
                parent = parent[key]
            parent[where[-1]] = text
            assert [p.rule for p in problems(m) if p.where == where] == ["maxLength"]
            manifests.append(m)
    _assert_alike(binary, manifests, [str(i) for i in range(len(manifests))], tmp_path)


@pytest.mark.parametrize("name", BASES)
def test_cpp_and_python_agree_on_random_mutations(binary, tmp_path, name):
    rng = random.Random(39)
    mutated = _mutations(base(name), rng, 400)
    _assert_alike(binary, [m for _, m in mutated], [w for w, _ in mutated], tmp_path)


def test_exported_manifests_keep_the_contract(small_artifacts):
    for path in (small_artifacts(), small_artifacts("emb", "int4", "cpu", "torchscript", 2)):
        raw = json.loads((path / "manifest.json").read_text())
        assert _answer(raw) == []
        assert Manifest.from_dict(raw).to_dict() == raw


def test_table_names_read_back():
    assert split_table_name(table_name("sparse_arch.ebc", "t_cat_0")) == ("sparse_arch.ebc", "t_cat_0")
    assert split_table_name(table_name("", "a")) == ("", "a")
    assert split_shard(shard_name("t_cat_0", 3)) == ("t_cat_0", 3)
    assert split_shard("a@b") == ("a@b", None) and split_shard("a@") == ("a@", None) and split_shard("a@²") == ("a@²", None)


def test_version_folders(tmp_path):
    """A model folder as a server scans it (next_version and publishing: tests/export/test_export_repo.py)."""
    for name in ["1", "7", "latest", ".version.tmp-0a1b2c3d", ".99", "²", "12a"]:
        (tmp_path / name).mkdir()
    (tmp_path / "3").write_text("a file, not a version")
    versions, others = version_folders(tmp_path)
    assert [v for v, _ in versions] == [7, 1] and versions[0][1] == tmp_path / "7"
    assert others == ["12a", "latest", "²"]
    assert [parse_version(n) for n in ("0", "18", "1" * 18, "1" * 19, "+1", " 1", "1.0")] == [0, 18, int("1" * 18), None, None, None, None]


def test_the_table_dtypes_are_the_schemas_with_torchs_sizes():
    """One list of dtype names (the schema's enum); the contract's sizes and export's torch types agree with it."""
    import torch

    from recship.contract.tables import DTYPE_SIZES
    from recship.export.tables import DTYPES

    names = schema()["$defs"]["table_tensor"]["properties"]["dtype"]["enum"]
    assert sorted(DTYPE_SIZES) == sorted(DTYPES) == sorted(names)
    assert {n: torch.empty((), dtype=DTYPES[n]).element_size() for n in names} == DTYPE_SIZES
