"""The batching defaults Python and C++ both need are written once per language and held equal here: the server's
(serving/settings.py) and the C++ loader's and front's (cpp_loader/include/recship/model.h, which the front's batcher
and recship_predict take them from); recship_predict's --help shows the same value."""

import re
from pathlib import Path

from recship.serving.batcher import Batcher
from recship.serving.settings import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE, ServerConfig

HEADER = Path(__file__).resolve().parents[2] / "cpp_loader" / "include" / "recship" / "model.h"


def _cpp_constant(name: str) -> int:
    found = re.findall(rf"inline constexpr int64_t {name} = (\d+);", HEADER.read_text())
    assert len(found) == 1, f"{name} is defined {len(found)} times in {HEADER}"
    return int(found[0])


def test_python_and_cpp_share_the_batching_defaults():
    assert _cpp_constant("kDefaultMaxBatchSize") == DEFAULT_MAX_BATCH_SIZE
    assert _cpp_constant("kDefaultMaxQueue") == DEFAULT_MAX_QUEUE
    config = ServerConfig(model_repo="unused")
    assert (config.max_batch_size, config.max_queue) == (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE)
    import inspect

    defaults = inspect.signature(Batcher.__init__).parameters
    assert (defaults["max_batch_size"].default, defaults["max_queue"].default) == (DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE)


def test_no_cpp_source_spells_the_defaults_again():
    """Every other C++ place takes the constants (a literal 512 / 1024 beside max_batch_size / max_queue is a copy)."""
    root = HEADER.parents[2]
    copies = [f"{p.relative_to(root)}:{n}: {line.strip()}" for p in sorted(root.rglob("*")) if p.suffix in (".h", ".cpp", ".cc")
              for n, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"max_(batch_size|queue)\s*=\s*\d+|default (512|1024)\b", line)]
    assert copies == []
