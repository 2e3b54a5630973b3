"""TorchRec's dense building blocks: ``torchrec.modules.mlp`` (``Perceptron``, ``MLP``), ``torchrec.modules.crossnet``
(``CrossNet``, ``LowRankCrossNet``, ``VectorCrossNet``, ``LowRankMixtureCrossNet``) and
``torchrec.modules.activation`` (``SwishLayerNorm``), ``torchrec.modules.deepfm`` (``DeepFM``,
``FactorizationMachine``); the import map sends those paths here, and ``torchrec.modules.embedding_tower``'s names
(``EmbeddingTower``, ``EmbeddingTowerCollection``, ``tower_input_params``; recship.models.embedding_tower) and
``torchrec.modules.utils``'s (``construct_jagged_tensors``, ``deterministic_dedup``, ...;
recship.models.module_helpers) are re-exported.

Constructors, forward math and parameter names (so state_dict keys and shapes) are TorchRec's: an ``MLP``'s
linear layers are ``_mlp.<i>._linear.weight`` / ``.bias``, a cross net's ``kernels.<layer>`` (or ``W_kernels``,
``V_kernels``, ``U_kernels``, ``C_kernels``), ``bias.<layer>`` and ``gates.<expert>.weight``. Every module maps a
float tensor [B, in] (``*`` leading dims for the MLP) to [B, out]; the cross nets keep the width: [B, N] -> [B, N].
"""

import inspect
from typing import Callable, List, Optional, Union, cast

import torch
from torch import nn

from recship.models.embedding_tower import (EmbeddingBagCollection, EmbeddingCollection, EmbeddingTower,
                                            EmbeddingTowerCollection, KeyedJaggedTensor, tower_input_params)
from recship.models.module_helpers import (CacheMixin, JaggedTensor, Multistreamable, SequenceVBEContext,
                                           check_module_output_dimension, construct_jagged_tensors,
                                           construct_jagged_tensors_inference, construct_modulelist_from_single_module,
                                           convert_list_of_modules_to_modulelist, deterministic_dedup,
                                           extract_module_or_tensor_callable, get_module_output_dimension,
                                           init_mlp_weights_xavier_uniform, jagged_index_select_with_empty,
                                           make_hash_zch_buckets_non_persistent, reset_module_states_post_sharding)

TensorFn = Callable[[torch.Tensor], torch.Tensor]
Activation = Union[str, nn.Module, Callable[[], nn.Module], TensorFn]


class SwishLayerNorm(nn.Module):
    """``x * sigmoid(layer_norm(x))`` over the last dims ``input_dims`` (an int or a list of the trailing sizes);
    parameters ``norm.0.weight`` / ``norm.0.bias`` (the LayerNorm's), as TorchRec's."""

    def __init__(self, input_dims: Union[int, List[int], torch.Size], device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.norm = nn.Sequential(nn.LayerNorm(input_dims, device=device), nn.Sigmoid())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[*, input_dims] -> the same shape."""
        return input * self.norm(input)


def _one_activation(activation: Union[nn.Module, Callable[[], nn.Module], TensorFn]) -> Union[nn.Module, TensorFn]:
    """What one Perceptron of an MLP applies: a module instance is shared by all layers (as in TorchRec), a callable
    taking no argument is a factory called once per layer (it must return an nn.Module), any other callable is applied
    to the tensor as it is (``torch.relu``)."""
    if isinstance(activation, nn.Module):
        return activation
    if not callable(activation):
        raise TypeError(f"MLP activation must be a str, an nn.Module or a callable, got {activation!r}")
    try:
        signature: Optional[inspect.Signature] = inspect.signature(activation)
    except (TypeError, ValueError):  # builtins such as torch.relu have no signature: they take the tensor
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            return cast(TensorFn, activation)  # needs an argument: a function of the tensor
        made = activation()  # type: ignore[call-arg]
        if not isinstance(made, nn.Module):
            raise TypeError(f"MLP activation {activation!r} takes no argument, so it must build an nn.Module; "
                            f"it returned a {type(made).__name__}")
        return made
    return cast(TensorFn, activation)


class Perceptron(nn.Module):
    """``activation(linear(x))``: [*, in_size] -> [*, out_size]. The linear layer is ``_linear`` and the activation
    ``_activation_fn`` (a submodule when it is an nn.Module, so its parameters are in the state_dict), as TorchRec's.

    Args:
        in_size / out_size: the linear layer's widths.
        bias: whether the linear layer has a bias.
        activation: an nn.Module or a function of the tensor; default ``torch.relu``.
        device, dtype: of the linear layer's parameters.
    """

    def __init__(self, in_size: int, out_size: int, bias: bool = True,
                 activation: Union[nn.Module, TensorFn] = torch.relu, device: Optional[torch.device] = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if in_size <= 0 or out_size <= 0:
            raise ValueError(f"Perceptron sizes must be positive, got in_size={in_size}, out_size={out_size}")
        self._in_size = in_size
        self._out_size = out_size
        self._linear = nn.Linear(in_size, out_size, bias=bias, device=device, dtype=dtype)
        self._activation_fn = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[*, in_size] -> [*, out_size]."""
        return self._activation_fn(self._linear(input))


class MLP(nn.Module):
    """A stack of Perceptrons (``_mlp``, an nn.Sequential): [*, in_size] -> [*, layer_sizes[-1]].

    Args:
        in_size: input width.
        layer_sizes: each Perceptron's output width.
        bias: whether the linear layers have biases.
        activation: ``"relu"``, ``"sigmoid"``, ``"swish_layernorm"`` (a SwishLayerNorm of each layer's width, its
            own parameters), an nn.Module (one instance shared by every layer), a callable taking no argument that
            builds an nn.Module (called once per layer) or a function of the tensor; default ``torch.relu``.
        device, dtype: of the parameters.
        activation_on_last: False leaves the last layer linear (its activation is an nn.Identity).
    """

    def __init__(self, in_size: int, layer_sizes: List[int], bias: bool = True, activation: Activation = torch.relu,
                 device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32,
                 activation_on_last: bool = True) -> None:
        super().__init__()
        if not layer_sizes:
            raise ValueError("MLP needs at least one layer size, got []")
        if isinstance(activation, str) and activation not in ("relu", "sigmoid", "swish_layernorm"):
            raise ValueError(f"MLP activation {activation!r}: the strings are 'relu', 'sigmoid' and 'swish_layernorm'")
        if activation == "relu":
            activation = torch.relu
        elif activation == "sigmoid":
            activation = torch.sigmoid
        layers = []
        for i, out_size in enumerate(layer_sizes):
            act: Union[nn.Module, TensorFn]
            if not activation_on_last and i == len(layer_sizes) - 1:
                act = nn.Identity()
            elif activation == "swish_layernorm":
                act = SwishLayerNorm(out_size, device=device)
            else:
                act = _one_activation(activation)  # type: ignore[arg-type]
            layers.append(Perceptron(layer_sizes[i - 1] if i else in_size, out_size, bias=bias, activation=act,
                                     device=device, dtype=dtype))
        self._mlp = nn.Sequential(*layers)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[*, in_size] -> [*, layer_sizes[-1]]."""
        return self._mlp(input)


def _xavier(*shape: int) -> nn.Parameter:
    return nn.Parameter(nn.init.xavier_normal_(torch.empty(*shape)))


def _zeros(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


def _check(name: str, **values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ValueError(f"{name}: {key} must be at least 1, got {value}")


class CrossNet(nn.Module):
    """DCN's full-rank cross layers: ``x_{l+1} = x_0 * (W_l x_l + b_l) + x_l``, W_l ``kernels.<l>`` [N, N], b_l
    ``bias.<l>`` [N, 1] (xavier-normal and zeros at construction). [B, N] -> [B, N]."""

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        _check("CrossNet", in_features=in_features)
        self._num_layers = num_layers
        self.kernels = nn.ParameterList([_xavier(in_features, in_features) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features, 1) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[B, N] -> [B, N]."""
        x0 = input.unsqueeze(2)  # [B, N, 1]
        x = x0
        for kernel, bias in zip(self.kernels, self.bias):
            x = x0 * (torch.matmul(kernel, x) + bias) + x
        return x.squeeze(2)


class LowRankCrossNet(nn.Module):
    """DCN-v2's low-rank cross layers: ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``, W_l ``W_kernels.<l>``
    [N, r], V_l ``V_kernels.<l>`` [r, N], b_l ``bias.<l>`` [N]. [B, N] -> [B, N]."""

    def __init__(self, in_features: int, num_layers: int, low_rank: int = 1) -> None:
        super().__init__()
        _check("LowRankCrossNet", in_features=in_features, low_rank=low_rank)
        self._num_layers = num_layers
        self._low_rank = low_rank
        self.W_kernels = nn.ParameterList([_xavier(in_features, low_rank) for _ in range(num_layers)])
        self.V_kernels = nn.ParameterList([_xavier(low_rank, in_features) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[B, N] -> [B, N]."""
        x0 = input
        x = x0
        for w, v, bias in zip(self.W_kernels, self.V_kernels, self.bias):
            projected = nn.functional.linear(nn.functional.linear(x, v), w)  # [B, r] then [B, N]
            x = x0 * (projected + bias) + x
        return x


class VectorCrossNet(nn.Module):
    """DCN-v1's vector cross layers: ``x_{l+1} = x_0 (x_l . w_l) + b_l + x_l``, w_l ``kernels.<l>`` [N, 1], b_l
    ``bias.<l>`` [N, 1]. [B, N] -> [B, N]."""

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        _check("VectorCrossNet", in_features=in_features)
        self._num_layers = num_layers
        self.kernels = nn.ParameterList([_xavier(in_features, 1) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features, 1) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[B, N] -> [B, N]."""
        x0 = input.unsqueeze(2)  # [B, N, 1]
        x = x0
        for kernel, bias in zip(self.kernels, self.bias):
            dot = torch.tensordot(x, kernel, dims=([1], [0]))  # [B, 1, 1]
            x = torch.matmul(x0, dot) + bias + x
        return x.squeeze(2)


class LowRankMixtureCrossNet(nn.Module):
    """DCN-v2's mixture of K low-rank experts per layer: expert_i = ``x_0 * (U_i g(C_i g(V_i x_l)) + b_l)``, mixed by
    a softmax over K linear gates of x_l (skipped when K is 1), added to x_l. Parameters per layer l:
    ``U_kernels.<l>`` [K, N, r], ``V_kernels.<l>`` [K, r, N], ``C_kernels.<l>`` [K, r, r], ``bias.<l>`` [N, 1];
    ``gates.<i>.weight`` [1, N] when K > 1. g is ``activation`` (default ``torch.relu``). [B, N] -> [B, N]."""

    def __init__(self, in_features: int, num_layers: int, num_experts: int = 1, low_rank: int = 1,
                 activation: Union[nn.Module, TensorFn] = torch.relu) -> None:
        super().__init__()
        _check("LowRankMixtureCrossNet", in_features=in_features, num_experts=num_experts, low_rank=low_rank)
        self._num_layers = num_layers
        self._num_experts = num_experts
        self._low_rank = low_rank
        self._in_features = in_features
        self.U_kernels = nn.ParameterList([_xavier(num_experts, in_features, low_rank) for _ in range(num_layers)])
        self.V_kernels = nn.ParameterList([_xavier(num_experts, low_rank, in_features) for _ in range(num_layers)])
        self.bias = nn.ParameterList([_zeros(in_features, 1) for _ in range(num_layers)])
        self.gates = (nn.ModuleList([nn.Linear(in_features, 1, bias=False) for _ in range(num_experts)])
                      if num_experts > 1 else None)
        self._activation = activation
        self.C_kernels = nn.ParameterList([_xavier(num_experts, low_rank, low_rank) for _ in range(num_layers)])

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """[B, N] -> [B, N]."""
        x0 = input.unsqueeze(2)  # [B, N, 1]
        x = x0
        g = self._activation
        for layer in range(self._num_layers):
            u, v, c, bias = self.U_kernels[layer], self.V_kernels[layer], self.C_kernels[layer], self.bias[layer]
            experts = []
            for i in range(self._num_experts):
                low = torch.matmul(c[i], g(torch.matmul(v[i], x)))  # [B, r, 1]
                experts.append((x0 * (torch.matmul(u[i], g(low)) + bias)).squeeze(2))  # [B, N]
            stacked = torch.stack(experts, 2)  # [B, N, K]
            if self.gates is None:
                x = stacked + x
            else:
                flat = x.squeeze(2)
                gating = torch.stack([gate(flat) for gate in self.gates], 1)  # [B, K, 1]
                x = torch.matmul(stacked, torch.softmax(gating, 1)) + x
        return x.squeeze(2)


def _flatten_cat(embeddings: List[torch.Tensor]) -> torch.Tensor:
    """Each [B, *] tensor flattened to [B, n_i], concatenated: [B, sum n_i]. A leaf of fx traces (its emptiness check
    reads the list), which TorchScript compiles."""
    if len(embeddings) == 0:
        raise ValueError("DeepFM / FactorizationMachine need at least one embedding tensor, got []")
    return torch.cat([e.flatten(1) for e in embeddings], dim=1)


torch.fx.wrap("_flatten_cat")


class DeepFM(nn.Module):
    """DeepFM's deep part (https://arxiv.org/pdf/1703.04247.pdf): ``dense_module`` applied to the embeddings flattened
    and concatenated. forward(list of [B, N_i, D_i]) -> dense_module([B, sum N_i * D_i]); ``dense_module``'s input
    width must be that sum (e.g. ``nn.Linear(2 * 64 + 2 * 32, out)`` for [B, 2, 64] and [B, 2, 32]). Its parameters
    are ``dense_module.*``, as TorchRec's."""

    def __init__(self, dense_module: nn.Module) -> None:
        super().__init__()
        self.dense_module = dense_module

    def forward(self, embeddings: List[torch.Tensor]) -> torch.Tensor:
        """embeddings: [B, N_i, D_i] each (any trailing shape; the batch sizes must agree) -> dense_module's output."""
        return self.dense_module(_flatten_cat(embeddings))


class FactorizationMachine(nn.Module):
    """DeepFM's second-order term over all the input's elements: with x the embeddings flattened and concatenated
    ([B, n]), ``0.5 * ((sum_i x_i)^2 - sum_i x_i^2)`` = sum over pairs i < j of x_i x_j. No parameters.
    forward(list of [B, N_i, D_i]) -> [B, 1]."""

    def forward(self, embeddings: List[torch.Tensor]) -> torch.Tensor:
        """embeddings: [B, N_i, D_i] each -> [B, 1]."""
        x = _flatten_cat(embeddings)
        total = torch.sum(x, dim=1, keepdim=True)
        squares = torch.sum(x * x, dim=1, keepdim=True)
        return torch.sum(total * total - squares, dim=1, keepdim=True) * 0.5


__all__ = ["CacheMixin", "CrossNet", "DeepFM", "EmbeddingBagCollection", "EmbeddingCollection", "EmbeddingTower",
           "EmbeddingTowerCollection", "FactorizationMachine", "JaggedTensor", "KeyedJaggedTensor", "LowRankCrossNet",
           "LowRankMixtureCrossNet", "MLP", "Multistreamable", "Perceptron", "SequenceVBEContext", "SwishLayerNorm",
           "VectorCrossNet", "check_module_output_dimension", "construct_jagged_tensors",
           "construct_jagged_tensors_inference", "construct_modulelist_from_single_module",
           "convert_list_of_modules_to_modulelist", "deterministic_dedup", "extract_module_or_tensor_callable",
           "get_module_output_dimension", "init_mlp_weights_xavier_uniform", "jagged_index_select_with_empty",
           "make_hash_zch_buckets_non_persistent", "reset_module_states_post_sharding", "tower_input_params"]
