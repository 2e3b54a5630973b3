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


def test_keyed_wrapper_can_pass_the_named_parameters():
    """pass_params_dict=True hands the factory the name -> parameter dict (here: no weight decay on biases)."""
    ours, plain = _model_and_grads(2), _model_and_grads(2)

    def by_name(named):
        return torch.optim.AdamW([{"params": [p for n, p in named.items() if n.endswith("weight")], "weight_decay": 0.5},
                                  {"params": [p for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0}], lr=0.05)

    keyed = KeyedOptimizerWrapper(dict(ours.named_parameters()), by_name, pass_params_dict=True)
    reference = by_name(dict(plain.named_parameters()))
    keyed.step()
    reference.step()
    for a, b in zip(ours.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert [g["weight_decay"] for g in keyed.param_groups] == [0.5, 0.0]


@pytest.mark.parametrize("norm_type, clipping", [(2.0, GradientClipping.NORM), (1.0, GradientClipping.NORM), ("inf", GradientClipping.NORM),
                                                 (3.0, GradientClipping.NONE)])
def test_clipping_norms_and_tracked_norm(norm_type, clipping):
    ours, plain = _model_and_grads(3), _model_and_grads(3)
    clipped = GradientClippingOptimizer(KeyedOptimizerWrapper(dict(ours.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1)),
                                        clipping=clipping, max_gradient=0.4, norm_type=norm_type, track_grad_norm=True)
    grads = [p.grad.double() for p in plain.parameters()]
    p = float(norm_type)
    total = max(g.abs().max() for g in grads) if p == float("inf") else sum((g.abs() ** p).sum() for g in grads) ** (1 / p)
    coef = min(1.0, 0.4 / (float(total) + 1e-6)) if clipping == GradientClipping.NORM else 1.0
    assert coef < 1.0 or clipping == GradientClipping.NONE
    clipped.step()
    torch.testing.assert_close(clipped.last_total_grad_norm.double(), total, rtol=1e-6, atol=0)
    with torch.no_grad():
        for a, b, g in zip(ours.parameters(), plain.parameters(), grads):
            torch.testing.assert_close(a, (b.double() - 0.1 * coef * g).float(), rtol=1e-6, atol=1e-7)


def _global_clip_rank(rank, world_size, norm_type):
    """Each rank holds rows [3r, 3r+3) of a [6, 4] weight and a replicated bias [4]."""
    import torch.distributed as dist

    full_w, full_gw, bias, gb = _global_problem()
    w = nn.Parameter(full_w[3 * rank:3 * rank + 3].clone())
    b = nn.Parameter(bias.clone())
    w.grad, b.grad = full_gw[3 * rank:3 * rank + 3].clone(), gb.clone()
    opt = GradientClippingOptimizer(KeyedOptimizerWrapper({"w": w, "b": b}, lambda p: torch.optim.SGD(p, lr=1.0)),
                                    clipping=GradientClipping.NORM, max_gradient=0.5, norm_type=norm_type,
                                    enable_global_grad_clip=True, param_to_pgs={w: [dist.group.WORLD]})
    opt.step()
    return w.detach(), b.detach(), opt.last_total_grad_norm


def _global_problem():
    g = torch.Generator().manual_seed(7)
    return torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), torch.randn(4, generator=g), torch.randn(4, generator=g)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_global_clipping_over_two_ranks_is_one_process_clipping(norm_type):
    from gloo_ranks import run_ranks

    results = run_ranks(_global_clip_rank, 2, norm_type)
    full_w, full_gw, bias, gb = _global_problem()
    whole_w, whole_b = nn.Parameter(full_w.clone()), nn.Parameter(bias.clone())
    whole_w.grad, whole_b.grad = full_gw.clone(), gb.clone()
    total = torch.nn.utils.clip_grad_norm_([whole_w, whole_b], 0.5, norm_type=norm_type)
    with torch.no_grad():
        whole_w -= whole_w.grad
        whole_b -= whole_b.grad
    for rank, (w, b, norm) in enumerate(results):
        torch.testing.assert_close(norm, total)
        torch.testing.assert_close(w, whole_w.detach()[3 * rank:3 * rank + 3])
        torch.testing.assert_close(b, whole_b.detach())


def test_value_clipping_refuses_sharded_parameters():
    w = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="VALUE clips each value where it is"):
        GradientClippingOptimizer(KeyedOptimizerWrapper({"w": w}, lambda p: torch.optim.SGD(p, lr=1.0)), clipping=GradientClipping.VALUE,
                                  enable_global_grad_clip=True, param_to_pgs={w: [object()]})


def test_fused_optimizer_family():
    from recship.distributed import CombinedOptimizer, EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule

    empty = EmptyFusedOptimizer()
    empty.step()
    empty.zero_grad()
    assert empty.state_dict() == {"state": {}} and empty.params == {} and isinstance(empty, FusedOptimizer)
    with pytest.raises(TypeError):
        FusedOptimizer({}, {}, [])  # abstract: step and zero_grad are the subclass's

    class Fused(nn.Module):
        @property
        def fused_optimizer(self):
            return empty

    assert isinstance(Fused(), FusedOptimizerModule) and not isinstance(nn.Linear(2, 2), FusedOptimizerModule)

    class WithSettings(torch.optim.SGD):
        seen: list = []

        def update_hyper_parameters(self, params_dict):
            self.seen.append(params_dict)

    model = _model_and_grads(4)
    combined = CombinedOptimizer([("dense", KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: WithSettings(p, lr=0.1))),
                                  ("fused", empty)])
    combined.update_hyper_parameters({"lr": 0.2})
    assert WithSettings.seen == [{"lr": 0.2}]
    assert CombinedOptimizer.prepend_opt_key("w", "dense") == "dense.w" and CombinedOptimizer.prepend_opt_key("", "k") == "k"


def test_init_state_creates_the_state_without_moving_anything():
    model = _model_and_grads(5)
    before = [p.detach().clone() for p in model.parameters()]
    keyed = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.Adam(p, lr=0.1))
    keyed.init_state()
    state = keyed.state_dict()["state"]
    assert sorted(state) == sorted(n for n, _ in model.named_parameters())
    assert all(torch.count_nonzero(s["exp_avg"]) == 0 for s in state.values())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


class _OuterSGD(torch.optim.Optimizer):
    """A DiLoCo-like global optimizer: keeps an anchor copy; its global step moves the anchor toward the locally
    trained weights by lr and resets the weights to it."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["anchor"] = p.detach().clone()

    def step(self, closure=None):
        pass

    @torch.no_grad()
    def global_step(self, local_step_counter, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                anchor = self.state[p]["anchor"]
                anchor.sub_(group["lr"] * (anchor - p))
                p.copy_(anchor)


def _semisync(model):
    from recship.distributed import SemisyncOptimizer

    local = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    outer = KeyedOptimizerWrapper(dict(model.named_parameters()), lambda p: _OuterSGD(p, lr=0.7))
    return SemisyncOptimizer(model.parameters(), local, outer, num_local_steps=3)


def _semisync_steps(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        (model(torch.randn(5, 4, generator=g)) ** 2).sum().backward()
        opt.step()


def test_semisync_steps_locally_then_globally_and_round_trips():
    from recship.distributed import SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY

    torch.manual_seed(0)
    model, reference = nn.Linear(4, 2), None
    reference = copy.deepcopy(model)
    opt = _semisync(model)
    _semisync_steps(model, opt, 7, seed=1)

    # by hand: SGD with momentum every step, every third step the anchor moves 0.7 of the way and the weights reset
    anchor = [p.detach().clone() for p in reference.parameters()]
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 8):
        sgd.zero_grad()
        (reference(torch.randn(5, 4, generator=g)) ** 2).sum().backward()
        sgd.step()
        if step % 3 == 0:
            with torch.no_grad():
                for a, p in zip(anchor, reference.parameters()):
                    a -= 0.7 * (a - p)
                    p.copy_(a)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    saved = copy.deepcopy(opt.state_dict())
    assert sorted(saved["state"]["weight"]) == [SEMISYNC_GLOBAL_STEP_COUNTER_KEY, SEMISYNC_LOCAL_STEP_COUNTER_KEY,
                                                "semi_sync_global_anchor", "semi_sync_local_momentum_buffer"]
    assert int(saved["state"]["weight"][SEMISYNC_LOCAL_STEP_COUNTER_KEY]) == 7
    assert int(saved["state"]["weight"][SEMISYNC_GLOBAL_STEP_COUNTER_KEY]) == 2
    # resuming from the checkpoint equals going on uninterrupted
    resumed_model = copy.deepcopy(model)
    resumed = _semisync(resumed_model)
    _semisync_steps(resumed_model, resumed, 1, seed=9)  # create the local state (momentum buffers) before loading
    with torch.no_grad():
        for a, b in zip(resumed_model.parameters(), model.parameters()):
            a.copy_(b)
    resumed.load_state_dict(saved)
    _semisync_steps(model, opt, 4, seed=2)
    _semisync_steps(resumed_model, resumed, 4, seed=2)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_local_steps must be an int >= 1"):
        type(opt)(model.parameters(), opt._optimizer, opt._global_optimizer, num_local_steps=0)
