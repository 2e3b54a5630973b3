"""TorchRec's module helpers (``torchrec.modules.utils``; re-exported by ``recship.models.layers``, where the import map
sends that path): building module lists, probing a module's output width, splitting a sequence lookup's rows into
per-feature JaggedTensors, and the id helpers of the embedding kernels.

``construct_jagged_tensors`` is what an EmbeddingCollection does with its table-batched rows:

    embeddings [sum of the KJT's lengths, D], features (KJT, keys f1, f2), embedding_names ["f1", "f2"]
        -> {"f1": JaggedTensor(lengths=features["f1"].lengths(), values=[its rows, D]), "f2": ...}
"""

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union, cast

import torch
from torch import nn

from recship.sparse import CacheMixin, JaggedTensor, KeyedJaggedTensor
from recship.sparse.streamable import Multistreamable

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def extract_module_or_tensor_callable(
        module_or_callable: Union[Callable[[], nn.Module], nn.Module, TensorFn]) -> Union[nn.Module, TensorFn]:
    """A module factory (a callable taking no argument) called for its module; a function of a tensor returned as
    it is. ValueError when a factory returns something other than an nn.Module."""
    try:
        module = module_or_callable()  # type: ignore[call-arg]
    except TypeError as e:
        if "required positional argument" in str(e):
            return cast(TensorFn, module_or_callable)  # a function of the tensor
        raise
    if not isinstance(module, nn.Module):
        raise ValueError(f"a callable that takes no input must return a torch.nn.Module, got {type(module)}")
    return module


def get_module_output_dimension(module: Union[TensorFn, nn.Module], in_features: int) -> int:
    """The last dimension of ``module``'s output for one row of ``in_features`` zeros."""
    return module(torch.zeros(1, in_features)).size(-1)


def check_module_output_dimension(module: Union[Iterable[nn.Module], nn.Module], in_features: int,
                                  out_features: int) -> bool:
    """Whether ``module`` (every module of a list or ModuleList, recursively) maps ``in_features`` to
    ``out_features``."""
    if isinstance(module, (list, nn.ModuleList)):
        return all(check_module_output_dimension(m, in_features, out_features) for m in module)
    return get_module_output_dimension(cast(nn.Module, module), in_features) == out_features


def init_mlp_weights_xavier_uniform(m: nn.Module) -> None:
    """For ``module.apply``: an nn.Linear's weight xavier-uniform, its bias zero; other modules untouched."""
    if isinstance(m, nn.Linear):
        nn.init.xavier_uniform_(m.weight)
        m.bias.data.fill_(0.0)


def construct_modulelist_from_single_module(module: nn.Module, sizes: Tuple[int, ...]) -> nn.Module:
    """Nested ModuleLists of ``sizes`` (outermost first) of deep copies of ``module``, each copy's Linear layers
    re-initialised (``init_mlp_weights_xavier_uniform``)."""
    if len(sizes) == 1:
        return nn.ModuleList([copy.deepcopy(module).apply(init_mlp_weights_xavier_uniform) for _ in range(sizes[0])])
    return nn.ModuleList([construct_modulelist_from_single_module(module, sizes[1:]) for _ in range(sizes[0])])


def convert_list_of_modules_to_modulelist(modules: Iterable[nn.Module], sizes: Tuple[int, ...]) -> nn.Module:
    """Nested lists of modules of ``sizes`` as nested ModuleLists; ValueError when a level's count differs."""
    modules = list(modules)
    if len(modules) != sizes[0]:
        raise ValueError(f"the counts of modules ({len(modules)}) do not match with the required counts {sizes}")
    if len(sizes) == 1:
        return nn.ModuleList(modules)
    return nn.ModuleList(convert_list_of_modules_to_modulelist(m, sizes[1:]) for m in modules)  # type: ignore[arg-type]


@dataclass
class SequenceVBEContext(Multistreamable):
    """How a sequence lookup's rows of a variable-batch KJT are put back in the features' order:
    ``recat`` [segments] int (the segment each output segment takes), ``unpadded_lengths`` [segments] (each segment's
    row count), ``reindexed_lengths`` [F, B] and ``reindexed_length_per_key`` [F] (the output's), and optionally
    ``reindexed_values`` (the ids, for need_indices)."""

    recat: torch.Tensor
    unpadded_lengths: torch.Tensor
    reindexed_lengths: torch.Tensor
    reindexed_length_per_key: List[int]
    reindexed_values: Optional[torch.Tensor] = None

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.recat, self.unpadded_lengths, self.reindexed_lengths, self.reindexed_values):
            if t is not None:
                t.record_stream(stream)


def _vbe_reindex(embeddings: torch.Tensor, ctx: SequenceVBEContext
                 ) -> Tuple[torch.Tensor, torch.Tensor, List[int], Optional[torch.Tensor]]:
    """The rows [N, D] permuted segment by segment (``ctx.recat``), with the context's lengths."""
    dim = embeddings.shape[1]
    if ctx.reindexed_lengths.dim() != 2:
        raise ValueError(f"SequenceVBEContext.reindexed_lengths must be [F, B], got shape {list(ctx.reindexed_lengths.shape)}")
    _, flat, _ = torch.ops.fbgemm.permute_1D_sparse_data(
        ctx.recat, ctx.unpadded_lengths * dim, embeddings.flatten(), None, sum(ctx.reindexed_length_per_key) * dim)
    return flat.view(-1, dim), ctx.reindexed_lengths, ctx.reindexed_length_per_key, ctx.reindexed_values


def _jagged_tensors(embeddings: torch.Tensor, lengths: torch.Tensor, length_per_key: List[int],
                    values: Optional[torch.Tensor], embedding_names: List[str], need_indices: bool,
                    features_to_permute_indices: Optional[Dict[str, List[int]]]) -> Dict[str, JaggedTensor]:
    """One JaggedTensor per distinct name of ``embedding_names`` (one per feature, in key order): the feature's
    lengths, its rows (a name repeated over several features, e.g. a column-wise split table, joins their rows
    side by side) and, with ``need_indices``, its ids as weights."""
    per_key_lengths = torch.unbind(lengths, dim=0)
    rows = torch.split(embeddings, length_per_key, dim=0)
    ids = torch.split(values, length_per_key) if need_indices and values is not None else None
    positions: Dict[str, List[int]] = defaultdict(list)
    for i, name in enumerate(embedding_names):
        positions[name].append(i)
    out: Dict[str, JaggedTensor] = {}
    for name, where in positions.items():
        if features_to_permute_indices and name in features_to_permute_indices:
            where = [where[p] for p in features_to_permute_indices[name]]
        out[name] = JaggedTensor(
            lengths=per_key_lengths[where[0]],
            values=rows[where[0]] if len(where) == 1 else torch.cat([rows[i] for i in where], dim=1),
            weights=ids[where[0]] if ids is not None else None)
    return out


def construct_jagged_tensors(
    embeddings: torch.Tensor,
    features: KeyedJaggedTensor,
    embedding_names: List[str],
    need_indices: bool = False,
    features_to_permute_indices: Optional[Dict[str, List[int]]] = None,
    original_features: Optional[KeyedJaggedTensor] = None,
    reverse_indices: Optional[torch.Tensor] = None,
    seq_vbe_ctx: Optional[SequenceVBEContext] = None,
    use_gather_select: bool = False,
) -> Dict[str, JaggedTensor]:
    """A sequence lookup's rows as one JaggedTensor per feature.

    Args:
        embeddings: [sum of the features' lengths, D], feature-major (or the deduplicated rows, with
            ``reverse_indices``).
        features: the KJT looked up (its lengths and length_per_key cut the rows); ``original_features`` replaces it.
        embedding_names: one name per key of ``features``; a name given to several keys joins their rows [n, D1 + D2].
        need_indices: each JaggedTensor carries its ids as weights.
        features_to_permute_indices: name -> the order of its repeated keys.
        reverse_indices: [sum of lengths] the row of ``embeddings`` each id takes (``index_select``, or
            ``gather`` with ``use_gather_select``: the same rows).
        seq_vbe_ctx: a variable-batch KJT's reindexing (``SequenceVBEContext``).
    """
    if original_features is not None:
        features = original_features
    if reverse_indices is not None:
        if use_gather_select:
            embeddings = torch.gather(embeddings, 0, reverse_indices.unsqueeze(1).expand(-1, embeddings.size(-1)))
        else:
            embeddings = torch.index_select(embeddings, 0, reverse_indices)
    if seq_vbe_ctx is not None:
        embeddings, lengths, length_per_key, values = _vbe_reindex(embeddings, seq_vbe_ctx)
    else:
        lengths = features.lengths().view(-1, features.stride())
        length_per_key = features.length_per_key()
        values = features.values()
    return _jagged_tensors(embeddings, lengths, length_per_key, values, embedding_names, need_indices,
                           features_to_permute_indices)


def construct_jagged_tensors_inference(
    embeddings: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    embedding_names: List[str],
    need_indices: bool = False,
    features_to_permute_indices: Optional[Dict[str, List[int]]] = None,
    reverse_indices: Optional[torch.Tensor] = None,
    remove_padding: bool = False,
) -> Dict[str, JaggedTensor]:
    """``construct_jagged_tensors`` from plain tensors: ``lengths`` [F, B], ``values`` [sum of lengths] (the ids),
    ``embeddings`` [rows, D]. ``remove_padding`` drops rows past the lengths' sum."""
    if reverse_indices is not None:
        embeddings = torch.index_select(embeddings, 0, reverse_indices.to(torch.int32))
    elif remove_padding:
        embeddings = embeddings[: int(lengths.sum().item())]
    length_per_key: List[int] = torch.sum(lengths, dim=1).long().tolist()
    return _jagged_tensors(embeddings, lengths, length_per_key, values, embedding_names, need_indices,
                           features_to_permute_indices)


@torch.fx.wrap
def jagged_index_select_with_empty(values: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                                   output_offsets: torch.Tensor) -> torch.Tensor:
    """Rows of a jagged tensor picked by ``ids`` (fbgemm's ``jagged_index_select_2d_forward_v2``): ``values`` [N]
    (flattened to one column), ``offsets`` [rows] its rows' inclusive cumulative lengths (row r ends at
    offsets[r]), ``output_offsets`` [len(ids)] the picked rows' inclusive cumulative lengths
    -> [output_offsets[-1], 1]; no id gives an empty tensor."""
    if ids.size()[0] == 0:
        return torch.empty(0, device=values.device, dtype=values.dtype)
    return torch.ops.fbgemm.jagged_index_select_2d_forward_v2(
        values.flatten().unsqueeze(-1), ids, offsets.long(), output_offsets.long())


def deterministic_dedup(ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the distinct ids sorted, the position in ``ids`` of each one's last occurrence): an update applied at those
    positions has no write race between duplicates."""
    sorted_ids, order = ids.sort()
    unique, inverse = sorted_ids.unique_consecutive(return_counts=False, return_inverse=True)
    last = torch.scatter_reduce(torch.zeros_like(unique, dtype=torch.int64), 0, inverse, order, reduce="amax")
    return unique.view(-1), last.flatten()


def reset_module_states_post_sharding(module: nn.Module) -> None:
    """Clears the cache of every CacheMixin in ``module`` (what sharding invalidates)."""
    for m in module.modules():
        if isinstance(m, CacheMixin):
            m.clear_cache()


def make_hash_zch_buckets_non_persistent(module: nn.Module) -> int:
    """Takes the ``_hash_zch_bucket`` buffer (derived from config) of every submodule out of the state_dict, so that
    checkpoints saved before it existed load; returns how many buffers it changed."""
    count = 0
    for m in module.modules():
        if "_hash_zch_bucket" in m._buffers and "_hash_zch_bucket" not in m._non_persistent_buffers_set:
            m._non_persistent_buffers_set.add("_hash_zch_bucket")
            count += 1
    return count


__all__ = ["CacheMixin", "JaggedTensor", "KeyedJaggedTensor", "Multistreamable", "SequenceVBEContext",
           "check_module_output_dimension", "construct_jagged_tensors", "construct_jagged_tensors_inference",
           "construct_modulelist_from_single_module", "convert_list_of_modules_to_modulelist", "deterministic_dedup",
           "extract_module_or_tensor_callable", "get_module_output_dimension", "init_mlp_weights_xavier_uniform",
           "jagged_index_select_with_empty", "make_hash_zch_buckets_non_persistent",
           "reset_module_states_post_sharding"]
