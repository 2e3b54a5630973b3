"""``torchrec.optim``'s wrappers as TorchRec users reach them (through ``recship.distributed``, where the import map
sends torchrec.optim), against plain torch optimizers and ``torch.nn.utils`` on the same parameters and gradients."""

import copy

import pytest
import torch
from torch import nn

from recship.distributed import (GradientClipping, GradientClippingOptimizer, KeyedOptimizerWrapper, OptimizerWrapper,
                                 apply_optimizer_in_backward)


def _model_and_grads(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(16, 5)
    (model(x) ** 2).mean().mul(50).backward()  # large enough for the clipping to bite
    return model


def test_keyed_wrapper_steps_as_its_torch_optimizer():
    ours, plain = _model_and_grads(0), _model_and_grads(0)
    keyed = KeyedOptimizerWrapper(dict(ours.named_parameters()), lambda params: torch.optim.Adam(params, lr=0.01))
    reference = torch.optim.Adam(plain.parameters(), lr=0.01)
    assert sorted(keyed.params) == sorted(n for n, _ in plain.named_parameters())
    keyed.step()
    reference.step()
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    keyed.zero_grad()
    assert all(p.grad is None for p in ours.parameters())
    assert OptimizerWrapper(keyed).param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("clipping", [GradientClipping.NORM, GradientClipping.VALUE, GradientClipping.NONE])
def test_gradient_clipping_clips_then_steps(clipping):
    ours, plain = _model_and_grads(1), _model_and_grads(1)
    clipped = GradientClippingOptimizer(KeyedOptimizerWrapper(dict(ours.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1)),
                                        clipping=clipping, max_gradient=0.5)
    if clipping == GradientClipping.NORM:
        assert float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)) > 0.5  # the premise: the norm was over
    elif clipping == GradientClipping.VALUE:
        torch.nn.utils.clip_grad_value_(plain.parameters(), 0.5)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    clipped.step()
    reference.step()
    for a, b in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_apply_optimizer_in_backward_is_torchs():
    model = nn.Linear(3, 2)
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.5})
    assert all(getattr(p, "_optimizer_classes", None) == [torch.optim.SGD] for p in model.parameters())
    assert copy.deepcopy(model.weight._optimizer_kwargs) == [{"lr": 0.5}]
