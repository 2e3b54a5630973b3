"""The serving rules are defined once (protos/recship/serving/v1/serving_rules.json) and generated for both languages:
recship.serving.v1.serving_rules (serving/codegen.py) for the Python server, recship/serving_rules.h
(cpp_loader/CMakeLists.txt) for the C++ loader and front. These checks fail on a stale or hand-made copy."""

import json
import math
import re
from pathlib import Path

from recship.serving import rules
from recship.serving.batcher import Batcher
from recship.serving.settings import SERVER_FIELDS, ServerConfig

ROOT = Path(__file__).resolve().parents[2]
SPEC = json.loads((ROOT / "protos" / "recship" / "serving" / "v1" / "serving_rules.json").read_text())


def test_the_python_rules_are_the_json_generated_now(tmp_path):
    import recship.serving.codegen as codegen

    fresh = codegen.rules_module(tmp_path)
    namespace: dict = {}
    exec(fresh.read_text(), namespace)
    from recship.serving.v1.serving_rules import RULES

    assert RULES == namespace["RULES"] == {k: v for k, v in SPEC.items() if k != "$comment"}


def test_the_server_takes_its_defaults_bounds_and_words_from_the_rules():
    config = ServerConfig(model_repo="unused")
    for name, rule in SPEC["settings"].items():
        limit, f = rules.LIMITS[name], SERVER_FIELDS[name]
        assert getattr(config, name) == rule["default"] == limit.default, name
        check = f.metadata["range"]
        assert (check.lo, check.hi, check.integer) == (rule["min"], rule.get("max", math.inf), rule.get("integer", False)), name
        assert f.metadata["help"] == rule["help"], name
        assert rule.get("violation") is None or rule["violation"] in SPEC["refusals"], name
    import inspect

    defaults = inspect.signature(Batcher.__init__).parameters
    assert (defaults["max_batch_size"].default, defaults["max_queue"].default) == (SPEC["settings"]["max_batch_size"]["default"],
                                                                                  SPEC["settings"]["max_queue"]["default"])


def test_the_cpp_header_is_generated_from_the_rules(binary):
    """`binary` builds the C++ loader, which generates recship/serving_rules.h: include/ in its build folder, or in the
    install prefix beside bin/ (the wheel's recship/_cpp)."""
    (header,) = [h for h in (binary.parent / "include", binary.parent.parent / "include") if (h / "recship" / "serving_rules.h").is_file()]
    header = (header / "recship" / "serving_rules.h").read_text()
    constants = dict(re.findall(r"inline constexpr \w+ (k\w+) = ([0-9.e+-]+);", header))
    want = {"kTensorCopies": SPEC["tensor_copies"]}
    for name, rule in SPEC["settings"].items():
        camel = "".join(w.capitalize() for w in name.split("_"))
        want.update({f"k{camel}{field.capitalize()}": rule[field] for field in ("default", "min", "max") if field in rule})
    assert {k: float(v) for k, v in constants.items()} == {k: float(v) for k, v in want.items()}
    assert re.findall(r'inline constexpr char kUnroutedLabel\[\] = "(.*)";', header) == [SPEC["statistics"]["unrouted_label"]]


def test_no_source_spells_a_rule_again():
    """Every C++ and serving/ source takes the rules (a literal default beside its setting's name is a copy)."""
    sources = [p for p in sorted((ROOT / "cpp_loader").rglob("*")) if p.suffix in (".h", ".cpp", ".cc")]
    sources += sorted((ROOT / "serving").glob("*.py"))
    pattern = r"max_(batch_size|queue|delay_ms|message_bytes|inflight_bytes)\s*=\s*[0-9(]|default (512|1024)\b|\b(64|256) << 20"
    copies = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sources
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert copies == []
