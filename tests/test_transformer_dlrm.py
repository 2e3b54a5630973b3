"""TorchRec's experimental DLRM_Transformer and DLRMWrapper: outputs against plain-PyTorch computations from the
state_dict (a hand-written post-norm encoder layer), TorchRec's parameter names.

Checked against TorchRec 1.8.0 besides (not here: no TorchRec in the tests): with the same seed, both models'
initial state_dicts, eval and train (dropout) outputs, the transformer's gradients, and DLRMWrapper's loss were
bit-equal to TorchRec's.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from recship import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from recship.models.dlrm import DLRM, DLRMWrapper
from recship.models.transformer_dlrm import DLRM_Transformer, InteractionTransformerArch

B, D = 6, 8


def ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection([
        EmbeddingBagConfig(name="t1", embedding_dim=D, num_embeddings=20, feature_names=["f1", "f3"]),
        EmbeddingBagConfig(name="t2", embedding_dim=D, num_embeddings=30, feature_names=["f2"]),
    ])


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * B,), generator=g)
    ids = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    return torch.rand(B, 13, generator=g), KeyedJaggedTensor(["f1", "f3", "f2"], ids, lengths=lengths)


def _layer_norm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


def _encoder_layer(x: torch.Tensor, sd, p: str, nhead: int) -> torch.Tensor:
    """torch's post-norm encoder layer in eval mode, by hand; x [S, N, E] (sequence first)."""
    s, n, e = x.shape
    qkv = x @ sd[p + "self_attn.in_proj_weight"].T + sd[p + "self_attn.in_proj_bias"]
    q, k, v = (t.reshape(s, n, nhead, e // nhead) for t in qkv.split(e, dim=-1))
    scores = torch.einsum("snhd,tnhd->nhst", q, k) / math.sqrt(e // nhead)
    attended = torch.einsum("nhst,tnhd->snhd", scores.softmax(-1), v).reshape(s, n, e)
    x = _layer_norm(x + attended @ sd[p + "self_attn.out_proj.weight"].T + sd[p + "self_attn.out_proj.bias"],
                    sd[p + "norm1.weight"], sd[p + "norm1.bias"])
    hidden = torch.relu(x @ sd[p + "linear1.weight"].T + sd[p + "linear1.bias"])
    return _layer_norm(x + hidden @ sd[p + "linear2.weight"].T + sd[p + "linear2.bias"], sd[p + "norm2.weight"], sd[p + "norm2.bias"])


def _mlp(x, sd, prefix, n):
    for i in range(n):
        x = torch.relu(x @ sd[f"{prefix}{i}._linear.weight"].T + sd[f"{prefix}{i}._linear.bias"])
    return x


def test_transformer_dlrm_as_a_plain_encoder_over_the_batch():
    torch.manual_seed(1)
    model = DLRM_Transformer(ebc(), 13, [16, D], [12, 1], nhead=2, ntransformer_layers=2).eval()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    assert "inter_arch.interarch_TE.layers.1.self_attn.in_proj_weight" in sd
    assert sd["over_arch.model.0._mlp.0._linear.weight"].shape == (12, 4 * D)
    dense, kjt = inputs()
    dense_out = _mlp(dense, sd, "dense_arch.model._mlp.", 2)
    rows = {f: jt for f, jt in kjt.to_dict().items()}
    table = {"f1": "t1", "f3": "t1", "f2": "t2"}
    sparse = torch.stack([
        torch.stack([sd[f"sparse_arch.embedding_bag_collection.embedding_bags.{table[f]}.weight"][ids].sum(0)
                     for ids in torch.split(rows[f].values(), rows[f].lengths().tolist())])
        for f in ["f1", "f3", "f2"]], dim=1)
    x = torch.cat([dense_out.unsqueeze(1), sparse], dim=1)  # [B, 4, D]: the batch is the encoder's sequence
    for layer in range(2):
        x = _encoder_layer(x, sd, f"inter_arch.interarch_TE.layers.{layer}.", nhead=2)
    hidden = _mlp(x.reshape(B, -1), sd, "over_arch.model.0._mlp.", 1)
    want = hidden @ sd["over_arch.model.1.weight"].T + sd["over_arch.model.1.bias"]
    torch.testing.assert_close(model(dense, kjt), want, rtol=1e-5, atol=1e-5)


def test_batch_first_attends_within_each_example():
    torch.manual_seed(0)
    arch = InteractionTransformerArch(3, D, nhead=2, ntransformer_layers=1, batch_first=True).eval()
    dense, sparse = torch.randn(B, D), torch.randn(B, 3, D)
    whole = arch(dense, sparse)
    assert whole.shape == (B, 4 * D)
    torch.testing.assert_close(whole[2:3], arch(dense[2:3], sparse[2:3]))
    torch_order = InteractionTransformerArch(3, D, nhead=2, ntransformer_layers=1)
    torch_order.load_state_dict(arch.state_dict())
    torch_order.eval()
    assert not torch.allclose(torch_order(dense, sparse)[2:3], torch_order(dense[2:3], sparse[2:3]))


def test_nhead_must_divide_the_width():
    with pytest.raises(ValueError, match="multiple of nhead"):
        InteractionTransformerArch(3, 6, nhead=4)


def test_dlrm_wrapper_loss_and_prediction():
    torch.manual_seed(2)
    wrapper = DLRMWrapper(ebc(), 13, [16, D], [12, 1])
    plain = DLRM(ebc(), 13, [16, D], [12, 1])
    plain.load_state_dict(wrapper.state_dict())
    dense, kjt = inputs(3)
    label = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    batch = SimpleNamespace(float_features=dense, idlist_features=kjt, label=label)
    loss, pred = wrapper(batch)
    logits = plain(dense, kjt)
    torch.testing.assert_close(pred, logits)
    p = torch.sigmoid(logits.squeeze(1))
    torch.testing.assert_close(loss, -(label * torch.log(p) + (1 - label) * torch.log(1 - p)).mean())
    wrapper.eval()
    torch.testing.assert_close(wrapper(batch), logits)
