"""TorchRec's embedding towers (``torchrec.modules.embedding_tower``; re-exported by ``recship.models.layers``, where
the import map sends that path): an embedding module and the interaction applied to its output, as one module, and a
collection of towers whose outputs are concatenated.

    tower = EmbeddingTower(EmbeddingBagCollection(tables), interaction)      # interaction(KeyedTensor) -> [B, N]
    towers = EmbeddingTowerCollection([tower, other_tower])
    towers(features, weighted_features)                                      # -> [B, N + N']

Each tower's parameters are ``towers.<i>.embedding.*`` and ``towers.<i>.interaction.*``, as TorchRec's, so a sharder
can place a tower's tables and its interaction together.
"""

from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingCollection


def tower_input_params(module: nn.Module) -> Tuple[bool, bool]:
    """(takes the unweighted KJT, takes the weighted KJT) for an embedding module: an EmbeddingCollection takes the
    unweighted one, an EmbeddingBagCollection the one matching ``is_weighted()``, any other module both."""
    if isinstance(module, EmbeddingCollection):
        return True, False
    if isinstance(module, EmbeddingBagCollection):
        return not module.is_weighted(), module.is_weighted()
    return True, True


class EmbeddingTower(nn.Module):
    """``interaction_module(embedding_module(*args, **kwargs))``; submodules ``embedding`` and ``interaction``.

    Args:
        embedding_module: the lookups (an EmbeddingBagCollection, an EmbeddingCollection, or a module of both).
        interaction_module: maps the lookups' output to [B, N].
        device: unused (TorchRec's signature; the modules are built on their own devices).
    """

    def __init__(self, embedding_module: nn.Module, interaction_module: nn.Module,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.embedding = embedding_module
        self.interaction = interaction_module

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The embedding module's arguments (a KJT, or a KJT and a weighted KJT) -> the interaction's [B, N]."""
        return self.interaction(self.embedding(*args, **kwargs))


class EmbeddingTowerCollection(nn.Module):
    """Several EmbeddingTowers (``towers``, an nn.ModuleList), each given the KJT(s) its embedding module takes
    (``tower_input_params``); their [B, N_i] outputs concatenated: [B, sum N_i].

    Args:
        towers: the towers, in output order.
        device: unused (TorchRec's signature).
    """

    def __init__(self, towers: List[EmbeddingTower], device: Optional[torch.device] = None) -> None:
        super().__init__()
        for i, tower in enumerate(towers):
            if not isinstance(tower, EmbeddingTower):
                raise TypeError(f"EmbeddingTowerCollection: tower {i} is a {type(tower).__name__}, not an EmbeddingTower")
        self.towers = nn.ModuleList(towers)
        self._input_params: List[Tuple[bool, bool]] = [tower_input_params(tower.embedding) for tower in towers]

    def forward(self, features: Optional[KeyedJaggedTensor] = None,
                weighted_features: Optional[KeyedJaggedTensor] = None) -> torch.Tensor:
        """features / weighted_features: the KJTs of B examples the towers take -> [B, sum of the towers' N_i]."""
        outputs = []
        for i, (tower, (takes_kjt, takes_weighted)) in enumerate(zip(self.towers, self._input_params)):
            if takes_kjt and features is None:
                raise ValueError(f"EmbeddingTowerCollection: tower {i} needs features, got None")
            if takes_weighted and weighted_features is None:
                raise ValueError(f"EmbeddingTowerCollection: tower {i} needs weighted_features, got None")
            if takes_kjt and takes_weighted:
                outputs.append(tower(features, weighted_features))
            elif takes_weighted:
                outputs.append(tower(weighted_features))
            else:
                outputs.append(tower(features))
        return torch.cat(outputs, dim=1)


__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "EmbeddingTower", "EmbeddingTowerCollection",
           "KeyedJaggedTensor", "tower_input_params"]
