"""The five TorchRec tutorials in ../shared/seeds/ run on recship and print what the tutorials show.

Each test runs one tutorial, every code cell in notebook order in a fresh interpreter
(tutorials/notebook.py), and asserts (a) that every cell ran without error and (b) that the
printed shapes and values match what the tutorial text shows, parsed from the seed now and
never copied into this file. One failure message lists every failing cell and every mismatch;
``python -m tests.tutorials.notebook N --show`` prints a tutorial's cells with their output.
"""

import ast
import difflib
import math
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from tutorials.notebook import CellResult, Tutorial, extract, run, seed_path

SHARDING_TYPES = {"table_wise", "row_wise", "column_wise", "data_parallel"}


def _failures(results: List[CellResult]) -> List[str]:
    return [f"{r.title}: {r.status}: {r.error_line}" for r in results if r.status in ("error", "not run")]


# --- sharding plans ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    """One table's plan, without the compute kernel (named 'batched_fused' or 'fused' by TorchRec version)."""

    sharding_type: str
    ranks: Tuple[int, ...]
    shards: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...], str], ...]  # (offsets, sizes, placement as 'rank:R/device')


def _placement(text: str) -> str:
    """'rank:1/cuda:1' -> 'rank:1/cpu': the tutorials ran on GPUs, the tests on the CPU."""
    found = re.fullmatch(r"rank:(\d+)/(\w+)(:\d+)?", text.strip())
    assert found, f"not a placement: {text!r}"
    return f"rank:{found.group(1)}/{'cpu' if found.group(2) == 'cuda' else found.group(2)}"


def _call_value(node: ast.AST):
    """A printed dataclass tree (ParameterSharding(...), ShardMetadata(...)) as dicts and lists."""
    if isinstance(node, ast.Call):
        return {kw.arg: _call_value(kw.value) for kw in node.keywords}
    if isinstance(node, ast.Dict):
        return {_call_value(k): _call_value(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.List):
        return [_call_value(e) for e in node.elts]
    return ast.literal_eval(node)


def _dict_plan(text: str) -> Dict[str, Sharding]:
    """The sharding tutorial's printout: {'': {'large_table_0': ParameterSharding(sharding_type=..., ...)}}."""
    text = text.lstrip()
    depth, end = 0, 0
    for end, c in enumerate(text):
        depth += (c == "{") - (c == "}")
        if depth == 0:
            break
    quoted = re.sub(r"placement=(rank:\d+/[\w:]+)", r"placement='\1'", text[: end + 1])
    plan = {}
    for module in _call_value(ast.parse(quoted, mode="eval").body).values():
        for name, ps in module.items():
            shards = (ps["sharding_spec"] or {}).get("shards", [])
            plan[name] = Sharding(
                ps["sharding_type"],
                tuple(ps["ranks"]),
                tuple((tuple(s["shard_offsets"]), tuple(s["shard_sizes"]), _placement(s["placement"])) for s in shards),
            )
    return plan


def _table_plan(text: str) -> Dict[str, Sharding]:
    """TorchRec's newer printout (recship prints it too): 'param | sharding type | compute kernel | ranks'
    rows, then 'param | shard offsets | shard sizes | placement' rows."""
    types: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    shards: Dict[str, list] = {}
    table = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) != 4:
            table = None
        elif cells[:2] in (["param", "sharding type"], ["param", "shard offsets"]):
            table = cells[1]
        elif table and not all(set(c) <= {"-"} for c in cells):
            if table == "sharding type":
                types[cells[0]] = (cells[1], tuple(ast.literal_eval(cells[3])))
            else:
                shards.setdefault(cells[0], []).append((tuple(ast.literal_eval(cells[1])), tuple(ast.literal_eval(cells[2])), _placement(cells[3])))
    return {name: Sharding(t, ranks, tuple(shards.get(name, []))) for name, (t, ranks) in types.items()}


def _plan(text: str) -> Dict[str, Sharding]:
    return _dict_plan(text) if text.lstrip().startswith("{") else _table_plan(text)


def _rank_plans(text: str) -> Iterator[Tuple[int, Dict[str, Sharding]]]:
    """Every 'rank:R,sharding plan: ...' printout in a text (the ranks' prints may follow one another)."""
    pieces = re.split(r"rank:(\d+),sharding plan:", text)
    for rank, body in zip(pieces[1::2], pieces[2::2]):
        yield int(rank), _plan(body)


def _plan_diff(want: Dict[str, Sharding], got: Optional[Dict[str, Sharding]]) -> List[str]:
    if got is None:
        return ["no plan printed"]
    return [f"{name}: want {want.get(name)} got {got.get(name)}" for name in sorted(set(want) | set(got)) if want.get(name) != got.get(name)]


# --- the three introductions (000 Chinese, 001 Korean RST, 004 Korean text) -----------------

# Added after the tutorial's cells: the tutorial says each key of the result is a 2D tensor of
# batch_size x embedding_dim but prints only the KeyedTensor object.
SHAPES_PROBE = "for key, embedding in pooled_embeddings.to_dict().items():\n    print(key, embedding.shape)"


def _id_table(text: str) -> Dict[str, List[List[int]]]:
    """The minibatch as the tutorial draws it: '| product ID | user ID |' then '| [101, 202] | [404] |' rows."""
    lines = [line.strip() for line in text.splitlines()]
    header = next(i for i, line in enumerate(lines) if re.fullmatch(r"\|( *\w+ ID *\|){2,}", line))
    keys = [cell.split()[0] for cell in lines[header].strip("|").split("|")]
    columns: Dict[str, List[List[int]]] = {key: [] for key in keys}
    for line in lines[header + 1 :]:
        if re.fullmatch(r"\|[-|]+\|", line):
            continue
        if not re.fullmatch(r"\|( *\[[\d, ]*\] *\|)+", line):
            break
        for key, cell in zip(keys, line.strip("|").split("|")):
            columns[key].append(ast.literal_eval(cell.strip()))
    return columns


def _printed_kjts(text: str) -> List[Dict[str, List[List[int]]]]:
    """KeyedJaggedTensor({"product": [[101, 202], [], [303]], ...}) printouts."""
    return [
        {key: ast.literal_eval(ids) for key, ids in re.findall(r'"(\w+)": (\[.*?\]),?\s*$', body, re.M)}
        for body in re.findall(r"KeyedJaggedTensor\(\{(.*?)\}\)", text, re.S)
    ]


def _configured_tables(tutorial: Tutorial) -> Dict[str, Tuple[int, int]]:
    """name -> (num_embeddings, embedding_dim) of the EmbeddingBagConfig(...) calls in the cells."""
    tables = {}
    for cell in tutorial.cells:
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("EmbeddingBagConfig"):
                kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg in ("name", "num_embeddings", "embedding_dim")}
                tables[kw["name"]] = (kw["num_embeddings"], kw["embedding_dim"])
    return tables


@pytest.mark.parametrize("number", [0, 1, 4], ids=["000-zh", "001-ko-rst", "004-ko-text"])
def test_intro_tutorial_runs_and_prints_its_minibatch_plan_and_shapes(number):
    tutorial = extract(seed_path(str(number)))
    ids = _id_table(tutorial.text)
    batch_by_dim = re.search(r"(\d+)x(\d+)\s*[（(]batch_size x embedding_dim", tutorial.text)
    tables = _configured_tables(tutorial)
    assert ids and batch_by_dim and tables, "the seed no longer has its table, its 3x64 sentence or its configs"

    results = run(tutorial, extra=[SHAPES_PROBE])
    problems = _failures(results)
    printed = "\n".join(r.stdout for r in results if not r.run.probe)
    # the printed minibatch holds the ids of the tutorial's table, per feature and example
    kjts = _printed_kjts(printed)
    if kjts[:1] != [ids]:
        problems.append(f"print(mb): want {ids}, got {kjts[:1]}")
    # "one GPU: TorchRec will place both [tables] on the single GPU": every configured table,
    # whole, on rank 0
    plan = _table_plan(printed)
    for name, (rows, dim) in tables.items():
        got = plan.get(name)
        whole = got is not None and sum(math.prod(sizes) for _, sizes, _ in got.shards) in (0, rows * dim)
        if not (whole and got.ranks == (0,) and all(p.startswith("rank:0/") for _, _, p in got.shards)):
            problems.append(f"print(model.plan): {name} ({rows} x {dim}) is not wholly on rank 0: {got}")
    if set(plan) - set(tables):
        problems.append(f"print(model.plan): tables the tutorial does not configure: {sorted(set(plan) - set(tables))}")
    # each key of the pooled result is batch_size x embedding_dim (the tutorial's "3x64")
    want = {key: [int(batch_by_dim.group(1)), int(batch_by_dim.group(2))] for key in ids}
    got_shapes = {k: [int(a), int(b)] for k, a, b in re.findall(r"^(\w+) torch\.Size\(\[(\d+), (\d+)\]\)$", results[-1].stdout, re.M)}
    if got_shapes != want:
        problems.append(f"pooled_embeddings shapes: want {want}, got {got_shapes}")
    assert not problems, f"{tutorial.path.name}:\n" + "\n".join(problems)


# --- the sharding tutorial (002) ---------------------------------------------------------------


def test_sharding_tutorial_prints_the_tutorials_plans_on_two_ranks():
    """The four sharding types on 2 spawned gloo ranks, each rank's printed plan against the plan
    the tutorial shows for that rank: sharding type, ranks, shard offsets, sizes and placement
    per table. The tutorial shows the data_parallel plans without a cell that makes them, so
    the test adds that call after the tutorial's cells."""
    tutorial = extract(seed_path("2"))
    shown: Dict[Tuple[str, int], Dict[str, Sharding]] = {}
    for rank, plan in _rank_plans(tutorial.text):
        (kind,) = {s.sharding_type for s in plan.values()}
        shown[(kind, rank)] = plan
    assert {kind for kind, _ in shown} == SHARDING_TYPES and {rank for _, rank in shown} == {0, 1}

    results = run(tutorial, extra=["spmd_sharing_simulation(ShardingType.DATA_PARALLEL)"])
    problems = _failures(results)
    checked = set()
    for r in results:
        call = re.fullmatch(r"spmd_sharing_simulation\(ShardingType\.(\w+)\)", r.run.source.strip())
        if call is None or r.status != "ok":
            continue
        kind = call.group(1).lower()
        checked.add(kind)
        printed = dict(_rank_plans(r.stdout))
        for rank in (0, 1):
            problems += [f"{r.title} {kind} rank {rank}: {d}" for d in _plan_diff(shown[(kind, rank)], printed.get(rank))]
    if not problems and checked != SHARDING_TYPES:
        problems.append(f"no cell ran {sorted(SHARDING_TYPES - checked)}")
    assert not problems, f"{tutorial.path.name}:\n" + "\n".join(problems)


# --- the English introduction (003) ------------------------------------------------------------


def _logical_lines(text: str) -> List[str]:
    """Output lines joined while brackets are open, whitespace collapsed (the dump collapsed it),
    memory addresses and module paths dropped (<torchrec.sparse.jagged_tensor.KeyedTensor object
    at 0x7f...> -> <KeyedTensor object>), cuda devices read as cpu, grad_fn names dropped."""
    lines, pending, depth = [], [], 0
    for line in text.splitlines():
        pending.append(line)
        depth += sum(line.count(c) for c in "([{") - sum(line.count(c) for c in ")]}")
        if depth <= 0:
            lines.append(" ".join(pending))
            pending, depth = [], 0
    lines += [" ".join(pending)] if pending else []
    normalized = []
    for line in lines:
        line = re.sub(r"\s+", " ", line).strip()
        line = re.sub(r"([(\[{]) ", r"\1", re.sub(r" ([)\]}])", r"\1", line))
        line = re.sub(r"<(?:[\w.]+\.)?(\w+) object at 0x[0-9a-fA-F]+>", r"<\1 object>", line)
        line = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"<class '\1'>", line)
        line = re.sub(r", grad_fn=<\w+>", "", line)
        normalized.append(re.sub(r"\bcuda(:\d+)?\b", "cpu", line))
    return normalized


def comparable(text: str) -> List[str]:
    """What the English tutorial's outputs are compared on, line by line in order: tensor values
    and torch.Size(...) lines (so 'Keys:'/'Lengths:'/'Values:', the embedding shapes, and the
    parameter and buffer names with shapes and dtypes), lists of keys, JaggedTensor and
    KeyedJaggedTensor printouts, to_dict's keys and value types, <class '...'> names, the
    name='...' lines, dict_keys(...), and the unsharded ModuleDict of EmbeddingBags. Not
    compared: module trees of sharded modules (TorchRec internals), object reprs, printed source
    code, warnings and paths. Plans, learning rates and losses have their own checks."""
    kept = []
    for line in _logical_lines(text):
        if line.startswith("to_dict:"):
            kept.append("to_dict: " + ", ".join(f"{k}: {t}" for k, t in re.findall(r"'(\w+)': <?(?:[\w.]+\.)?(\w+)", line)))
        elif (
            any(p in line for p in ("tensor(", "torch.Size(", "<class '", "JaggedTensor({", "dict_keys("))
            or line.startswith("name='")
            or re.fullmatch(r"(\w+: )?\[('[^']*'(, )?)*\]", line)
            or (line.startswith("ModuleDict(") and "EmbeddingBag(" in line)
        ):
            kept.append(line)
    return kept


def _tbe_buffer(line: str) -> bool:
    """A buffer line of a quantized module's own fbgemm TBE ("ebc_.tbes.0.D_offsets torch.Size([3])
    torch.int32"): recship registers its TBEs as submodules, so they script as they are, and
    named_buffers() lists them after the per-table weights the tutorial shows (docs/torchrec.md,
    "What differs, and why"). Only these lines are left out of the comparison."""
    return re.match(r"[\w.]*\b(tbes\.\d+\.\w+|_column_order) torch\.Size\(", line) is not None


def _learning_rates(text: str) -> List[float]:
    """The 'lr: 0.02' lines of the fused optimizers' printouts."""
    return [float(v) for v in re.findall(r"^\s*lr: ([-\d.eE+]+)\s*$", text, re.M)]


def _loss_drop(text: str) -> Optional[float]:
    first = re.search(r"First Iteration Loss: ([-\d.eE+]+)", text)
    second = re.search(r"Second Iteration Loss: ([-\d.eE+]+)", text)
    return float(first.group(1)) - float(second.group(1)) if first and second else None


def test_english_tutorial_runs_and_prints_what_the_page_shows():
    tutorial = extract(seed_path("3"))
    shown_all = "\n".join(c.shown_output for c in tutorial.cells)
    assert len(comparable(shown_all)) > 20 and _loss_drop(shown_all) and _learning_rates(shown_all) and _table_plan(shown_all)

    results = run(tutorial)
    problems = _failures(results)
    for r in results:
        shown = r.run.cell.shown_output
        if r.status != "ok" or not shown:
            continue
        want, got = comparable(shown), [line for line in comparable(r.stdout) if not _tbe_buffer(line)]
        if want != got:
            diff = difflib.unified_diff(want, got, "shown", "printed", n=0, lineterm="")
            problems.append(f"{r.title} output differs:\n    " + "\n    ".join(list(diff)[2:]))
        if _learning_rates(shown) != _learning_rates(r.stdout):
            problems.append(f"{r.title} fused optimizer lr: want {_learning_rates(shown)}, got {_learning_rates(r.stdout)}")
        if "param | sharding type" in shown:
            problems += [f"{r.title} plan: {d}" for d in _plan_diff(_table_plan(shown), _table_plan(r.stdout))]
        want_drop = _loss_drop(shown)
        if want_drop is not None:
            # The losses themselves depend on how TorchRec draws its initial weights; their
            # difference does not: one exact row-wise adagrad step (lr 0.02, eps 0.002) after
            # d(loss)/d(output) = -1 moves each looked-up row by lr * n / (n + eps) per element
            # (n: its lookups in the batch), whatever the weights were.
            got_drop = _loss_drop(r.stdout)
            if got_drop is None or abs(got_drop - want_drop) > 1e-3:
                problems.append(f"{r.title} first minus second iteration loss: want {want_drop:.5f}, got {got_drop}")
    assert not problems, f"{tutorial.path.name}:\n" + "\n".join(problems)
