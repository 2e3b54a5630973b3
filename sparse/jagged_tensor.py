"""Jagged sparse data: JaggedTensor, KeyedJaggedTensor (KJT) and KeyedTensor.

The layout and method names follow TorchRec's tutorials. A KJT with F keys and
batch size B holds, feature-major (all examples of key 0, then key 1, ...):

    values  [N]          ids (int64 or int32), or any other dtype (float sequence features): the
                         container takes any; the embedding collections refuse non-integer ids
    lengths [F * B]      ids per (key, example), same integer dtype as offsets
    offsets [F * B + 1]  0 followed by the running sum of lengths
    weights [N] float    optional, one score per id (id-score-list features)

All three classes work eagerly, inside ``torch.jit.script``-ed code, and as
values flowing through ``torch.fx.symbolic_trace`` (each defines
``__fx_create_arg__`` so a traced module may return one).

Inputs are validated at construction: shapes always, and the data-dependent
rules (no negative lengths, ``sum(lengths) == len(values)``) whenever the
tensors are on the CPU, where the check costs no device synchronisation. A KJT
moved to a GPU with ``to()`` was already checked on the CPU.

Inside these classes every constructor call spells out all arguments:
TorchScript does not apply a class's default arguments while it is still
compiling that class.
"""

import inspect
from typing import Any, Dict, List, Optional, Tuple

import torch

from recship.sparse.kjt_caches import check_kjt_caches, check_kt_caches
from recship.sparse.segments import empty_index_or_same, permute_jagged


# ---------------------------------------------------------------------------
# Helpers (module-level so that TorchScript compiles them once).
# ---------------------------------------------------------------------------


def _offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] offsets starting at 0, in the lengths' dtype."""
    return torch.cat(
        [lengths.new_zeros(1), torch.cumsum(lengths, dim=0, dtype=lengths.dtype)]
    )


class IndexDtypeError(ValueError, AssertionError):
    """Lengths, offsets or inverse indices that are not integers: a bad argument (ValueError) that is also the
    AssertionError TorchRec raises there, so code written against TorchRec catches it too (the double lineage of
    trainer's ``EmptyGlobalParamsError``). Under TorchScript, like any exception, it is a ``torch.jit.Error``."""


def _check_index_dtype(t: torch.Tensor, name: str) -> None:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise IndexDtypeError(f"{name} must be an integer tensor, got {t.dtype}")


def _check_jagged(
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    weights: Optional[torch.Tensor],
    owner: str,
    integer_weights: bool,
) -> None:
    """Raises ValueError unless (values, lengths, offsets, weights) are consistent. Weights are float scores, or
    with ``integer_weights`` also ids (an EmbeddingCollection's ``need_indices`` output)."""
    if values.dim() < 1:
        raise ValueError(f"{owner}: values must have at least one dimension")
    if lengths.dim() != 1:
        raise ValueError(f"{owner}: lengths must be 1-D, got shape {lengths.shape}")
    no_rows = lengths.numel() == 0 and offsets.numel() == 0  # JaggedTensor.empty()'s offsets are [], as TorchRec's
    if offsets.dim() != 1 or (offsets.numel() != lengths.numel() + 1 and not no_rows):
        raise ValueError(
            f"{owner}: offsets must be 1-D with len(lengths) + 1 = "
            f"{lengths.numel() + 1} entries, got shape {offsets.shape}"
        )
    _check_index_dtype(lengths, owner + ": lengths")
    if weights is not None:
        if integer_weights:
            if weights.is_complex() or weights.dtype == torch.bool:
                raise ValueError(f"{owner}: weights must be floating point scores or integer ids, got {weights.dtype}")
        elif not weights.is_floating_point():
            raise ValueError(f"{owner}: weights must be floating point, got {weights.dtype}")
        if weights.shape[0] != values.shape[0]:
            raise ValueError(
                f"{owner}: weights has {weights.shape[0]} entries but values has "
                f"{values.shape[0]}; there must be one weight per value"
            )
    if lengths.device.type == "cpu":
        if lengths.numel() > 0:
            smallest = int(lengths.min())
            if smallest < 0:
                raise ValueError(f"{owner}: lengths must be >= 0, found {smallest}")
        if not no_rows and int(offsets[0]) != 0:
            raise ValueError(f"{owner}: offsets must start at 0, got {int(offsets[0])}")
        total = 0 if no_rows else int(offsets[-1])
        if total != values.shape[0]:
            raise ValueError(
                f"{owner}: sum(lengths) = {total} but values has {values.shape[0]} entries"
            )


def _optional_mask(t: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """t[mask], or None without t (an fx leaf: a traced ``from_dense_lengths`` decides when it runs)."""
    return None if t is None else t[mask]


torch.fx.wrap("_optional_mask")


def _is_proxy(t: torch.Tensor) -> bool:
    """True while torch.fx traces (values are Proxies) or torch.export / torch.compile capture
    (the checks' data-dependent branches cannot be traced; the request was validated before the
    model); never compiled by TorchScript."""
    return isinstance(t, torch.fx.Proxy) or torch.compiler.is_compiling()


def _normalized_index(
    values: torch.Tensor, lengths: Optional[torch.Tensor], offsets: Optional[torch.Tensor]
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A constructor's lengths and offsets through ``empty_index_or_same``; as given while fx traces or torch.export
    captures (``_is_proxy``, which TorchScript does not compile: hence the scripting branch)."""
    if torch.jit.is_scripting():
        return empty_index_or_same(lengths), empty_index_or_same(offsets)
    elif not _is_proxy(values):
        return empty_index_or_same(lengths), empty_index_or_same(offsets)
    return lengths, offsets


def _nested_lists(values: torch.Tensor, lengths: List[int]) -> str:
    """'[[1, 2], [], [3]]' for values split by lengths (for __str__, TorchRec's text: each element as Python prints
    it, so float values read '1.0'; [N, D] values give a list per element). ValueError for more than 2 dimensions."""
    if values.dim() > 2:
        raise ValueError(f"__str__ prints values of 1 or 2 dimensions, got shape {list(values.shape)}")
    rows: List[str] = []
    start = 0
    for n in lengths:
        row = values[start : start + n].tolist()
        rows.append("[" + ", ".join(str(x) for x in row) + "]")
        start += n
    return "[" + ", ".join(rows) + "]"


# ---------------------------------------------------------------------------
# JaggedTensor
# ---------------------------------------------------------------------------


def _check_same_shapes(owner: str, mine: List[torch.Tensor], theirs: List[torch.Tensor], names: List[str]) -> None:
    for i in range(len(names)):
        if mine[i].shape != theirs[i].shape:
            raise ValueError(f"{owner}: {names[i]} has shape {list(theirs[i].shape)} to copy into {list(mine[i].shape)}")


@torch.jit.unused
def _record_stream(tensors: List[Optional[torch.Tensor]], stream: torch.Stream) -> None:
    for t in tensors:
        if t is not None:
            t.record_stream(stream)


class JaggedTensor:
    """One feature's variable-length rows.

    Args:
        values (Tensor): [N, ...] ids (or, as an EmbeddingCollection output,
            [N, D] embeddings); rows are concatenated.
        weights (Optional[Tensor]): [N] float, one per value (an EmbeddingCollection
            with ``need_indices`` puts each row's id here, int64).
        lengths (Optional[Tensor]): [B] integer, values per row.
        offsets (Optional[Tensor]): [B + 1] integer; give lengths or offsets
            (or both, which must agree); the other is derived.
    """

    def __init__(
        self,
        values: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
    ) -> None:
        lengths, offsets = _normalized_index(values, lengths, offsets)
        if lengths is None:
            if offsets is None:
                raise ValueError("JaggedTensor: give lengths or offsets")
            _check_index_dtype(offsets, "JaggedTensor: offsets")
            lengths = offsets[1:] - offsets[:-1]
        elif offsets is None:
            offsets = _offsets_from_lengths(lengths)
        if torch.jit.is_scripting():
            _check_jagged(values, lengths, offsets, weights, "JaggedTensor", True)
        elif not _is_proxy(values):
            _check_jagged(values, lengths, offsets, weights, "JaggedTensor", True)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets

    @staticmethod
    def from_dense(
        values: List[torch.Tensor], weights: Optional[List[torch.Tensor]] = None
    ) -> "JaggedTensor":
        """One row per tensor: row i is values[i] ([n_i, ...]); lengths are int32 [B].

        weights (Optional[List[Tensor]]): [n_i] float per row, matching values.
        An empty list has no dtype or device to take; use ``JaggedTensor.empty``.
        """
        if len(values) == 0:
            raise ValueError(
                "JaggedTensor.from_dense: values is an empty list, so its dtype and device "
                "are unknown; use JaggedTensor.empty() for zero rows"
            )
        lengths: List[int] = []
        for i, v in enumerate(values):
            if v.dim() < 1:
                raise ValueError(f"JaggedTensor.from_dense: values[{i}] is 0-d; rows are [n, ...]")
            lengths.append(v.shape[0])
        if weights is not None:
            if len(weights) != len(values):
                raise ValueError(
                    f"JaggedTensor.from_dense: {len(weights)} weight rows for {len(values)} value rows"
                )
            for i, w in enumerate(weights):
                if w.dim() != 1 or w.shape[0] != lengths[i]:
                    raise ValueError(
                        f"JaggedTensor.from_dense: weights[{i}] has shape {w.shape}, "
                        f"values[{i}] has {lengths[i]} rows"
                    )
        flat = torch.cat(values)
        return JaggedTensor(
            values=flat,
            weights=None if weights is None else torch.cat(weights),
            lengths=torch.tensor(lengths, dtype=torch.int32, device=flat.device),
            offsets=None,
        )

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        values_dtype: Optional[torch.dtype] = None,
        weights_dtype: Optional[torch.dtype] = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "JaggedTensor":
        """A JaggedTensor with no rows; dtypes left as None take torch's default. Its lengths and offsets are both
        empty ([0] entries, ``lengths_dtype``), as TorchRec's: the one JaggedTensor whose offsets are not
        len(lengths) + 1 long."""
        return JaggedTensor(
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            offsets=torch.empty(0, dtype=lengths_dtype, device=device),
        )

    @staticmethod
    def from_dense_lengths(values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None) -> "JaggedTensor":
        """Row b's first ``lengths[b]`` entries of dense ``values`` [B, N] (and of ``weights``, the same shape)."""
        mask = torch.arange(values.size(1), device=values.device).expand(values.size(0), -1) < lengths.unsqueeze(-1)
        return JaggedTensor(values=values[mask], weights=_optional_mask(weights, mask), lengths=lengths, offsets=None)

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def weights(self) -> torch.Tensor:
        w = self._weights
        if w is None:
            raise ValueError("JaggedTensor has no weights")
        return w

    @torch.jit.unused
    def record_stream(self, stream: torch.Stream) -> None:
        """Marks every tensor it holds as in use by CUDA ``stream`` (``Tensor.record_stream``)."""
        _record_stream([self._values, self._weights, self._lengths, self._offsets], stream)

    def weights_or_none(self) -> Optional[torch.Tensor]:
        return self._weights

    def device(self) -> torch.device:
        return self._values.device

    def copy_(self, jt: "JaggedTensor", non_blocking: bool = False) -> "JaggedTensor":
        """Copies ``jt``'s values, weights, lengths and offsets into this JaggedTensor's tensors, in place (TorchRec's:
        e.g. into buffers kept on a device); returns self. The shapes must match, and both or neither have weights."""
        w, jt_w = self._weights, jt._weights
        if (w is None) != (jt_w is None):
            raise ValueError("JaggedTensor.copy_: one has weights and the other not; both or neither must")
        _check_same_shapes("JaggedTensor.copy_", [self._values, self._lengths, self._offsets],
                           [jt._values, jt._lengths, jt._offsets], ["values", "lengths", "offsets"])
        self._values.copy_(jt._values, non_blocking=non_blocking)
        self._lengths.copy_(jt._lengths, non_blocking=non_blocking)
        self._offsets.copy_(jt._offsets, non_blocking=non_blocking)
        if w is not None and jt_w is not None:
            _check_same_shapes("JaggedTensor.copy_", [w], [jt_w], ["weights"])
            w.copy_(jt_w, non_blocking=non_blocking)
        return self

    def to_dense(self) -> List[torch.Tensor]:
        """One tensor per row: [values[offsets[i]:offsets[i+1]] for each row i]."""
        return list(torch.split(self._values, torch.jit.annotate(List[int], self._lengths.tolist())))

    def to_dense_weights(self) -> Optional[List[torch.Tensor]]:
        w = self._weights
        if w is None:
            return None
        return list(torch.split(w, torch.jit.annotate(List[int], self._lengths.tolist())))

    def to_padded_dense(
        self, desired_length: Optional[int] = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """[B, L] values padded (or truncated) to L = desired_length or the longest row."""
        lengths = self._lengths.to(torch.int64)
        num_rows = lengths.numel()
        width = desired_length if desired_length is not None else (
            int(lengths.max()) if num_rows > 0 else 0
        )
        out = torch.full(
            [num_rows, width] + list(self._values.shape[1:]),
            padding_value,
            dtype=self._values.dtype,
            device=self._values.device,
        )
        # Position of every value inside its row, computed without a loop over rows.
        row = torch.repeat_interleave(torch.arange(num_rows, device=lengths.device), lengths)
        pos = torch.arange(self._values.shape[0], device=lengths.device) - self._offsets.to(
            torch.int64
        )[row]
        keep = pos < width
        out.index_put_([row[keep], pos[keep]], self._values[keep])
        return out

    def to_padded_dense_weights(
        self, desired_length: Optional[int] = None, padding_value: float = 0.0
    ) -> Optional[torch.Tensor]:
        """[B, L] weights padded (or truncated) as ``to_padded_dense`` pads the values; None without weights."""
        w = self._weights
        if w is None:
            return None
        padded = JaggedTensor(values=w, weights=None, lengths=self._lengths, offsets=self._offsets)
        return padded.to_padded_dense(desired_length, padding_value)

    def to(self, device: torch.device, non_blocking: bool = False) -> "JaggedTensor":
        w = self._weights
        return JaggedTensor(
            values=self._values.to(device, non_blocking=non_blocking),
            weights=None if w is None else w.to(device, non_blocking=non_blocking),
            lengths=self._lengths.to(device, non_blocking=non_blocking),
            offsets=self._offsets.to(device, non_blocking=non_blocking),
        )

    @torch.jit.unused
    def __str__(self) -> str:
        """TorchRec's text: ``JaggedTensor({`` then a line of the rows (``[[1, 2], [], [3]]``), then ``})`` and a
        newline; with weights a ``"values"`` and a ``"weights"`` line."""
        lengths = self._lengths.tolist()
        values = _nested_lists(self._values, lengths)
        if self._weights is None:
            return "JaggedTensor({\n    " + values + "\n})\n"
        weights = _nested_lists(self._weights, lengths)
        return 'JaggedTensor({\n    "values": ' + values + ',\n    "weights": ' + weights + "\n})\n"

    @torch.jit.unused
    def __repr__(self) -> str:
        return self.__str__()

    @torch.jit.unused
    def __fx_create_arg__(self, tracer):  # noqa: ANN001 (fx hook)
        return tracer.create_node(
            "call_function",
            JaggedTensor,
            args=tracer.create_arg((self._values, self._weights, self._lengths, self._offsets)),
            kwargs={},
        )


def _check_kjt(
    keys: List[str],
    values: torch.Tensor,
    weights: Optional[torch.Tensor],
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    stride: Optional[int],
    length_per_key: Optional[List[int]],
    stride_per_key_per_rank: Optional[List[List[int]]],
    inverse_indices: Optional[Tuple[List[str], torch.Tensor]],
) -> None:
    owner = "KeyedJaggedTensor"
    if values.dim() < 1:
        raise ValueError(f"{owner}: values must have at least one dimension ([N, ...]), got shape {values.shape}")
    num_keys = len(keys)
    if inverse_indices is not None:
        _check_inverse_indices(inverse_indices, owner)
    if stride_per_key_per_rank is not None:
        _check_variable_stride(keys, lengths, stride_per_key_per_rank, owner)
        _check_jagged(values, lengths, offsets, weights, owner, True)
        if length_per_key is not None and len(length_per_key) != num_keys:
            raise ValueError(f"{owner}: length_per_key has {len(length_per_key)} entries for {num_keys} keys")
        return
    if num_keys == 0:
        if lengths.numel() != 0:
            raise ValueError(f"{owner}: no keys but {lengths.numel()} lengths")
    elif lengths.shape[0] % num_keys != 0:
        raise ValueError(
            f"{owner}: len(lengths) = {lengths.shape[0]} is not divisible by the "
            f"number of keys ({num_keys}); lengths must be [num_keys * batch_size]"
        )
    if stride is not None and stride * num_keys != lengths.shape[0]:
        raise ValueError(
            f"{owner}: stride {stride} x {num_keys} keys != len(lengths) = {lengths.shape[0]}"
        )
    _check_jagged(values, lengths, offsets, weights, owner, True)
    if length_per_key is not None and len(length_per_key) != num_keys:
        raise ValueError(f"{owner}: length_per_key has {len(length_per_key)} entries for {num_keys} keys")


def _check_variable_stride(keys: List[str], lengths: torch.Tensor, stride_per_key_per_rank: List[List[int]], owner: str) -> None:
    """[F][R] batch sizes: one row per key, as many ranks in each, none negative, adding up to len(lengths)."""
    if len(stride_per_key_per_rank) != len(keys):
        raise ValueError(f"{owner}: stride_per_key_per_rank has {len(stride_per_key_per_rank)} rows for {len(keys)} keys "
                         "(one row per key, one batch size per rank in it)")
    total = 0
    for k in range(len(stride_per_key_per_rank)):
        row = stride_per_key_per_rank[k]
        if len(row) != len(stride_per_key_per_rank[0]):
            raise ValueError(f"{owner}: stride_per_key_per_rank rows differ in length ({len(row)} vs "
                             f"{len(stride_per_key_per_rank[0])} ranks)")
        for b in row:
            if b < 0:
                raise ValueError(f"{owner}: stride_per_key_per_rank has a negative batch size {b} for key '{keys[k]}'")
            total += b
    if total != lengths.shape[0]:
        raise ValueError(f"{owner}: stride_per_key_per_rank adds up to {total} examples, but lengths has "
                         f"{lengths.shape[0]} entries (one per example of each key)")


def _check_inverse_indices(inverse_indices: Tuple[List[str], torch.Tensor], owner: str) -> None:
    names, indices = inverse_indices
    if indices.dim() != 2 or indices.shape[0] != len(names):
        raise ValueError(f"{owner}: inverse_indices must be (names, [len(names), B] integer tensor), got "
                         f"{len(names)} names and shape {list(indices.shape)}")
    _check_index_dtype(indices, owner + ": inverse_indices")


def _sum_rows(rows: List[List[int]]) -> List[int]:
    out: List[int] = []
    for row in rows:
        n = 0
        for b in row:
            n += b
        out.append(n)
    return out


@torch.jit.unused
def _check_caches(kjt: Any, stride_per_key: Optional[List[int]], lengths_offset_per_key: Optional[List[int]],
                  offset_per_key: Optional[List[int]], index_per_key: Optional[Dict[str, int]],
                  jt_dict: Optional[Dict[str, JaggedTensor]]) -> None:
    check_kjt_caches(kjt, stride_per_key, lengths_offset_per_key, offset_per_key, index_per_key, jt_dict)


@torch.jit.unused
def _check_kt_caches(keys: List[str], length_per_key: List[int], offset_per_key: Optional[List[int]],
                     index_per_key: Optional[Dict[str, int]]) -> None:
    check_kt_caches(keys, length_per_key, offset_per_key, index_per_key)


@torch.jit.unused
def _nested_int_list(stride_per_key_per_rank: Any) -> Optional[List[List[int]]]:
    """TorchRec also takes the batch sizes as an [F, R] int tensor (eager only)."""
    if isinstance(stride_per_key_per_rank, torch.Tensor):
        if stride_per_key_per_rank.dim() != 2:
            raise ValueError(f"KeyedJaggedTensor: stride_per_key_per_rank must be [F, R], got shape {list(stride_per_key_per_rank.shape)}")
        return stride_per_key_per_rank.tolist()
    return stride_per_key_per_rank


def _sum_by_splits(values: List[int], splits: List[int]) -> List[int]:
    """[sum of values' first splits[0] entries, of the next splits[1], ...]."""
    out: List[int] = []
    start = 0
    for n in splits:
        total = 0
        for v in values[start : start + n]:
            total += v
        out.append(total)
        start += n
    return out


# ---------------------------------------------------------------------------
# KeyedJaggedTensor
# ---------------------------------------------------------------------------


class _TracedWithTracedKeys(type):
    """KeyedJaggedTensor's metaclass: during torch.fx tracing, a KJT built from traced keys (a forward argument, or
    another traced KJT's ``keys()``) is itself a traced value, one ``KeyedJaggedTensor(...)`` call in the graph, as
    TorchRec's KJT under fx: no Python object can hold keys known only when the graph runs. With concrete keys the
    KJT is built as usual (over traced tensors, if so), so modules can read its keys while tracing."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        keys = args[0] if len(args) > 0 else kwargs.get("keys")
        if isinstance(keys, torch.fx.Proxy):
            return keys.tracer.create_proxy("call_function", cls, args, kwargs)
        return super().__call__(*args, **kwargs)


class KeyedJaggedTensor(metaclass=_TracedWithTracedKeys):
    """A batch of several sparse features (keys), stored feature-major.

    Args:
        keys (List[str]): F feature names. A name may repeat (``permute`` and
            ``concat`` duplicate features that way, as in TorchRec); looking a
            repeated name up finds its last occurrence.
        values (Tensor): [N] ids of all keys, key-major: int64/int32 for an embedding lookup, though the
            container takes any dtype and [N, ...] shapes (float sequence features, as TorchRec); the embedding
            collections refuse non-integer ids.
        weights (Optional[Tensor]): [N] float (or integer), one per value.
        lengths (Optional[Tensor]): [F * B] integer ids per (key, example). An empty tensor of any dtype or
            shape (``torch.tensor([])``, ``[[], []]``) carries no data and is taken as [0] int32.
        offsets (Optional[Tensor]): [F * B + 1] integer; give lengths or
            offsets (either may be left out only without keys); the other is derived, for the checks, though
            ``lengths_or_none()`` / ``offsets_or_none()`` report only what was given or asked for (TorchRec's).
        stride (Optional[int]): batch size B; derived as len(lengths) // F (with
            variable batch: the inverse indices' B, else the largest key's batch).
        stride_per_key_per_rank (Optional[List[List[int]]]): variable batch (TorchRec's
            VBE): [F][R] examples of each key from each rank; then lengths are
            [sum of them], key-major, and ``stride_per_key()`` differs per key.
        length_per_key (Optional[List[int]]): ids per key, if already known
            (saves a device synchronisation).
        stride_per_key, lengths_offset_per_key, offset_per_key ([F + 1] start of each key's ids in values),
            index_per_key ({key: position}), jt_dict ({key: JaggedTensor}, what ``to_dict()`` returns): TorchRec's
            precomputed values, taken as caches; each must equal what the KJT computes (ValueError otherwise).
        inverse_indices (Optional[Tuple[List[str], Tensor]]): (feature names,
            [len(names), B] int) row of each feature's (deduplicated) examples that
            example b of the full batch takes; an EmbeddingBagCollection expands its
            output to B rows by them.

    Under torch.fx a KJT built from traced keys is one graph call (see ``_TracedWithTracedKeys``); it is a pytree
    node (recship.sparse.pytree); ``permute`` / ``split`` take a variable-batch KJT as TorchRec's; ``dist_*`` are
    TorchRec's input-distribution protocol.

    Example (the tutorial's batch of two)::

        kjt = KeyedJaggedTensor(
            keys=["product", "user"],
            values=torch.tensor([1, 2, 1, 5, 2, 3, 4, 1]),
            lengths=torch.tensor([3, 1, 2, 2]),
        )
        # KeyedJaggedTensor({"product": [[1, 2, 1], [5]], "user": [[2, 3], [4, 1]]})
    """

    def __init__(
        self,
        keys: List[str],
        values: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        lengths: Optional[torch.Tensor] = None,
        offsets: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        stride_per_key: Optional[List[int]] = None,
        length_per_key: Optional[List[int]] = None,
        lengths_offset_per_key: Optional[List[int]] = None,
        offset_per_key: Optional[List[int]] = None,
        index_per_key: Optional[Dict[str, int]] = None,
        jt_dict: Optional[Dict[str, JaggedTensor]] = None,
        inverse_indices: Optional[Tuple[List[str], torch.Tensor]] = None,
    ) -> None:
        lengths, offsets = _normalized_index(values, lengths, offsets)
        # which of lengths / offsets the caller gave, or asked for since (TorchRec's lengths_or_none / offsets_or_none)
        self._lengths_known = lengths is not None
        self._offsets_known = offsets is not None
        if lengths is None:
            if offsets is None:
                if len(keys) != 0:
                    raise ValueError("KeyedJaggedTensor: give lengths or offsets")
                # no keys: the lengths can only be empty (TorchRec's KeyedJaggedTensor([], values))
                offsets = torch.zeros(1, dtype=torch.int32, device=values.device)
            _check_index_dtype(offsets, "KeyedJaggedTensor: offsets")
            lengths = offsets[1:] - offsets[:-1]
        elif offsets is None:
            offsets = _offsets_from_lengths(lengths)
        if torch.jit.is_scripting():
            _check_kjt(keys, values, weights, lengths, offsets, stride, length_per_key, stride_per_key_per_rank, inverse_indices)
        else:
            stride_per_key_per_rank = _nested_int_list(stride_per_key_per_rank)
            if not _is_proxy(values):
                _check_kjt(keys, values, weights, lengths, offsets, stride, length_per_key, stride_per_key_per_rank, inverse_indices)
        num_keys = len(keys)
        variable_stride = torch.jit.annotate(Optional[List[int]], None)
        if stride_per_key_per_rank is not None:
            variable_stride = _sum_rows(stride_per_key_per_rank)
        if stride is None:
            if variable_stride is None:
                stride = lengths.shape[0] // num_keys if num_keys > 0 else 0
            elif inverse_indices is not None and inverse_indices[1].numel() > 0:
                stride = inverse_indices[1].shape[-1]
            else:
                stride = max(variable_stride) if num_keys > 0 else 0
        self._stride_per_key_per_rank = stride_per_key_per_rank
        self._variable_stride_per_key = variable_stride
        self._inverse_indices = inverse_indices
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        self._stride = stride
        self._length_per_key = length_per_key
        self._offset_per_key = offset_per_key
        self._split_by_key = torch.jit.annotate(Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]], None)
        self._jt_dict = jt_dict
        if not torch.jit.is_scripting():
            if not _is_proxy(values):
                _check_caches(self, stride_per_key, lengths_offset_per_key, offset_per_key, index_per_key, jt_dict)

    # -- constructors ------------------------------------------------------

    @staticmethod
    def from_lengths_sync(
        keys: List[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        inverse_indices: Optional[Tuple[List[str], torch.Tensor]] = None,
    ) -> "KeyedJaggedTensor":
        """Builds a KJT and computes length_per_key now (one synchronisation)."""
        return _synced_kjt(keys, values, weights, lengths, None, stride, stride_per_key_per_rank, inverse_indices)

    @staticmethod
    def from_offsets_sync(
        keys: List[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: Optional[torch.Tensor] = None,
        stride: Optional[int] = None,
        stride_per_key_per_rank: Optional[List[List[int]]] = None,
        inverse_indices: Optional[Tuple[List[str], torch.Tensor]] = None,
    ) -> "KeyedJaggedTensor":
        """Builds a KJT and computes length_per_key now (one synchronisation)."""
        return _synced_kjt(keys, values, weights, None, offsets, stride, stride_per_key_per_rank, inverse_indices)

    @staticmethod
    def from_jt_dict(jt_dict: Dict[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """One KJT from per-key JaggedTensors (keys in dict order). JaggedTensors of different batch sizes give a
        variable-batch KJT (``stride_per_key_per_rank`` [[B_k] for each key], as TorchRec's).

        Either every JaggedTensor has weights or none has.
        """
        keys = list(jt_dict.keys())
        if len(keys) == 0:
            raise ValueError("from_jt_dict: the dict is empty")
        jts = list(jt_dict.values())
        stride = jts[0].lengths().shape[0]
        strides: List[int] = [jt.lengths().shape[0] for jt in jts]
        variable = any([b != stride for b in strides])
        weighted = jts[0].weights_or_none() is not None
        values: List[torch.Tensor] = []
        lengths: List[torch.Tensor] = []
        weights: List[torch.Tensor] = []
        length_per_key: List[int] = []
        for key, jt in zip(keys, jts):
            if jt.values().dim() != 1:
                raise ValueError(f"from_jt_dict: '{key}' values must be 1-D")
            w = jt.weights_or_none()
            if (w is not None) != weighted:
                raise ValueError("from_jt_dict: either all JaggedTensors have weights or none")
            values.append(jt.values())
            lengths.append(jt.lengths())
            length_per_key.append(jt.values().shape[0])
            if w is not None:
                weights.append(w)
        return KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=keys,
            values=torch.cat(values),
            weights=torch.cat(weights) if weighted else None,
            lengths=torch.cat(lengths),
            stride=None if variable else stride,
            length_per_key=length_per_key,
            offsets=None,
            stride_per_key_per_rank=[[b] for b in strides] if variable else None,
            inverse_indices=None,
        )

    @staticmethod
    def empty(
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
        values_dtype: Optional[torch.dtype] = None,
        weights_dtype: Optional[torch.dtype] = None,
        lengths_dtype: torch.dtype = torch.int32,
    ) -> "KeyedJaggedTensor":
        """A KJT with no keys and batch size 0; dtypes left as None take torch's default (float values, as
        TorchRec's)."""
        keys: List[str] = []
        return KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=keys,
            values=torch.empty(0, dtype=values_dtype, device=device),
            weights=torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None,
            lengths=torch.empty(0, dtype=lengths_dtype, device=device),
            stride=0,
            offsets=None,
            length_per_key=None,
            stride_per_key_per_rank=None,
            inverse_indices=None,
        )

    # -- accessors ---------------------------------------------------------

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        self._lengths_known = True
        return self._lengths

    def offsets(self) -> torch.Tensor:
        self._offsets_known = True
        return self._offsets

    def lengths_or_none(self) -> Optional[torch.Tensor]:
        """The lengths if given or asked for (``lengths()``) already, else None, as TorchRec's (recship derives
        them at construction all the same, to validate the batch)."""
        if self._lengths_known:
            return self._lengths
        return None

    def offsets_or_none(self) -> Optional[torch.Tensor]:
        """The offsets if given or asked for (``offsets()``) already, else None, as TorchRec's."""
        if self._offsets_known:
            return self._offsets
        return None

    def weights(self) -> torch.Tensor:
        w = self._weights
        if w is None:
            raise ValueError("KeyedJaggedTensor has no weights")
        return w

    def weights_or_none(self) -> Optional[torch.Tensor]:
        return self._weights

    def stride(self) -> int:
        """Batch size B = len(lengths) // len(keys)."""
        return self._stride

    def stride_per_key(self) -> List[int]:
        """[F] batch size of each key: B for every key, or with variable batch each key's examples over all ranks."""
        variable = self._variable_stride_per_key
        if variable is not None:
            return variable
        return [self._stride] * len(self._keys)

    def stride_per_key_per_rank(self) -> List[List[int]]:
        """[F][R] examples of each key from each rank, as given; [] without variable batch (TorchRec's)."""
        spkpr = self._stride_per_key_per_rank
        if spkpr is None:
            return torch.jit.annotate(List[List[int]], [])
        return spkpr

    def variable_stride_per_key(self) -> bool:
        """Whether the keys have their own batch sizes (built with ``stride_per_key_per_rank``)."""
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> Tuple[List[str], torch.Tensor]:
        """(feature names, [len(names), B] int): see the class docstring; ValueError if the KJT has none."""
        ii = self._inverse_indices
        if ii is None:
            raise ValueError("KeyedJaggedTensor has no inverse_indices")
        return ii

    def inverse_indices_or_none(self) -> Optional[Tuple[List[str], torch.Tensor]]:
        return self._inverse_indices

    def lengths_offset_per_key(self) -> List[int]:
        """[F + 1] where each key's entries start in ``lengths``: 0, B, 2B, ..., F * B (with variable batch, the running
        sum of ``stride_per_key()``)."""
        out = [0]
        for b in self.stride_per_key():
            out.append(out[-1] + b)
        return out

    def _per_key_lengths(self) -> List[torch.Tensor]:
        """[F] each key's lengths ([stride_per_key()[k]]), views of ``lengths``."""
        variable = self._variable_stride_per_key
        if variable is not None:
            return list(torch.split(self._lengths, variable))
        return list(self._key_lengths().unbind(0))

    def _refuse_variable_stride(self, what: str) -> None:
        if self._stride_per_key_per_rank is not None:
            raise ValueError(f"KeyedJaggedTensor.{what} is not supported for a variable-batch KJT (stride_per_key_per_rank) "
                             "in recship; to_dict(), __getitem__, split_by_key(), permute(), split() and an "
                             "EmbeddingBagCollection take it")

    @staticmethod
    def empty_like(kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        """A KJT with no keys, ``kjt``'s batch size, dtypes and device (weights if it has them), as TorchRec's. One
        call in an fx graph (which TorchScript then compiles)."""
        return _kjt_empty_like(kjt)

    def device(self) -> torch.device:
        return self._values.device

    def copy_(self, kjt: "KeyedJaggedTensor", non_blocking: bool = False) -> "KeyedJaggedTensor":
        """Copies ``kjt``'s values, weights, lengths and offsets into this KJT's tensors, in place, and takes its
        cached per-key sizes (TorchRec's: refilling a KJT whose tensors live on a device); returns self. The keys,
        shapes and weightedness must match (TorchRec assumes so; recship checks)."""
        if kjt._keys != self._keys:
            raise ValueError(f"KeyedJaggedTensor.copy_: keys {kjt._keys} to copy into a KJT of keys {self._keys}")
        w, kjt_w = self._weights, kjt._weights
        if (w is None) != (kjt_w is None):
            raise ValueError("KeyedJaggedTensor.copy_: one has weights and the other not; both or neither must")
        _check_same_shapes("KeyedJaggedTensor.copy_", [self._values, self._lengths, self._offsets],
                           [kjt._values, kjt._lengths, kjt._offsets], ["values", "lengths", "offsets"])
        self._values.copy_(kjt._values, non_blocking=non_blocking)
        self._lengths.copy_(kjt._lengths, non_blocking=non_blocking)
        self._offsets.copy_(kjt._offsets, non_blocking=non_blocking)
        if w is not None and kjt_w is not None:
            _check_same_shapes("KeyedJaggedTensor.copy_", [w], [kjt_w], ["weights"])
            w.copy_(kjt_w, non_blocking=non_blocking)
        self._stride = kjt._stride
        self._stride_per_key_per_rank = kjt._stride_per_key_per_rank
        self._variable_stride_per_key = kjt._variable_stride_per_key
        mine, theirs = self._inverse_indices, kjt._inverse_indices
        if mine is not None and theirs is not None and mine[1].shape == theirs[1].shape:
            self._inverse_indices = (theirs[0], mine[1].copy_(theirs[1], non_blocking=non_blocking))
        else:
            self._inverse_indices = theirs
        self._length_per_key = kjt._length_per_key
        self._offset_per_key = kjt._offset_per_key
        self._split_by_key = None  # views of this KJT's values, split by the sizes it had
        return self

    def size_in_bytes(self) -> int:
        """Bytes held by values, weights, lengths and offsets."""
        size = self._values.element_size() * self._values.numel()
        w = self._weights
        if w is not None:
            size += w.element_size() * w.numel()
        size += self._lengths.element_size() * self._lengths.numel()
        size += self._offsets.element_size() * self._offsets.numel()
        return size

    def sync(self) -> "KeyedJaggedTensor":
        """Computes and caches length_per_key and offset_per_key now; returns self."""
        self.offset_per_key()
        return self

    def unsync(self) -> "KeyedJaggedTensor":
        """Drops the cached length_per_key, offset_per_key and split_by_key; returns self."""
        self._length_per_key = None
        self._offset_per_key = None
        self._split_by_key = None
        return self

    def length_per_key(self) -> List[int]:
        """Number of ids of each key (cached; one synchronisation the first time)."""
        cached = self._length_per_key
        if cached is None:
            variable = self._variable_stride_per_key
            if len(self._keys) == 0:
                cached = torch.jit.annotate(List[int], [])
            elif self._values.is_meta:
                # meta tensors hold no lengths: an even split of the values (the rest to key 0), as TorchRec, so a
                # module built on meta propagates shapes
                cached = [self._values.shape[0] // len(self._keys)] * len(self._keys)
                cached[0] += self._values.shape[0] % len(self._keys)
            elif variable is not None:
                sums = [chunk.sum().view(1) for chunk in torch.split(self._lengths, variable)]
                cached = torch.jit.annotate(List[int], torch.cat(sums).tolist())
            else:
                cached = torch.jit.annotate(
                    List[int],
                    self._lengths.view(len(self._keys), self._stride).sum(dim=1).tolist(),
                )
            self._length_per_key = cached
        return cached

    def offset_per_key(self) -> List[int]:
        """[F + 1] start of each key's ids in values, then N."""
        cached = self._offset_per_key
        if cached is None:
            cached = [0]
            for n in self.length_per_key():
                cached.append(cached[-1] + n)
            self._offset_per_key = cached
        return cached

    def split_by_key(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """([F] values of each key, [F] offsets of each key): views of values, and [B + 1]
        offsets starting at 0 in the lengths' dtype, the tensors ``to_dict()`` gives each
        key without building a JaggedTensor per key. Cached, like length_per_key: modules
        reading the same KJT split it once.
        """
        cached = self._split_by_key
        if cached is None:
            if self._variable_stride_per_key is not None:
                per_key = [_offsets_from_lengths(lengths) for lengths in self._per_key_lengths()]
            else:
                lengths = self._key_lengths()
                offsets = torch.cat([lengths.new_zeros(lengths.shape[0], 1), torch.cumsum(lengths, dim=1, dtype=lengths.dtype)], dim=1)
                per_key = list(offsets.unbind(0))
            cached = (list(torch.split(self._values, self.length_per_key())), per_key)
            self._split_by_key = cached
        return cached

    def index_per_key(self) -> Dict[str, int]:
        """{key: its position in keys()}; a repeated key maps to its last position."""
        out: Dict[str, int] = {}
        for i, k in enumerate(self._keys):
            out[k] = i
        return out

    def _key_index(self, key: str) -> int:
        index = self.index_per_key()
        if key not in index:
            raise ValueError(f"KeyedJaggedTensor has no key '{key}'; keys are {self._keys}")
        return index[key]

    def _key_lengths(self) -> torch.Tensor:
        """[F, B] view of lengths (a variable-batch KJT has none: ValueError)."""
        self._refuse_variable_stride("_key_lengths ([F, B] lengths)")
        return self._lengths.view(len(self._keys), self._stride)

    def __getitem__(self, key: str) -> JaggedTensor:
        i = self._key_index(key)
        start = self.offset_per_key()[i]
        end = self.offset_per_key()[i + 1]
        w = self._weights
        lengths = self._per_key_lengths()[i] if self._variable_stride_per_key is not None else self._key_lengths()[i]
        return JaggedTensor(
            values=self._values[start:end],
            weights=None if w is None else w[start:end],
            lengths=lengths,
            offsets=self._no_rows_offsets(lengths),
        )

    def _no_rows_offsets(self, key_lengths: torch.Tensor) -> Optional[torch.Tensor]:
        """A key's offsets for its JaggedTensor: with batch size 0 its (empty) lengths, as ``JaggedTensor.empty()``'s
        and TorchRec's ``to_dict()``; else None (derived, [B + 1])."""
        if self._variable_stride_per_key is None and self._stride == 0:
            return key_lengths
        return None

    def to_dict(self) -> Dict[str, JaggedTensor]:
        """{key: JaggedTensor} in key order; values are views, not copies (the constructor's ``jt_dict`` if given)."""
        given = self._jt_dict
        if given is not None:
            return given
        lpk = self.length_per_key()
        values = torch.split(self._values, lpk)
        w = self._weights
        weights = torch.split(w, lpk) if w is not None else None
        lengths = self._per_key_lengths()
        out: Dict[str, JaggedTensor] = {}
        for i, key in enumerate(self._keys):
            out[key] = JaggedTensor(
                values=values[i],
                weights=None if weights is None else weights[i],
                lengths=lengths[i],
                offsets=self._no_rows_offsets(lengths[i]),
            )
        return out

    # -- reshaping ---------------------------------------------------------

    def permute(
        self, indices: List[int], indices_tensor: Optional[torch.Tensor] = None
    ) -> "KeyedJaggedTensor":
        """A KJT whose key j is this KJT's key indices[j].

        Keys may be dropped or repeated: permute([0, 0, 1]) gives keys [a, a, b].
        indices_tensor (Optional[Tensor]): [len(indices)] int, the same indices
        already on this KJT's device (saves a copy).

        A variable-batch KJT keeps each key's batch sizes (its ``stride_per_key_per_rank`` rows permuted alike) and
        its stride; as TorchRec's, the result has no ``inverse_indices``.
        """
        num_keys = len(self._keys)
        for i in indices:
            if i < 0 or i >= num_keys:
                raise ValueError(f"permute: index {i} out of range for {num_keys} keys")
        spkpr = self._stride_per_key_per_rank
        if spkpr is not None:
            return self._permute_variable_stride(indices, indices_tensor, spkpr)
        lpk = self.length_per_key()
        opk = self.offset_per_key()
        values: List[torch.Tensor] = []
        weights: List[torch.Tensor] = []
        w = self._weights
        for i in indices:
            values.append(self._values[opk[i] : opk[i + 1]])
            if w is not None:
                weights.append(w[opk[i] : opk[i + 1]])
        index = indices_tensor if indices_tensor is not None else torch.tensor(
            indices, dtype=torch.int64, device=self._lengths.device
        )
        return KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=[self._keys[i] for i in indices],
            values=torch.cat(values) if len(values) > 0 else self._values[:0],
            weights=None if w is None else (torch.cat(weights) if len(weights) > 0 else w[:0]),
            lengths=self._key_lengths().index_select(0, index).reshape(-1),
            stride=self._stride,
            length_per_key=[lpk[i] for i in indices],
            offsets=None,
            stride_per_key_per_rank=None,
            inverse_indices=None,
        )

    def _permute_variable_stride(
        self, indices: List[int], indices_tensor: Optional[torch.Tensor], spkpr: List[List[int]]
    ) -> "KeyedJaggedTensor":
        """``permute`` of a variable-batch KJT: each key's run of lengths (``stride_per_key()[k]`` entries) and of
        values / weights (``length_per_key()[k]``) taken in the order of ``indices``."""
        lpk = self.length_per_key()
        order = indices_tensor if indices_tensor is not None else torch.tensor(
            indices, dtype=torch.int64, device=self._lengths.device
        )
        rows = torch.tensor(self.stride_per_key(), dtype=torch.int64, device=self._lengths.device)
        lengths, values, weights = permute_jagged(self._lengths, self._values, self._weights, rows, order)
        return KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=[self._keys[i] for i in indices],
            values=values,
            weights=weights,
            lengths=lengths,
            stride=self._stride,
            length_per_key=[lpk[i] for i in indices],
            offsets=None,
            stride_per_key_per_rank=[spkpr[i] for i in indices],
            inverse_indices=None,
        )

    def flatten_lengths(self) -> "KeyedJaggedTensor":
        """This KJT with lengths as one [F * B] vector, which recship's lengths always are."""
        return KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=self._keys,
            values=self._values,
            weights=self._weights,
            lengths=self._lengths.view(-1),
            offsets=self._offsets,
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            length_per_key=self._length_per_key,
            inverse_indices=self._inverse_indices,
        )

    def split(self, segments: List[int]) -> List["KeyedJaggedTensor"]:
        """Splits the keys into consecutive groups of the given sizes (sum = number of keys).

        As TorchRec's: a group of all the keys is this KJT itself; each other part keeps the stride and, for a
        variable-batch KJT, its keys' ``stride_per_key_per_rank`` rows, and has no ``inverse_indices``."""
        total = 0
        for s in segments:
            if s < 0:
                raise ValueError(f"split: segment sizes must be >= 0, got {segments}")
            total += s
        if total != len(self._keys):
            raise ValueError(
                f"split: segments {segments} sum to {total}, but the KJT has {len(self._keys)} keys"
            )
        lpk = self.length_per_key()
        opk = self.offset_per_key()
        lopk = self.lengths_offset_per_key()
        spkpr = self._stride_per_key_per_rank
        w = self._weights
        out: List[KeyedJaggedTensor] = []
        start = 0
        for s in segments:
            end = start + s
            if s == len(self._keys):
                out.append(self)
            else:
                out.append(
                    KeyedJaggedTensor(
                        stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None,
                        jt_dict=None,
                        keys=self._keys[start:end],
                        values=self._values[opk[start] : opk[end]],
                        weights=None if w is None else w[opk[start] : opk[end]],
                        lengths=self._lengths[lopk[start] : lopk[end]],
                        stride=self._stride,
                        length_per_key=lpk[start:end],
                        offsets=None,
                        stride_per_key_per_rank=None if spkpr is None else spkpr[start:end],
                        inverse_indices=None,
                    )
                )
            start = end
        return out

    @staticmethod
    def concat(kjts: List["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Joins KJTs of the same batch size key-wise: keys of kjts[0], then kjts[1], ...

        As TorchRec's ``concat``; a key in several inputs appears several times.
        ``concat_batch`` joins along the batch instead.
        """
        if len(kjts) == 0:
            raise ValueError("concat: no KeyedJaggedTensors given")
        stride = kjts[0].stride()
        weighted = kjts[0].weights_or_none() is not None
        keys: List[str] = []
        values: List[torch.Tensor] = []
        weights: List[torch.Tensor] = []
        lengths: List[torch.Tensor] = []
        # Passed on only if every input has it cached, so concat never synchronises.
        length_per_key: List[int] = []
        all_cached = True
        for kjt in kjts:
            kjt._refuse_variable_stride("concat")
            if kjt.stride() != stride:
                raise ValueError(
                    f"concat: batch sizes differ ({stride} vs {kjt.stride()}); "
                    "concat joins keys, concat_batch joins batches"
                )
            w = kjt.weights_or_none()
            if (w is not None) != weighted:
                raise ValueError("concat: either all KJTs have weights or none")
            keys.extend(kjt.keys())
            values.append(kjt.values())
            lengths.append(kjt.lengths())
            if w is not None:
                weights.append(w)
            cached = kjt._length_per_key
            if cached is None:
                all_cached = False
            else:
                length_per_key.extend(cached)
        return KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=keys,
            values=torch.cat(values),
            weights=torch.cat(weights) if weighted else None,
            lengths=torch.cat(lengths),
            stride=stride,
            length_per_key=length_per_key if all_cached else None,
            offsets=None,
            stride_per_key_per_rank=None,
            inverse_indices=None,
        )

    @staticmethod
    def concat_batch(kjts: List["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """Joins KJTs with the same keys along the batch: examples of kjts[0], then kjts[1], ...

        This is how requests are batched. (``concat`` joins keys, as in TorchRec.)
        """
        if len(kjts) == 0:
            raise ValueError("concat_batch: no KeyedJaggedTensors given")
        first = kjts[0]
        keys = first.keys()
        weighted = first.weights_or_none() is not None
        for kjt in kjts:
            kjt._refuse_variable_stride("concat_batch")
        for other in kjts[1:]:
            if other.keys() != keys:
                raise ValueError(f"concat_batch: keys differ: {keys} vs {other.keys()}")
            if (other.weights_or_none() is not None) != weighted:
                raise ValueError("concat_batch: either all KJTs have weights or none")
        num_keys = len(keys)
        # Per input: its ids split by key; the output takes key 0 of every input, then key 1, ...
        value_parts: List[List[torch.Tensor]] = []
        weight_parts: List[List[torch.Tensor]] = []
        for kjt in kjts:
            lpk = kjt.length_per_key()
            value_parts.append(list(torch.split(kjt.values(), lpk)))
            if weighted:
                weight_parts.append(list(torch.split(kjt.weights(), lpk)))
        values: List[torch.Tensor] = []
        weights: List[torch.Tensor] = []
        length_per_key: List[int] = []
        for k in range(num_keys):
            n = 0
            for j in range(len(kjts)):
                values.append(value_parts[j][k])
                n += value_parts[j][k].shape[0]
                if weighted:
                    weights.append(weight_parts[j][k])
            length_per_key.append(n)
        lengths = torch.cat([kjt.lengths().view(num_keys, kjt.stride()) for kjt in kjts], dim=1)
        stride = 0
        for kjt in kjts:
            stride += kjt.stride()
        return KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=keys,
            values=torch.cat(values) if num_keys > 0 else first.values(),
            weights=(torch.cat(weights) if num_keys > 0 else first.weights()) if weighted else None,
            lengths=lengths.reshape(-1),
            stride=stride,
            length_per_key=length_per_key,
            offsets=None,
            stride_per_key_per_rank=None,
            inverse_indices=None,
        )

    # -- input distribution (TorchRec's all-to-all protocol) ----------------

    def dist_labels(self) -> List[str]:
        """Names of the tensors ``dist_tensors()`` returns: lengths, values, then strides (variable batch) and
        weights where present."""
        labels = ["lengths", "values"]
        if self._stride_per_key_per_rank is not None:
            labels.append("strides")
        if self._weights is not None:
            labels.append("weights")
        return labels

    def dist_splits(self, key_splits: List[int]) -> List[List[int]]:
        """For consecutive groups of ``key_splits`` keys (one group per destination rank), how many entries of
        each ``dist_tensors()`` tensor go to each: [examples per group, ids per group] (+ the keys per group with
        variable batch, + ids per group with weights)."""
        batch_size_per_split = _sum_by_splits(self.stride_per_key(), key_splits)
        length_per_split = _sum_by_splits(self.length_per_key(), key_splits)
        splits = [batch_size_per_split, length_per_split]
        if self._stride_per_key_per_rank is not None:
            splits.append(key_splits)
        if self._weights is not None:
            splits.append(length_per_split)
        return splits

    def dist_tensors(self) -> List[torch.Tensor]:
        """[lengths [F * B], values [N]] (+ [F] batch size of each key with variable batch, + weights [N])."""
        tensors = [self._lengths, self._values]
        if self._stride_per_key_per_rank is not None:
            tensors.append(torch.tensor(self.stride_per_key(), dtype=torch.int64, device=self._values.device))
        w = self._weights
        if w is not None:
            tensors.append(w)
        return tensors

    @staticmethod
    def dist_init(
        keys: List[str],
        tensors: List[torch.Tensor],
        variable_stride_per_key: bool,
        num_workers: int,
        recat: Optional[torch.Tensor],
        stride_per_rank: Optional[List[int]],
        stagger: int = 1,
    ) -> "KeyedJaggedTensor":
        """The KJT a rank builds from what ``num_workers`` ranks sent it (each rank's ``dist_tensors()`` for its
        share of ``keys``, concatenated rank after rank), as TorchRec's.

        ``recat`` ([num_workers * F] int, or per example when ranks sent different batch sizes) reorders the
        received runs from rank-major to key-major; ``stride_per_rank`` ([num_workers]) is each rank's batch size
        (fixed batch); with ``variable_stride_per_key`` tensors[2] is [num_workers * F] batch sizes (rank-major)
        and ``stagger`` > 1 reorders the ranks of each key's ``stride_per_key_per_rank`` row as TorchRec's.
        """
        if len(tensors) < 2 or len(tensors) > 4:
            raise ValueError(f"KeyedJaggedTensor.dist_init: tensors has {len(tensors)} entries; 2 to 4 are "
                             "[lengths, values, (strides), (weights)]")
        num_keys = len(keys)
        lengths = tensors[0]
        values = tensors[1]
        has_weights = len(tensors) == (4 if variable_stride_per_key else 3)
        weights = tensors[-1] if has_weights else None
        if variable_stride_per_key:
            if len(tensors) < 3:
                raise ValueError("KeyedJaggedTensor.dist_init: variable_stride_per_key needs tensors[2], the batch "
                                 "sizes [num_workers * F]")
            strides = tensors[2]
            if strides.numel() != num_workers * num_keys:
                raise ValueError(f"KeyedJaggedTensor.dist_init: {strides.numel()} batch sizes for {num_workers} "
                                 f"workers x {num_keys} keys")
            if recat is not None:
                lengths, values, weights = permute_jagged(lengths, values, weights, strides, recat)
            spkpr = torch.jit.annotate(List[List[int]], strides.view(num_workers, num_keys).t().tolist())
            if num_workers * num_keys == 0:
                spkpr = [[0] for _ in range(num_keys)]
            if stagger > 1:
                if num_workers % stagger != 0:
                    raise ValueError(f"KeyedJaggedTensor.dist_init: stagger {stagger} does not divide "
                                     f"num_workers {num_workers}")
                # ranks as arange(num_workers).view(stagger, -1).T.reshape(-1)
                per_group = num_workers // stagger
                ranks: List[int] = []
                for j in range(per_group):
                    for i in range(stagger):
                        ranks.append(i * per_group + j)
                spkpr = [[row[r] for r in ranks] for row in spkpr]
            kjt = KeyedJaggedTensor(
                stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None,
                jt_dict=None, keys=keys, values=values, weights=weights, lengths=lengths, offsets=None, stride=None,
                length_per_key=None, stride_per_key_per_rank=spkpr, inverse_indices=None,
            )
            return kjt.sync()
        if stride_per_rank is None:
            raise ValueError("KeyedJaggedTensor.dist_init: a fixed-batch KJT needs stride_per_rank")
        if recat is not None and len(stride_per_rank) > 0:
            stride = stride_per_rank[0]
            same_batch = True
            for b in stride_per_rank:
                if b != stride:
                    same_batch = False
            if not same_batch:  # recat orders single lengths entries
                rows = torch.ones(lengths.shape[0], dtype=torch.int64, device=lengths.device)
                lengths, values, weights = permute_jagged(lengths, values, weights, rows, recat)
            elif stride > 0:  # recat orders runs of `stride` lengths (one rank's examples of one key)
                rows = torch.full([lengths.shape[0] // stride], stride, dtype=torch.int64, device=lengths.device)
                lengths, values, weights = permute_jagged(lengths, values, weights, rows, recat)
        total = 0
        for b in stride_per_rank:
            total += b
        kjt = KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None,
            jt_dict=None, keys=keys, values=values, weights=weights, lengths=lengths, offsets=None, stride=total,
            length_per_key=None, stride_per_key_per_rank=None, inverse_indices=None,
        )
        return kjt.sync()

    # -- devices -----------------------------------------------------------

    def _with_known(self, kjt: "KeyedJaggedTensor") -> "KeyedJaggedTensor":
        """kjt (a copy of this KJT) reporting lengths / offsets through ``*_or_none`` as this one does."""
        kjt._lengths_known = self._lengths_known
        kjt._offsets_known = self._offsets_known
        return kjt

    def to(self, device: torch.device, non_blocking: bool = False) -> "KeyedJaggedTensor":
        w = self._weights
        moved = KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=self._keys,
            values=self._values.to(device, non_blocking=non_blocking),
            weights=None if w is None else w.to(device, non_blocking=non_blocking),
            lengths=self._lengths.to(device, non_blocking=non_blocking),
            offsets=self._offsets.to(device, non_blocking=non_blocking),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            length_per_key=self._length_per_key,
            inverse_indices=_inverse_indices_to(self._inverse_indices, device, non_blocking),
        )
        return self._with_known(moved)

    @torch.jit.unused
    def record_stream(self, stream: torch.Stream) -> None:
        """Marks every tensor it holds as in use by CUDA ``stream`` (``Tensor.record_stream``)."""
        ii = self._inverse_indices
        _record_stream([self._values, self._weights, self._lengths, self._offsets, None if ii is None else ii[1]], stream)

    def pin_memory(self) -> "KeyedJaggedTensor":
        w = self._weights
        pinned = KeyedJaggedTensor(
            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
            keys=self._keys,
            values=self._values.pin_memory(),
            weights=None if w is None else w.pin_memory(),
            lengths=self._lengths.pin_memory(),
            offsets=self._offsets.pin_memory(),
            stride=self._stride,
            stride_per_key_per_rank=self._stride_per_key_per_rank,
            length_per_key=self._length_per_key,
            inverse_indices=self._inverse_indices,
        )
        return self._with_known(pinned)

    @torch.jit.unused
    def __str__(self) -> str:
        if len(self._keys) == 0:
            return "KeyedJaggedTensor()\n"
        lengths = [per_key.tolist() for per_key in self._per_key_lengths()]
        lpk = self.length_per_key()
        values = torch.split(self._values, lpk)
        weights = torch.split(self._weights, lpk) if self._weights is not None else None
        lines = []
        for i, key in enumerate(self._keys):
            if weights is None:
                line = f'    "{key}": ' + _nested_lists(values[i], lengths[i])
            else:
                line = (f'    "{key}": {{\n        "values": ' + _nested_lists(values[i], lengths[i])
                        + ',\n        "weights": ' + _nested_lists(weights[i], lengths[i]) + "\n    }")
            lines.append(line)
        return "KeyedJaggedTensor({\n" + ",\n".join(lines) + "\n})\n"

    @torch.jit.unused
    def __repr__(self) -> str:
        return self.__str__()

    @torch.jit.unused
    def __fx_create_arg__(self, tracer):  # noqa: ANN001 (fx hook)
        args = (self._keys, self._values, self._weights, self._lengths, self._offsets, self._stride)
        if self._stride_per_key_per_rank is not None or self._inverse_indices is not None:
            args = args + (self._stride_per_key_per_rank, None, self._inverse_indices)
        return tracer.create_node("call_function", KeyedJaggedTensor, args=tracer.create_arg(args), kwargs={})


# inspect.signature(KeyedJaggedTensor) would otherwise show the metaclass's (*args, **kwargs)
KeyedJaggedTensor.__signature__ = inspect.signature(KeyedJaggedTensor.__init__).replace(  # type: ignore[attr-defined]
    parameters=list(inspect.signature(KeyedJaggedTensor.__init__).parameters.values())[1:], return_annotation=inspect.Signature.empty)


def _kjt_empty_like(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """KeyedJaggedTensor.empty_like's body: an fx leaf, since it reads the weights' presence."""
    w = kjt.weights_or_none()
    return KeyedJaggedTensor(
        stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None, jt_dict=None,
        keys=[],
        values=torch.empty(0, dtype=kjt.values().dtype, device=kjt.device()),
        weights=None if w is None else torch.empty(0, dtype=w.dtype, device=kjt.device()),
        lengths=torch.empty(0, dtype=kjt.lengths().dtype, device=kjt.device()),
        stride=kjt.stride(),
        offsets=None,
        length_per_key=None,
        stride_per_key_per_rank=None,
        inverse_indices=None,
    )


torch.fx.wrap("_kjt_empty_like")


def _synced_kjt(
    keys: List[str],
    values: torch.Tensor,
    weights: Optional[torch.Tensor],
    lengths: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
    stride: Optional[int],
    stride_per_key_per_rank: Optional[List[List[int]]],
    inverse_indices: Optional[Tuple[List[str], torch.Tensor]],
) -> KeyedJaggedTensor:
    """from_lengths_sync / from_offsets_sync's body: the KJT of ``lengths`` or ``offsets``, its length_per_key
    computed now."""
    kjt = KeyedJaggedTensor(keys=keys, values=values, weights=weights, lengths=lengths, offsets=offsets, stride=stride,
                            length_per_key=None, stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices,
                            stride_per_key=None, lengths_offset_per_key=None, offset_per_key=None, index_per_key=None,
                            jt_dict=None)
    kjt.length_per_key()
    return kjt


def _inverse_indices_to(
    inverse_indices: Optional[Tuple[List[str], torch.Tensor]], device: torch.device, non_blocking: bool
) -> Optional[Tuple[List[str], torch.Tensor]]:
    if inverse_indices is None:
        return None
    return (inverse_indices[0], inverse_indices[1].to(device, non_blocking=non_blocking))


def _check_kt(keys: List[str], length_per_key: List[int], values: torch.Tensor, key_dim: int) -> None:
    if len(keys) != len(length_per_key):
        raise ValueError(
            f"KeyedTensor: {len(keys)} keys but {len(length_per_key)} lengths per key"
        )
    if key_dim < 0 or key_dim >= values.dim():
        raise ValueError(f"KeyedTensor: key_dim {key_dim} out of range for {values.dim()}-D values")
    total = 0
    for n in length_per_key:
        total += n
    if total != values.shape[key_dim]:
        raise ValueError(
            f"KeyedTensor: sum(length_per_key) = {total} but values has "
            f"{values.shape[key_dim]} along dim {key_dim}"
        )


# ---------------------------------------------------------------------------
# KeyedTensor
# ---------------------------------------------------------------------------


class KeyedTensor:
    """Dense per-key results, e.g. pooled embeddings, concatenated along key_dim.

    Args:
        keys (List[str]): K names.
        length_per_key (List[int]): width of each key along key_dim (e.g. its embedding dim).
        values (Tensor): [B, sum(length_per_key)] for key_dim=1.
        key_dim (int): the dimension the keys are concatenated along.
        offset_per_key / index_per_key: TorchRec's precomputed running widths and key positions, taken as they are
            after a check that they are right (ValueError otherwise).
    """

    def __init__(
        self,
        keys: List[str],
        length_per_key: List[int],
        values: torch.Tensor,
        key_dim: int = 1,
        offset_per_key: Optional[List[int]] = None,
        index_per_key: Optional[Dict[str, int]] = None,
    ) -> None:
        if torch.jit.is_scripting():
            _check_kt(keys, length_per_key, values, key_dim)
        elif not _is_proxy(values):
            _check_kt(keys, length_per_key, values, key_dim)
            _check_kt_caches(keys, length_per_key, offset_per_key, index_per_key)
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = offset_per_key

    @staticmethod
    def from_tensor_list(keys: List[str], tensors: List[torch.Tensor], key_dim: int = 1, cat_dim: int = 1) -> "KeyedTensor":
        """One key per tensor, its width along ``key_dim``; the tensors joined along ``cat_dim`` (as TorchRec's)."""
        return KeyedTensor(
            offset_per_key=None, index_per_key=None,
            keys=keys,
            length_per_key=[t.shape[key_dim] for t in tensors],
            values=torch.cat(tensors, dim=cat_dim),
            key_dim=key_dim,
        )

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> List[int]:
        return self._length_per_key

    def offset_per_key(self) -> List[int]:
        cached = self._offset_per_key
        if cached is None:
            cached = [0]
            for n in self._length_per_key:
                cached.append(cached[-1] + n)
            self._offset_per_key = cached
        return cached

    def __getitem__(self, key: str) -> torch.Tensor:
        for i, k in enumerate(self._keys):
            if k == key:
                opk = self.offset_per_key()
                return self._values.narrow(self._key_dim, opk[i], self._length_per_key[i])
        raise ValueError(f"KeyedTensor has no key '{key}'; keys are {self._keys}")

    def to_dict(self) -> Dict[str, torch.Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        out: Dict[str, torch.Tensor] = {}
        for i, key in enumerate(self._keys):
            out[key] = parts[i]
        return out

    @staticmethod
    def regroup(keyed_tensors: List["KeyedTensor"], groups: List[List[str]]) -> List[torch.Tensor]:
        """One tensor per group: the named keys' columns concatenated in the group's order."""
        parts: Dict[str, torch.Tensor] = {}
        key_dim = 1
        for kt in keyed_tensors:
            key_dim = kt.key_dim()
            for key, t in kt.to_dict().items():
                if key in parts:
                    raise ValueError(f"regroup: key '{key}' appears in more than one KeyedTensor")
                parts[key] = t
        out: List[torch.Tensor] = []
        for group in groups:
            tensors: List[torch.Tensor] = []
            for key in group:
                if key not in parts:
                    raise ValueError(f"regroup: no KeyedTensor has key '{key}'")
                tensors.append(parts[key])
            out.append(torch.cat(tensors, dim=key_dim))
        return out

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: List["KeyedTensor"], groups: List[List[str]], keys: List[str]
    ) -> Dict[str, torch.Tensor]:
        """``regroup`` with the i-th group's tensor returned under keys[i]."""
        if len(groups) != len(keys):
            raise ValueError(f"regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
        tensors = KeyedTensor.regroup(keyed_tensors, groups)
        return {key: tensors[i] for i, key in enumerate(keys)}

    def to(self, device: torch.device, non_blocking: bool = False) -> "KeyedTensor":
        return KeyedTensor(
            offset_per_key=None, index_per_key=None,
            keys=self._keys,
            length_per_key=self._length_per_key,
            values=self._values.to(device, non_blocking=non_blocking),
            key_dim=self._key_dim,
        )

    @torch.jit.unused
    def record_stream(self, stream: torch.Stream) -> None:
        """Marks the values as used on ``stream`` (CUDA), as TorchRec's."""
        _record_stream([self._values], stream)

    @torch.jit.unused
    def __str__(self) -> str:
        shape = tuple(self._values.shape)
        pairs = ", ".join(f"'{k}': {n}" for k, n in zip(self._keys, self._length_per_key))
        return f"KeyedTensor(values {shape}, {{{pairs}}})"

    @torch.jit.unused
    def __repr__(self) -> str:
        return self.__str__()

    @torch.jit.unused
    def __fx_create_arg__(self, tracer):  # noqa: ANN001 (fx hook)
        return tracer.create_node(
            "call_function",
            KeyedTensor,
            args=tracer.create_arg((self._keys, self._length_per_key, self._values, self._key_dim)),
            kwargs={},
        )


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def jt_is_equal(jt_1: Any, jt_2: Any) -> bool:
    """Whether two JaggedTensors hold the same values, lengths, offsets and weights (dtypes and devices too);
    False for anything that is not a JaggedTensor (TorchRec's ``jt_is_equal``)."""
    if not isinstance(jt_1, JaggedTensor) or not isinstance(jt_2, JaggedTensor):
        return False
    return all(_same(getattr(jt_1, f)(), getattr(jt_2, f)()) for f in ("values", "lengths", "offsets", "weights_or_none"))


def kjt_is_equal(kjt_1: Any, kjt_2: Any) -> bool:
    """Whether two KeyedJaggedTensors have the same keys and batch size and hold the same values, lengths, offsets
    and weights (dtypes and devices too); False for anything that is not a KeyedJaggedTensor (TorchRec's)."""
    if not isinstance(kjt_1, KeyedJaggedTensor) or not isinstance(kjt_2, KeyedJaggedTensor):
        return False
    if kjt_1.keys() != kjt_2.keys() or kjt_1.stride() != kjt_2.stride():
        return False
    return all(_same(getattr(kjt_1, f)(), getattr(kjt_2, f)()) for f in ("values", "lengths", "offsets", "weights_or_none"))
