"""``torchrec.models.dlrm`` and ``torchrec.modules.mlp`` / ``crossnet`` as TorchRec users write them, through the
docs/torchrec.md's import map (tests/snippets/torchrec_models.txt, rewritten by tests/tutorials/notebook.py): every output
against a plain-PyTorch computation from the module's state_dict, the state_dict against TorchRec's documented keys
and shapes, and the built-in DLRM (recship.models.dlrm.BuiltinDLRM), a DLRM of TorchRec's parameter names."""

import re
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

from tutorials.notebook import import_map, rewrite_imports

USER_CODE = (Path(__file__).parent / "snippets" / "torchrec_models.txt").read_text()
TOL = dict(rtol=1e-5, atol=1e-6)  # the references sum in another order than the modules' matmuls


@pytest.fixture(scope="module")
def user():
    code = rewrite_imports(USER_CODE, import_map())
    assert not re.search(r"^\s*(from|import)\s+torchrec\b", code, re.M), code
    scope: dict = {}
    exec(compile(code, "user_code", "exec"), scope)
    return scope


def _sd(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


def _shapes(module: torch.nn.Module) -> Dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def _mlp(x: torch.Tensor, sd: Dict[str, torch.Tensor], prefix: str, n: int, last_relu: bool = True) -> torch.Tensor:
    for i in range(n):
        x = x @ sd[f"{prefix}{i}._linear.weight"].T + sd[f"{prefix}{i}._linear.bias"]
        if i < n - 1 or last_relu:
            x = torch.clamp(x, min=0)
    return x


def _pooled(kjt_rows: Dict[str, List[List[int]]], table: torch.Tensor, feature: str) -> torch.Tensor:
    """Sum pooling by hand: one row per example, zeros for an empty bag."""
    return torch.stack([table[ids].sum(0) if ids else torch.zeros(table.shape[1]) for ids in kjt_rows[feature]])


# the user code's KJT, example by example
ROWS = {"f1": [[1, 2], [4, 5]], "f3": [[4, 3], [2, 9]], "f2": [[], [7]]}
TABLE_OF = {"f1": "t1", "f3": "t1", "f2": "t2"}
EBC = "sparse_arch.embedding_bag_collection.embedding_bags"


def _sparse(sd: Dict[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """[B, 3, D] in SparseArch's order: the tables' features in order (t1: f1, f3; t2: f2)."""
    return torch.stack([_pooled(ROWS, sd[f"{prefix}{EBC}.{TABLE_OF[f]}.weight"], f) for f in ["f1", "f3", "f2"]], dim=1)


def _dots(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """Every pair i < j of [dense, sparse...], row by row of the upper triangle, after the dense vector."""
    vectors = [dense] + [sparse[:, k] for k in range(sparse.shape[1])]
    pairs = [(vectors[i] * vectors[j]).sum(1) for i in range(len(vectors)) for j in range(i + 1, len(vectors))]
    return torch.cat([dense, torch.stack(pairs, dim=1)], dim=1)


def _low_rank_cross(x: torch.Tensor, sd: Dict[str, torch.Tensor], prefix: str, layers: int) -> torch.Tensor:
    x0 = x
    for l in range(layers):
        x = x0 * ((x @ sd[f"{prefix}V_kernels.{l}"].T) @ sd[f"{prefix}W_kernels.{l}"].T + sd[f"{prefix}bias.{l}"]) + x
    return x


def test_mlp_and_perceptron(user):
    x = user["input"]
    p = _sd(user["perceptron"])
    assert _shapes(user["perceptron"]) == {"_linear.weight": (16, 40), "_linear.bias": (16,)}
    torch.testing.assert_close(user["perceptron_out"], torch.clamp(x @ p["_linear.weight"].T + p["_linear.bias"], min=0), **TOL)
    assert _shapes(user["mlp_module"]) == {"_mlp.0._linear.weight": (16, 40), "_mlp.0._linear.bias": (16,),
                                           "_mlp.1._linear.weight": (8, 16), "_mlp.1._linear.bias": (8,),
                                           "_mlp.2._linear.weight": (4, 8), "_mlp.2._linear.bias": (4,)}
    assert user["mlp_out"].shape == (3, 4) and user["mlp_out"].dtype == torch.float32
    torch.testing.assert_close(user["mlp_out"], _mlp(x, _sd(user["mlp_module"]), "_mlp.", 3), **TOL)
    # swish_layernorm: x * sigmoid(layer_norm(x)), each layer's own LayerNorm
    s = _sd(user["swish_mlp"])
    assert _shapes(user["swish_mlp"])["_mlp.1._activation_fn.norm.0.weight"] == (8,)
    h = x
    for i in range(2):
        h = h @ s[f"_mlp.{i}._linear.weight"].T + s[f"_mlp.{i}._linear.bias"]
        mean, var = h.mean(-1, keepdim=True), h.var(-1, unbiased=False, keepdim=True)
        normed = (h - mean) / torch.sqrt(var + 1e-5) * s[f"_mlp.{i}._activation_fn.norm.0.weight"] + s[f"_mlp.{i}._activation_fn.norm.0.bias"]
        h = h * torch.sigmoid(normed)
    torch.testing.assert_close(user["swish_out"], h, **TOL)


def test_crossnets(user):
    x0 = user["cross_input"]
    nets, out = user["crossnets"], user["cross_out"]
    assert _shapes(nets["CrossNet"]) == {"kernels.0": (10, 10), "kernels.1": (10, 10), "bias.0": (10, 1), "bias.1": (10, 1)}
    assert _shapes(nets["LowRankCrossNet"]) == {"W_kernels.0": (10, 3), "W_kernels.1": (10, 3), "V_kernels.0": (3, 10),
                                                "V_kernels.1": (3, 10), "bias.0": (10,), "bias.1": (10,)}
    assert _shapes(nets["VectorCrossNet"]) == {"kernels.0": (10, 1), "kernels.1": (10, 1), "bias.0": (10, 1), "bias.1": (10, 1)}
    mix = _shapes(nets["LowRankMixtureCrossNet"])
    assert mix == {**{f"U_kernels.{l}": (5, 10, 3) for l in range(2)}, **{f"V_kernels.{l}": (5, 3, 10) for l in range(2)},
                   **{f"bias.{l}": (10, 1) for l in range(2)}, **{f"gates.{i}.weight": (1, 10) for i in range(5)},
                   **{f"C_kernels.{l}": (5, 3, 3) for l in range(2)}}
    assert all(o.shape == (3, 10) for o in out.values())

    sd = _sd(nets["CrossNet"])
    x = x0
    for l in range(2):  # x_{l+1} = x_0 * (W x_l + b) + x_l
        x = x0 * (x @ sd[f"kernels.{l}"].T + sd[f"bias.{l}"].T) + x
    torch.testing.assert_close(out["CrossNet"], x, **TOL)

    torch.testing.assert_close(out["LowRankCrossNet"], _low_rank_cross(x0, _sd(nets["LowRankCrossNet"]), "", 2), **TOL)

    sd = _sd(nets["VectorCrossNet"])
    x = x0
    for l in range(2):  # x_{l+1} = x_0 (x_l . w) + b + x_l
        x = x0 * (x @ sd[f"kernels.{l}"]) + sd[f"bias.{l}"].T + x
    torch.testing.assert_close(out["VectorCrossNet"], x, **TOL)

    sd = _sd(nets["LowRankMixtureCrossNet"])
    x = x0
    for l in range(2):
        experts = [x0 * (torch.relu(torch.relu(x @ sd[f"V_kernels.{l}"][i].T) @ sd[f"C_kernels.{l}"][i].T)
                         @ sd[f"U_kernels.{l}"][i].T + sd[f"bias.{l}"].T) for i in range(5)]
        weights = torch.softmax(torch.cat([x @ sd[f"gates.{i}.weight"].T for i in range(5)], dim=1), dim=1)  # [B, K]
        x = sum(e * weights[:, i : i + 1] for i, e in enumerate(experts)) + x
    torch.testing.assert_close(out["LowRankMixtureCrossNet"], x, **TOL)


# TorchRec's DLRM docstring model: D 8, tables t1 (f1, f3) and t2 (f2) of 100 rows, dense 100 -> 20 -> 8, over 5 -> 1
DLRM_KEYS = {
    f"{EBC}.t1.weight": (100, 8), f"{EBC}.t2.weight": (100, 8),
    "dense_arch.model._mlp.0._linear.weight": (20, 100), "dense_arch.model._mlp.0._linear.bias": (20,),
    "dense_arch.model._mlp.1._linear.weight": (8, 20), "dense_arch.model._mlp.1._linear.bias": (8,),
    "over_arch.model.0._mlp.0._linear.weight": (5, 8 + 3 + 3), "over_arch.model.0._mlp.0._linear.bias": (5,),
    "over_arch.model.1.weight": (1, 5), "over_arch.model.1.bias": (1,),
}


def test_dlrm_state_dict_and_forward(user):
    model = user["model"]
    assert list(model.state_dict()) == list(DLRM_KEYS) and _shapes(model) == DLRM_KEYS
    sd = {k: v for k, v in user["before"].items()}  # the weights the forward ran with (DLRMTrain then stepped)
    sd = {k[len("model."):]: v for k, v in sd.items()}
    dense = _mlp(user["features"], sd, "dense_arch.model._mlp.", 2)
    sparse = _sparse(sd)
    over_in = _dots(dense, sparse)
    assert user["concat_dense"].shape == (2, 8 + 3 + 3)
    expected = _mlp(over_in, sd, "over_arch.model.0._mlp.", 1) @ sd["over_arch.model.1.weight"].T + sd["over_arch.model.1.bias"]
    assert user["logits"].shape == (2, 1) and user["logits"].dtype == torch.float32
    torch.testing.assert_close(user["logits"], expected, **TOL)
    # the archs alone: the same pieces
    torch.testing.assert_close(user["sparse_embeddings"], sparse, rtol=0, atol=0)
    dense_alone = _mlp(user["features"], {f"m.{k}": v for k, v in _sd(user["dense_arch"]).items()}, "m.model._mlp.", 2)
    torch.testing.assert_close(user["dense_embedded"], dense_alone, **TOL)
    torch.testing.assert_close(user["concat_dense"], _dots(user["dense_embedded"], sparse), **TOL)
    assert _shapes(user["over_arch"]) == {"model.0._mlp.0._linear.weight": (5, 10), "model.0._mlp.0._linear.bias": (5,),
                                          "model.1.weight": (1, 5), "model.1.bias": (1,)}
    assert list(user["inter_arch"].state_dict()) == []  # triu_indices is not persistent, as TorchRec's


def test_dlrm_dcn(user):
    model = user["dcn_model"]
    crossnet = {f"inter_arch.crossnet.{k}.{l}": s for k, s in (("W_kernels", (32, 4)), ("V_kernels", (4, 32)), ("bias", (32,)))
                for l in range(2)}
    assert _shapes(model) == {**DLRM_KEYS, **crossnet, "over_arch.model.0._mlp.0._linear.weight": (5, 32)}
    sd = _sd(model)
    dense = _mlp(user["features"], sd, "dense_arch.model._mlp.", 2)
    flat = torch.cat([dense.unsqueeze(1), _sparse(sd)], dim=1).reshape(2, -1)
    crossed = _low_rank_cross(flat, sd, "inter_arch.crossnet.", 2)
    expected = _mlp(crossed, sd, "over_arch.model.0._mlp.", 1) @ sd["over_arch.model.1.weight"].T + sd["over_arch.model.1.bias"]
    torch.testing.assert_close(user["dcn_logits"], expected, **TOL)
    arch = user["dcn_inter_arch"]
    flat = torch.cat([user["dense_embedded"].unsqueeze(1), user["sparse_embeddings"]], dim=1).reshape(2, -1)
    torch.testing.assert_close(user["dcn_concat"], _low_rank_cross(flat, _sd(arch), "crossnet.", 2), **TOL)


def test_dlrm_projection(user):
    model = user["projection_model"]
    branches = {f"inter_arch.interaction_branch{b}.model._mlp.{i}._linear.{p}": (out, 32) if p == "weight" else (out,)
                for b, outs in ((1, (32, 32)), (2, (32, 16))) for i, out in enumerate(outs) for p in ("weight", "bias")}
    assert _shapes(model) == {**DLRM_KEYS, **branches, "over_arch.model.0._mlp.0._linear.weight": (5, 8 + 4 * 2)}
    sd = _sd(model)
    dense = _mlp(user["features"], sd, "dense_arch.model._mlp.", 2)
    flat = torch.cat([dense.unsqueeze(1), _sparse(sd)], dim=1).reshape(2, -1)  # [B, 4 * D]
    y = _mlp(flat, sd, "inter_arch.interaction_branch1.model._mlp.", 2).reshape(2, 4, 8)  # F1 = 4 vectors of D
    z = _mlp(flat, sd, "inter_arch.interaction_branch2.model._mlp.", 2).reshape(2, 8, 2)  # D x F2 = 2
    over_in = torch.cat([dense, torch.einsum("bid,bdj->bij", y, z).reshape(2, -1)], dim=1)
    expected = _mlp(over_in, sd, "over_arch.model.0._mlp.", 1) @ sd["over_arch.model.1.weight"].T + sd["over_arch.model.1.bias"]
    torch.testing.assert_close(user["projection_logits"], expected, **TOL)


def test_dlrm_train(user):
    loss, detached, logits, labels = user["loss"], user["loss_detached"], user["logits_detached"], user["labels_detached"]
    z, y = user["logits"].detach().squeeze(-1), torch.tensor([1.0, 0.0])
    bce = -(y * torch.log(torch.sigmoid(z)) + (1 - y) * torch.log(1 - torch.sigmoid(z))).mean()
    torch.testing.assert_close(loss.detach(), bce, **TOL)
    assert loss.requires_grad and not detached.requires_grad and not logits.requires_grad
    assert torch.equal(detached, loss.detach()) and torch.equal(logits, z)
    assert logits.shape == (2,) and labels.dtype == torch.int64 and torch.equal(labels, torch.tensor([1, 0]))
    # one SGD step moved every trained weight by -lr * grad; the row of t2 no example looks up stays
    after = user["train_model"].state_dict()
    assert list(after) == [f"model.{k}" for k in DLRM_KEYS]
    assert not torch.equal(after[f"model.{EBC}.t1.weight"][1], user["before"][f"model.{EBC}.t1.weight"][1])
    assert torch.equal(after[f"model.{EBC}.t2.weight"][0], user["before"][f"model.{EBC}.t2.weight"][0])


def test_the_builtin_dlrm_is_this_dlrm(user):
    """``from torchrec.models import dlrm`` gives recship.models.dlrm, whose plain function ``builtin`` is the entry
    point `recship train` trains without --model; what it builds is a ``DLRM`` (one DLRM in recship)."""
    from recship.models.dlrm import BuiltinDLRM
    from recship.names import DLRM_ENTRY
    from recship.trainer.entry_point import build_model

    assert user["dlrm"].DLRM is user["DLRM"] and DLRM_ENTRY == "recship.models.dlrm:builtin"
    built = build_model(DLRM_ENTRY, {"num_embeddings_per_feature": [10] * 26, "embedding_dim": 8}, device="cpu")
    assert type(built) is BuiltinDLRM and isinstance(built, user["DLRM"]) and built.config.embedding_dim == 8


def _reference_logit(state, dense, kjt, names, d):
    """The DLRM's logit [B] in plain torch from a state_dict: ReLU MLPs, per-feature sums, dots of all pairs."""
    def mlp(x, prefix, count):
        for k in range(count):
            x = x @ state[f"{prefix}.{k}._linear.weight"].T + state[f"{prefix}.{k}._linear.bias"]
            x = torch.relu(x)
        return x

    b = dense.shape[0]
    x = mlp(dense, "dense_arch.model._mlp", 2)
    pooled = []
    per_key = kjt.to_dict()
    for name in names:
        jt, table = per_key[name], state[f"{EBC}.t_{name}.weight"]
        pooled.append(torch.stack([table[jt.values()[o:o + n]].sum(0) if n else torch.zeros(d) for o, n in
                                   zip(jt.offsets()[:-1].tolist(), jt.lengths().tolist())]))
    vectors = [x] + pooled
    pairs = [(vectors[i] * vectors[j]).sum(1, keepdim=True) for i in range(len(vectors)) for j in range(i + 1, len(vectors))]
    h = mlp(torch.cat([x] + pairs, dim=1), "over_arch.model.0._mlp", 2)
    return (h @ state["over_arch.model.1.weight"].T + state["over_arch.model.1.bias"]).squeeze(1)


def test_builtin_dlrm_is_torchrecs_and_loads_its_earlier_names():
    """The built-in DLRM has TorchRec's DLRM's parameter names (its state_dict loads strictly into a TorchRec-built
    DLRM of the same shape) and computes the reference logit."""
    from recship.models.dlrm import DLRM, BuiltinDLRM, DLRMConfig
    from recship.modules import EmbeddingBagCollection
    from recship.sparse import KeyedJaggedTensor

    torch.manual_seed(3)
    config = DLRMConfig(num_embeddings_per_feature=[11, 12, 13, 14], embedding_dim=8, num_dense=5, dense_arch=[16],
                        over_arch=[12, 6])
    builtin = BuiltinDLRM(config)
    theirs = DLRM(EmbeddingBagCollection(config.tables()), 5, [16, 8], [12, 6, 1])
    expected = {f"{EBC}.t_cat_{i}.weight": (11 + i, 8) for i in range(4)}
    expected.update({"dense_arch.model._mlp.0._linear.weight": (16, 5), "dense_arch.model._mlp.1._linear.weight": (8, 16),
                     "over_arch.model.0._mlp.0._linear.weight": (12, 8 + 4 + 6), "over_arch.model.0._mlp.1._linear.weight": (6, 12),
                     "over_arch.model.1.weight": (1, 6)})
    assert {k: v for k, v in _shapes(builtin).items() if k.endswith("weight")} == expected
    theirs.load_state_dict(builtin.state_dict(), strict=True)

    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 4, (4 * 6,), generator=g)
    values = torch.cat([torch.randint(0, 11, (int(n),), generator=g) for n in lengths])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=config.sparse_feature_names, values=values, lengths=lengths)
    dense = torch.rand(6, 5, generator=g)
    logit = builtin(dense, kjt)
    assert logit.shape == (6,) and torch.equal(theirs(dense, kjt).squeeze(1), logit)
    torch.testing.assert_close(logit, _reference_logit(builtin.state_dict(), dense, kjt, config.sparse_feature_names, 8),
                               rtol=1e-5, atol=1e-6)
    outputs = builtin.serving_outputs(logit)
    assert torch.equal(outputs["logit"], logit[:, None]) and torch.equal(outputs["prob"], torch.sigmoid(logit)[:, None])



def test_bad_arguments_name_the_value():
    from recship.models.dlrm import DLRM, OverArch
    from recship.models.layers import MLP, LowRankCrossNet
    from recship.trainer import EmbeddingBagCollection, EmbeddingBagConfig

    with pytest.raises(ValueError, match="'tanh'"):
        MLP(4, [2], activation="tanh")
    with pytest.raises(ValueError, match="low_rank must be at least 1, got 0"):
        LowRankCrossNet(4, 2, low_rank=0)
    with pytest.raises(ValueError, match=r"layer_sizes=\[1\]"):
        OverArch(4, [1])
    tables = [EmbeddingBagConfig(name="a", num_embeddings=4, embedding_dim=4, feature_names=["x"]),
              EmbeddingBagConfig(name="b", num_embeddings=4, embedding_dim=8, feature_names=["y"])]
    with pytest.raises(ValueError, match=r"\[4, 8\]"):
        DLRM(EmbeddingBagCollection(tables), 3, [4], [2, 1])
    with pytest.raises(ValueError, match=r"\(\[6\]\).*\(4\)"):
        DLRM(EmbeddingBagCollection(tables[:1]), 3, [6], [2, 1])
