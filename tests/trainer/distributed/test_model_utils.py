"""TorchRec's DMP helpers (get_module, get_unwrapped_module, get_unsharded_module_names, sharded_model_copy) on a
DistributedModelParallel model over one gloo rank."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recship.distributed import (DistributedModelParallel, get_module, get_unsharded_module_names, get_unwrapped_module,
                                 sharded_model_copy)
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig


class _Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
        self.norm = nn.LayerNorm(4)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = _Sparse()
        self.dense = nn.Linear(3, 4)
        self.over = nn.Sequential(nn.Linear(8, 1))

    def forward(self, x, kjt):
        pooled = self.sparse.norm(self.sparse.ebc(kjt).values())
        return self.over(torch.cat([self.dense(x), pooled], dim=1))


def _inputs():
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 9, 0]), lengths=torch.tensor([2, 0, 2]))
    return torch.randn(3, 3, generator=torch.Generator().manual_seed(0)), kjt


def test_unwrapping_and_unsharded_names(pg):
    torch.manual_seed(0)
    model = _Model()
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    assert get_module(dmp) is dmp._dmp_wrapped_module
    assert get_unwrapped_module(dmp) is model
    assert get_module(model) is model and get_unwrapped_module(model) is model
    # the sharded EBC's siblings at each level, never the sharded module or its ancestors
    assert sorted(get_unsharded_module_names(get_unwrapped_module(dmp))) == ["dense", "over", "sparse.norm"]
    assert get_unsharded_module_names(nn.Sequential(nn.Linear(2, 2))) == []
    ddp = DistributedDataParallel(nn.Linear(2, 2))
    assert get_module(ddp) is ddp and get_unwrapped_module(ddp) is ddp.module


def test_sharded_model_copy_copies_tensors_and_shares_groups(pg):
    torch.manual_seed(0)
    dmp = DistributedModelParallel(_Model(), device=torch.device("cpu"))
    x, kjt = _inputs()
    want = dmp(x, kjt)
    with sharded_model_copy("cpu"):
        twin = copy.deepcopy(dmp)
    torch.testing.assert_close(twin(x, kjt), want, rtol=0, atol=0)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    torch.testing.assert_close(dmp(x, kjt), want, rtol=0, atol=0)  # the copy's tensors are its own
    assert all(isinstance(p, nn.Parameter) for p in twin.parameters())
    with pytest.raises(Exception):
        copy.deepcopy(dist.GroupMember.WORLD)  # outside the context, process groups cannot be copied


def test_state_dict_prefix_helpers_and_copy_to_device():
    from recship.distributed import add_prefix_to_state_dict, copy_to_device, filter_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    sd = model.state_dict()
    assert list(filter_state_dict(sd, "1")) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert filter_state_dict(sd, "1")["weight"] is sd["1.weight"] and list(filter_state_dict(sd, "2")) == []
    add_prefix_to_state_dict(sd, "model.")
    assert sorted(sd) == sorted("model." + k for k in model.state_dict())
    assert sorted(sd._metadata) == ["", "0", "1"]  # an attribute, not a key: as TorchRec's, untouched
    plain = {"a.w": 1, "_metadata": {"": "root", "a": "sub"}}
    add_prefix_to_state_dict(plain, "m.")
    assert plain == {"m.a.w": 1, "m._metadata": {"": "root", "a": "sub"}}  # TorchRec 1.8.0's result, key included
    moved = copy_to_device(model, torch.device("cpu"), torch.device("meta"))
    assert all(p.device.type == "meta" for p in moved.parameters()) and all(p.device.type == "cpu" for p in model.parameters())
    shared = copy_to_device(model, torch.device("meta"), torch.device("cpu"))  # nothing on meta: tensors shared
    assert shared is not model and shared[0].weight.data_ptr() == model[0].weight.data_ptr()
