"""TorchRec's table optimizers (recship.trainer.optimizers): each fbgemm rule stepped densely against an independent
numpy float64 reference of fbgemm's kernel math, RowWiseAdagrad against TorchRec's formula, and the fused path: a
sharded EBC trained with a CPU-fused rule equals the plain-torch update, one without a CPU kernel is refused."""

import math

import numpy as np
import pytest
import torch
from torch.distributed.optim import _apply_optimizer_in_backward

from recship.distributed import (LAMB, SGD, Adagrad, Adam, DistributedModelParallel, LarsSGD, PartialRowWiseAdam,
                                 PartialRowWiseLAMB, RowWiseAdagrad, ShardingPlan, construct_module_sharding_plan, table_wise)
from recship.sparse import KeyedJaggedTensor
from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig
from recship.trainer.fused_optim import fused_config_from_torch
from recship.trainer.optimizers import adagrad

ROWS, DIM, STEPS = 9, 6, 4


def _grads(seed=1):
    """STEPS gradients [ROWS, DIM]; rows 2 and 5 are not looked up in step 1, row 7 never."""
    g = np.random.default_rng(seed).standard_normal((STEPS, ROWS, DIM)).astype(np.float32)
    g[1, [2, 5]] = 0
    g[:, 7] = 0
    return g


def _reference(rule, w0, grads, lr, eps=1e-8, b1=0.9, b2=0.999, wd=0.0, eta=0.001, momentum=0.9):
    """fbgemm's kernels (codegen/genscript/optimizers.py) per row, in float64; only looked-up rows change."""
    w = w0.astype(np.float64).copy()
    m1 = np.zeros_like(w)
    m2 = np.zeros(w.shape[0]) if rule in ("PartialRowWiseAdam", "PartialRowWiseLAMB") else np.zeros_like(w)
    for t, g in enumerate(grads.astype(np.float64), start=1):
        for r in range(w.shape[0]):
            if not g[r].any():
                continue
            if rule == "SGD":
                w[r] -= lr * g[r]
            elif rule == "Adagrad":
                m1[r] += g[r] ** 2
                w[r] -= lr * g[r] / (np.sqrt(m1[r]) + eps)
            elif rule == "LarsSGD":
                wn, gn = np.linalg.norm(w[r]), np.linalg.norm(g[r])
                rate = lr * eta * wn / (gn + wd * wn)
                m1[r] = momentum * m1[r] + rate * (g[r] + wd * w[r])
                w[r] -= m1[r]
            else:
                m1[r] = b1 * m1[r] + (1 - b1) * g[r]
                if rule.startswith("PartialRowWise"):
                    m2[r] = b2 * m2[r] + (1 - b2) * np.mean(g[r] ** 2)
                else:
                    m2[r] = b2 * m2[r] + (1 - b2) * g[r] ** 2
                step = m1[r] / (1 - b1**t) / (np.sqrt(m2[r] / (1 - b2**t)) + eps) + wd * w[r]
                if rule.endswith("LAMB"):
                    step = step * np.linalg.norm(w[r]) / np.linalg.norm(step)
                w[r] -= lr * step
    return w


CASES = [
    (SGD, {"lr": 0.3}),
    (Adagrad, {"lr": 0.2}),
    (Adagrad, {"learning_rate": 0.1, "eps": 1e-3}),
    (Adam, {"lr": 0.05}),
    (Adam, {"lr": 0.05, "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.01, "eps": 1e-6}),
    (PartialRowWiseAdam, {"lr": 0.05, "weight_decay": 0.02}),
    (LAMB, {"lr": 0.05, "weight_decay": 0.01}),
    (PartialRowWiseLAMB, {"lr": 0.05, "beta2": 0.9}),
    (LarsSGD, {"lr": 0.5, "eta": 0.01, "momentum": 0.5, "weight_decay": 0.1}),
]


@pytest.mark.parametrize("cls, kwargs", CASES, ids=lambda c: c.__name__ if isinstance(c, type) else "")
@pytest.mark.parametrize("sparse", [False, True], ids=["dense_grad", "sparse_grad"])
def test_rule_matches_fbgemm_math(cls, kwargs, sparse):
    w0 = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    grads = _grads()
    w = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = cls([w], **kwargs)
    for g in grads:
        grad = torch.from_numpy(g.copy())
        if sparse:  # an nn.EmbeddingBag(sparse=True)'s gradient: the looked-up rows, one duplicated
            rows = torch.tensor([r for r in range(ROWS) if g[r].any()] + [0])
            values = grad[rows].clone()
            values[-1], values[0] = values[0] / 4, values[0] * 3 / 4
            grad = torch.sparse_coo_tensor(rows.unsqueeze(0), values, (ROWS, DIM))
        w.grad = grad
        opt.step()
    hyper = {"lr": "lr", "learning_rate": "lr", "eps": "eps", "beta1": "b1", "beta2": "b2", "weight_decay": "wd",
             "eta": "eta", "momentum": "momentum"}
    want = _reference(cls.__name__, w0, grads, **{hyper[k]: v for k, v in kwargs.items()})
    np.testing.assert_allclose(w.detach().numpy(), want, rtol=2e-6, atol=2e-6)
    assert np.array_equal(w.detach().numpy()[7], w0[7])  # never looked up: untouched, state included
    assert int(opt.state[w]["step"]) == STEPS


def test_rule_keywords_are_fbgemms_and_checked():
    w = torch.nn.Parameter(torch.zeros(3, 4))
    assert Adam([w]).param_groups[0] | {"params": None} == {"params": None, "lr": 0.01, "eps": 1e-8, "beta1": 0.9,
                                                            "beta2": 0.999, "weight_decay": 0.0}
    assert LarsSGD([w]).param_groups[0]["eta"] == 0.001 and LarsSGD([w]).param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match=r"SGD \(fbgemm's EXACT_SGD\) takes \['lr'\]; it does not read \['momentum'\]"):
        SGD([w], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"does not read \['betas'\]"):
        Adam([w], betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="lr or learning_rate, not both"):
        SGD([w], lr=0.1, learning_rate=0.2)
    with pytest.raises(ValueError, match="beta1=1.0 is out of range"):
        LAMB([w], beta1=1.0)
    with pytest.raises(ValueError, match="eps=0.0 is out of range"):
        Adagrad([w], eps=0)


def _torchrec_rowwise_adagrad(w, grads, lr, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                              maximize=False):
    """TorchRec's documented RowWiseAdagrad, in float64: every row, one accumulator per row, decayed rate."""
    w = w.astype(np.float64).copy()
    acc = np.full((w.shape[0], 1), initial_accumulator_value, dtype=np.float64)
    for step, g in enumerate(grads.astype(np.float64), start=1):
        g = -g if maximize else g
        g = g + weight_decay * w
        acc += np.mean(g**2, axis=1, keepdims=True)
        w -= lr / (1 + (step - 1) * lr_decay) * g / (np.sqrt(acc) + eps)
    return w, acc


@pytest.mark.parametrize("kwargs", [
    {"lr": 0.1},
    {"lr": 0.2, "lr_decay": 0.3, "weight_decay": 0.05, "initial_accumulator_value": 0.5, "eps": 1e-6},
    {"lr": 0.1, "maximize": True, "eps": 1e-3},
])
def test_row_wise_adagrad_is_torchrecs(kwargs):
    w0 = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    grads = _grads(2)
    w = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = RowWiseAdagrad([w], **kwargs)
    assert opt.state[w]["sum"].shape == (ROWS, 1) and opt.state[w]["step"].dtype == torch.float32
    for g in grads:
        w.grad = torch.from_numpy(g.copy())
        opt.step()
    want_w, want_acc = _torchrec_rowwise_adagrad(w0, grads, **kwargs)
    np.testing.assert_allclose(w.detach().numpy(), want_w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(opt.state[w]["sum"].numpy(), want_acc, rtol=1e-6)
    assert float(opt.state[w]["step"]) == STEPS

    # the functional form is the same step
    w2, s, t = torch.from_numpy(w0.copy()), torch.full((ROWS, 1), kwargs.get("initial_accumulator_value", 0.0)), torch.tensor(0.0)
    for g in grads:
        adagrad([w2], [torch.from_numpy(g.copy())], [s], [t], lr=kwargs["lr"], weight_decay=kwargs.get("weight_decay", 0.0),
                lr_decay=kwargs.get("lr_decay", 0.0), eps=kwargs.get("eps", 1e-10), maximize=kwargs.get("maximize", False))
    assert torch.equal(w2, w.detach()) and torch.equal(s, opt.state[w]["sum"])


def test_row_wise_adagrad_refuses_what_it_would_ignore():
    w = torch.nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"does not read \['max_gradient'\]"):
        RowWiseAdagrad([w], lr=0.1, max_gradient=1.0)
    with pytest.raises(ValueError, match="lr_decay must be >= 0"):
        RowWiseAdagrad([w], lr_decay=-1.0)
    with pytest.raises(ValueError, match=r"RowWiseAdagrad\(lr_decay=0.1\) cannot be fused"):
        fused_config_from_torch(RowWiseAdagrad, {"lr": 0.1, "lr_decay": 0.1})


# -- the fused path: apply_optimizer_in_backward before sharding --------------------------------------------------

TABLES = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=30, feature_names=["f0"]),
          EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=20, feature_names=["f1"])]


def _batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(3):
        lengths = torch.randint(0, 4, (8,), generator=g)
        rows = torch.tensor([30] * 4 + [20] * 4).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=g) * rows).long()
        out.append((KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths), torch.randn(4, 12, generator=g)))
    return out


def _ebc():
    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=TABLES, device="cpu")


def _plain_torch(rule, kwargs, batches):
    """The tables as plain tensors, the rule written out in torch (no recship optimizer)."""
    ebc = _ebc()
    weights = {t: ebc.embedding_bags[t].weight.detach().clone() for t in ("t0", "t1")}
    acc = {t: torch.zeros_like(w) for t, w in weights.items()}
    row_acc = {t: torch.zeros(w.shape[0], 1) for t, w in weights.items()}
    lr, eps = kwargs["lr"], kwargs.get("eps", 1e-10 if rule == "RowWiseAdagrad" else 1e-8)
    for kjt, lw in batches:
        grads = {}
        for (t, f), lo, hi in (("t0", "f0"), 0, 8), (("t1", "f1"), 8, 12):
            w = weights[t].clone().requires_grad_()
            jt = kjt[f]
            pooled = torch.nn.functional.embedding_bag(jt.values(), w, jt.offsets()[:-1], mode="sum")
            (pooled * lw[:, lo:hi]).sum().backward()
            grads[t] = w.grad
        for t, g in grads.items():
            if rule == "SGD":
                weights[t] -= lr * g
            elif rule == "Adagrad":
                acc[t] += g * g
                weights[t] -= lr * g / (acc[t].sqrt() + eps)
            else:
                row_acc[t] += (g * g).mean(dim=1, keepdim=True)
                weights[t] -= lr * g / (row_acc[t].sqrt() + eps)
    return weights


@pytest.mark.parametrize("cls, kwargs", [(SGD, {"lr": 0.3}), (Adagrad, {"lr": 0.2}), (Adagrad, {"lr": 0.2, "eps": 1e-3}),
                                         (RowWiseAdagrad, {"lr": 0.2})], ids=lambda c: c.__name__ if isinstance(c, type) else "")
def test_fused_rule_trains_a_sharded_ebc_as_plain_torch(pg, cls, kwargs):
    batches = _batches()
    ebc = _ebc()
    _apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0), "t1": table_wise(rank=0)},
                                                            world_size=1, device_type="cpu")})
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan)
    for kjt, lw in batches:
        (model(kjt).wait().values() * lw).sum().backward()
    want = _plain_torch(cls.__name__, kwargs, batches)
    for t, w in want.items():
        got = model.module.gather_table(t)
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)
        assert not torch.equal(got, _ebc().embedding_bags[t].weight.detach())


@pytest.mark.parametrize("cls", [Adam, PartialRowWiseAdam, LAMB])
def test_rule_without_a_cpu_kernel_is_refused_on_cpu(pg, cls):
    ebc = _ebc()
    _apply_optimizer_in_backward(cls, ebc.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match=f"fused optimizer {cls.optim_type.name} runs on CUDA only"):
        DistributedModelParallel(ebc, device=torch.device("cpu"))


@pytest.mark.parametrize("cls", [PartialRowWiseLAMB, LarsSGD])
def test_rule_recship_cannot_fuse_is_refused_everywhere(cls):
    with pytest.raises(ValueError, match=f"{cls.__name__} \\(fbgemm's {cls.fbgemm_name}\\) cannot be fused by recship"):
        fused_config_from_torch(cls, {"lr": 0.1})


def test_in_backward_rule_steps_an_unsharded_table():
    """TorchRec's placeholders raise in backward; recship's step: an unsharded table trains in backward."""
    ebc = _ebc()
    w0 = ebc.embedding_bags["t0"].weight.detach().clone()
    _apply_optimizer_in_backward(Adagrad, ebc.parameters(), {"lr": 0.2})
    kjt, lw = _batches()[0]
    (ebc(kjt).values() * lw).sum().backward()
    assert ebc.embedding_bags["t0"].weight.grad is None
    jt = kjt["f0"]
    w = w0.clone().requires_grad_()
    (torch.nn.functional.embedding_bag(jt.values(), w, jt.offsets()[:-1], mode="sum") * lw[:, :8]).sum().backward()
    g = w.grad
    torch.testing.assert_close(ebc.embedding_bags["t0"].weight.detach(), w0 - 0.2 * g / (g.abs() + 1e-8))
    assert math.isfinite(float(ebc.embedding_bags["t0"].weight.detach().sum()))
