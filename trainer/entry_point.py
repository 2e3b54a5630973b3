"""Models named by entry point: ``package.module:factory`` plus keyword arguments (JSON on the command line).

``recship train --model`` and ``recship export --model`` build a user's model this way, and
a checkpoint records the entry point and its arguments so that export needs nothing else.
The built-in DLRM is ``recship.models.dlrm:builtin``.
"""

import copy
import dataclasses
import inspect
import linecache
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from recship.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection, materialize
from recship.sparse import KeyedJaggedTensor
from recship.trainer.factories import load_factory
from recship.trainer.feature_processors import feature_processed_features
from recship.trainer.managed_collisions import BaseManagedCollisionEmbeddingCollection
from recship.trainer.managed_collisions.modules import resized_collection


def build_model(entry: str, args: Optional[Dict[str, Any]] = None, device: Optional[str] = None) -> nn.Module:
    """Calls the factory with ``args`` (and ``device``, if it takes one); the result must be an nn.Module."""
    factory = load_factory(entry)
    kwargs = dict(args or {})
    if device is not None and _takes(factory, "device"):
        kwargs["device"] = device
    try:
        model = factory(**kwargs)
    except Exception as e:
        raise ValueError(f"--model {entry}: the factory raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {entry}: the factory returned a {type(model).__name__}, not an nn.Module")
    return model


def _takes(factory: Callable, name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def describe_model(module: nn.Module, num_dense: Optional[int] = None) -> Dict[str, Any]:
    """The model contract's facts about ``module``; ValueError naming what breaks the contract.

    Returns {"features": [(feature, collection path, table config, pooling or "NONE", weighted)],
    "tables": [(collection path, table config)], "shared": {feature: names of the tables it feeds} for features
    several tables of one collection look up (TorchRec's shared features, listed in "features" once, with the
    table of fewest rows: their ids must be inside every one), "weighted": whether any feature is,
    "num_dense": int}: features in the order of their collections (first path in ``named_modules`` order)
    and tables.
    """
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    if len(params) != 2:
        names = ", ".join(p.name for p in params)
        raise ValueError(f"{type(module).__name__}.forward({names}): the model contract is forward(dense, features) "
                         "(dense: float [B, num_dense], features: KeyedJaggedTensor)")
    if params[0].name in ("features", "sparse", "sparse_features", "kjt") and params[1].name in ("dense", "dense_features"):
        raise ValueError(f"{type(module).__name__}.forward({params[0].name}, {params[1].name}): the model contract is "
                         "forward(dense, features), dense first")
    seen: Dict[int, Any] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        if type(m) in (EmbeddingBagCollection, EmbeddingCollection):
            seen.setdefault(id(m), (path, m))
    if not seen:
        raise ValueError(f"{type(module).__name__} holds no EmbeddingBagCollection or EmbeddingCollection")
    features: List[Tuple[str, str, Any, str, bool]] = []  # (feature, path, table config, pooling, weighted)
    tables: List[Tuple[str, Any]] = []  # (path, table config): every table
    owner: Dict[str, str] = {}
    position: Dict[str, int] = {}
    shared: Dict[str, List[str]] = {}
    processed = feature_processed_features(module)  # weighted by the model itself: requests send no weights
    for path, c in seen.values():
        is_bag = isinstance(c, EmbeddingBagCollection)
        for t in (c.embedding_bag_configs() if is_bag else c.embedding_configs()):
            tables.append((path, t))
            for f in t.feature_names:
                weighted = is_bag and c.is_weighted() and f not in processed
                entry = (f, path, t, t.pooling.value if is_bag else "NONE", weighted)
                if f in owner and owner[f] != (path or "the model"):
                    raise ValueError(f"feature {f!r} is looked up by two collections ({owner[f]} and {path or 'the model'}): "
                                     "give each collection its own feature name")
                if f in owner:  # a shared feature (TorchRec's feature@table): listed once, with the table that bounds its ids
                    shared.setdefault(f, [features[position[f]][2].name]).append(t.name)
                    if t.num_embeddings < features[position[f]][2].num_embeddings:
                        features[position[f]] = entry
                    continue
                owner[f] = path or "the model"
                position[f] = len(features)
                features.append(entry)
    if num_dense is None:
        num_dense = getattr(module, "num_dense", None)
    if not isinstance(num_dense, int) or isinstance(num_dense, bool) or num_dense < 0:
        raise ValueError(f"the dense width is unknown: give num_dense (ExportConfig(num_dense=N)) or a num_dense attribute "
                         f"on {type(module).__name__} (0 for a model without dense inputs)")
    return {"features": features, "tables": tables, "shared": shared, "weighted": any(f[4] for f in features), "num_dense": num_dense}


def user_line(error: BaseException, user_files: Union[None, str, Set[str]]) -> str:
    """"file.py:LINE: code" of the innermost frame of ``error``'s traceback in one of ``user_files`` ("" if none)."""
    files = {user_files} if isinstance(user_files, str) else set(user_files or ())
    found = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in files:
            found = tb
        tb = tb.tb_next
    if found is None:
        return ""
    file = found.tb_frame.f_code.co_filename
    return f"{os.path.basename(file)}:{found.tb_lineno}: {linecache.getline(file, found.tb_lineno).strip()}"


def user_files(module: nn.Module) -> Set[str]:
    """The source files of ``module``'s classes that are neither recship's nor torch's: the user's code."""
    files = set()
    for m in module.modules():
        if type(m).__module__.split(".")[0] in ("recship", "torch", "fbgemm_gpu"):
            continue
        try:
            file = inspect.getsourcefile(type(m))
        except TypeError:  # defined in the interpreter
            continue
        if file:
            files.add(file)
    return files


_VALUE_READS = {torch.Tensor.__bool__: "bool()", torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()",
                torch.Tensor.__int__: "int()", torch.Tensor.__float__: "float()", torch.Tensor.__index__: "an index"}


class _ValueReads(TorchFunctionMode):
    """Notes the first place where code in ``files`` reads a tensor's value into Python (an ``if`` on a tensor,
    ``.item()``, ``float()``...): export traces the forward, and neither torch.fx nor torch.export can follow it."""

    def __init__(self, files: Set[str]) -> None:
        super().__init__()
        self.files = files
        self.found: Optional[str] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.found is None and func in _VALUE_READS:
            frame = sys._getframe(1)  # the code that asked: the first frame outside torch (recship's own reads are fine)
            while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "torch":
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename in self.files:
                file, line = frame.f_code.co_filename, frame.f_lineno
                self.found = f"{os.path.basename(file)}:{line}: {linecache.getline(file, line).strip()} ({_VALUE_READS[func]})"
        return func(*args, **(kwargs or {}))


def check_contract(module: nn.Module, contract: Dict[str, Any], batch_size: int = 2,
                   labels: Optional[Dict[str, List[int]]] = None) -> None:
    """Runs ``module``'s forward once as training and export will, before any rank starts, on a copy whose tables
    have a few rows (built on meta, so no table is allocated); ValueError, one line naming the broken rule and
    the user's line where there is one. ``contract``: ``describe_model(module)``.

    Checks: every table's embedding_dim is a multiple of 4 (fbgemm's TBE kernels); the forward runs on a batch
    of ``batch_size`` with dense [B, num_dense]; it reads no tensor's value into Python (export traces it); it
    returns a Tensor or a Dict[str, Tensor], each batch-first [B, ...]; what is trained (the model's ``loss``, or
    binary cross-entropy on its one output or its ``eval_output``) is defined and has one logit per example; the
    model's ``loss`` takes labels of the data's shape and returns one value; ``eval_outputs`` ({output: label
    column}) names one-logit outputs and columns the labels have. ``labels``: {data: its labels' shape, [B] or
    [B, T]} of the run's data functions (default, and for data without one: [B]).
    """
    name = type(module).__name__
    for path, table in contract["tables"]:
        if table.embedding_dim % 4:
            raise ValueError(f"table {table.name!r} (features {table.feature_names}): embedding_dim {table.embedding_dim} is "
                             "not a multiple of 4, which fbgemm's embedding kernels need")
    tiny = copy.deepcopy(module)
    for path, m in list(tiny.named_modules()):
        small: nn.Module
        if type(m) is EmbeddingBagCollection:
            small = EmbeddingBagCollection([dataclasses.replace(t, num_embeddings=min(t.num_embeddings, 8)) for t in m.embedding_bag_configs()],
                                           is_weighted=m.is_weighted(), device="meta")
        elif type(m) is EmbeddingCollection:
            small = EmbeddingCollection([dataclasses.replace(t, num_embeddings=min(t.num_embeddings, 8)) for t in m.embedding_configs()],
                                        device="meta")
        else:
            continue
        parent, _, leaf = path.rpartition(".")
        owner = tiny.get_submodule(parent) if parent else tiny
        setattr(owner, leaf, small)
        if isinstance(owner, BaseManagedCollisionEmbeddingCollection):  # its remapped ids must fit the small tables too
            configs = small.embedding_bag_configs() if isinstance(small, EmbeddingBagCollection) else small.embedding_configs()
            owner._managed_collision_collection = resized_collection(owner._managed_collision_collection, configs)
    materialize(tiny, "cpu")
    g = torch.Generator().manual_seed(0)
    keys = [f[0] for f in contract["features"]]
    rows = {f[0]: min(f[2].num_embeddings, 8) for f in contract["features"]}
    B = batch_size
    lengths = torch.tensor([1 + (i + j) % 2 for i in range(len(keys)) for j in range(B)])
    values = torch.cat([torch.randint(0, rows[k], (int(lengths[i * B:(i + 1) * B].sum()),), generator=g) for i, k in enumerate(keys)])
    weights = torch.rand(values.shape[0], generator=g) if contract["weighted"] else None
    features = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)
    dense = torch.randn(B, contract["num_dense"], generator=g)
    files = user_files(module)
    reads = _ValueReads(files)
    try:
        with reads:
            out = tiny(dense, features)
    except Exception as e:
        where = user_line(e, files)
        first = (str(e).strip().splitlines() or [""])[0]
        hint = ""
        if "mat1 and mat2" in first or "shape" in first:
            hint = f"; is num_dense = {contract['num_dense']} the width of dense?"
        raise ValueError(f"{name}.forward failed on a batch of {B} (dense [{B}, {contract['num_dense']}], features {keys[:4]}"
                         f"{'...' if len(keys) > 4 else ''}): {type(e).__name__}: {first}" + (f" (at {where})" if where else "") + hint) from None
    if reads.found:
        raise ValueError(f"{name}.forward reads a tensor's value in Python at {reads.found}: export traces the forward "
                         "(torch.fx, torch.export), which cannot follow a value; keep it a tensor (torch.where for a branch)")
    if isinstance(out, torch.Tensor):
        outputs = {"output": out}
    elif isinstance(out, dict) and out and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out.items()):
        outputs = out
    else:
        raise ValueError(f"{name}.forward returned {type(out).__name__}: the model contract is a Tensor or a Dict[str, Tensor], "
                         "batch first")
    for key, v in outputs.items():
        if v.dim() == 0 or v.shape[0] != B:
            raise ValueError(f"{name}.forward's output {key!r} has shape {list(v.shape)} for a batch of {B}: outputs are "
                             "batch-first [B, ...]")
    for source, shape in (labels or {"the data": [B]}).items():
        _check_labels(module, outputs, out, shape, source, B, g)
    if callable(getattr(module, "loss", None)):
        return
    trained = getattr(module, "eval_output", None)
    if isinstance(out, dict):
        if trained is None and len(out) != 1:
            raise ValueError(f"{name} returns {sorted(out)}: define eval_output (the output trained and evaluated as a logit), "
                             "and loss(outputs, labels) if not binary cross-entropy on it")
        if trained is not None and trained not in out:
            raise ValueError(f"{name}.eval_output is {trained!r}, but its forward returns {sorted(out)}")
    score = out[trained or next(iter(out))] if isinstance(out, dict) else out
    if score.numel() != B:
        raise ValueError(f"{name} trains with binary cross-entropy on one logit per example, but its output has shape "
                         f"{list(score.shape)} for a batch of {B}: return [B] or [B, 1], or define loss(outputs, labels)")


def _check_labels(module: nn.Module, outputs: Dict[str, torch.Tensor], out: Any, shape: List[int], source: str, B: int,
                  g: torch.Generator) -> None:
    """ValueError, one line, if labels of ``shape`` (from ``source``) cannot train or evaluate ``module``: its
    ``eval_outputs`` name an output that is no logit per example or a column the labels lack, several tasks come
    without ``eval_outputs`` or without a ``loss``, or its ``loss`` fails on them or returns more than one value."""
    name = type(module).__name__
    columns = shape[1] if len(shape) == 2 else 1
    what = f"{source}'s labels {shape}"
    tasks = getattr(module, "eval_outputs", None)
    if tasks is not None:
        if not isinstance(tasks, dict) or not tasks or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                               for k, v in tasks.items()):
            raise ValueError(f"{name}.eval_outputs must map output names to label columns, e.g. {{'ctr': 0, 'ctcvr': 1}}; "
                             f"got {tasks!r}")
        for task, column in tasks.items():
            if task not in outputs:
                raise ValueError(f"{name}.eval_outputs names {task!r}, but its forward returns {sorted(outputs)}")
            if outputs[task].numel() != B:
                raise ValueError(f"{name}.eval_outputs: output {task!r} has shape {list(outputs[task].shape)} for a batch of {B}: "
                                 "a task is evaluated on one logit per example")
            if not 0 <= column < columns:
                raise ValueError(f"{name}.eval_outputs: {task!r} is label column {column}, but {what} have "
                                 f"{columns} column{'s' if columns > 1 else ''}")
    elif columns > 1:
        raise ValueError(f"{what} hold {columns} tasks: define {name}.eval_outputs = {{output: label column}} (and "
                         "loss(outputs, labels) taking [B, T] labels)")
    own = getattr(module, "loss", None)
    if not callable(own):
        if columns > 1:
            raise ValueError(f"{what} hold {columns} tasks: binary cross-entropy on one output takes [B]; define "
                             f"{name}.loss(outputs, labels)")
        return
    y = (torch.rand(B, *shape[1:], generator=g) < 0.5).float()
    try:
        value = own(out, y)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        where = user_line(e, user_files(module))
        raise ValueError(f"{name}.loss(outputs, labels {[B, *shape[1:]]}) failed ({what}, as the data gives them): "
                         f"{type(e).__name__}: {first}" + (f" (at {where})" if where else "")) from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}.loss(outputs, labels {[B, *shape[1:]]}) returned {got}: the loss is one value (a scalar tensor)")
