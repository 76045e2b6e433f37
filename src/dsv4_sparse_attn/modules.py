"""A DeepSeek-V4-style sparse-MLA attention block built on ``torch.ops.dsv4.sparse_mla``.

    x [T, dim] or [B, S, dim]  --wq-->  q  [.., H, D]
                               --wkv--> kv [.., D]         one shared latent head: key == value
    sparse_mla(q, kv, indices, attn_sink, scale) -> out [.., H, D]  --wo--> y [.., dim]

It is small on purpose: the tests (torch.compile, CUDA graphs, FSDP2, activation
checkpointing) and ``examples/train_block.py`` use it as the model that stands for a
DeepSeek-V4 attention layer. RoPE, the low-rank q projection, the KV compressor and the
indexer of the real model are left out: ``indices`` is given by the caller.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .api import sparse_mla


class SparseMLAAttention(nn.Module):
    """Sparse-MLA attention: H query heads over one shared latent KV head of width D.

    Args:
        dim: model width (input and output features).
        n_heads: H, the number of query heads.
        head_dim: D, the width of q, k and v (the Triton kernels take 64, 128, 256, 512;
            other widths run the PyTorch reference on the GPU, with a warning).
        scale: softmax scale, default ``head_dim ** -0.5``.
        bias: give the three projections a bias (DeepSeek's have none).
        device, dtype: factory arguments of the projections (like ``nn.Linear``).

    Parameters: ``wq`` (dim -> H*D), ``wkv`` (dim -> D), ``wo`` (H*D -> dim) and
    ``attn_sink`` [H], a learnable per-head logit that joins the softmax denominator
    (initialised to 0).

    The sink's dtype: it is *created* in float32 whatever ``dtype`` or the default dtype
    is (as in DeepSeek's reference model, which builds everything else in bfloat16).
    Casting the module afterwards (``.to(torch.bfloat16)``, ``.half()``, FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)``) casts it like every other parameter:
    standard ``nn.Module`` semantics, and FSDP2 needs one dtype for all parameters it
    shards together. Either way ``forward`` hands the op the sink in fp32
    (``attn_sink.to(torch.float32)``: a no-op when it is fp32; float64 when q is float64,
    for gradcheck), and the cast is differentiable, so the sink's gradient arrives in the
    parameter's own dtype.
    Note that a module built with ``dtype=torch.bfloat16`` has mixed parameter dtypes
    (bf16 projections, fp32 sink), which ``fully_shard`` rejects: for FSDP2 keep fp32
    parameters and let ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` cast them.

    ``forward(x, indices, return_lse=False)``:
        x [T, dim] with indices [T, K] (row ids into the T rows of kv), or
        x [B, S, dim] with indices [B, S, K] (per-sample ids into that sample's S rows).
        Ids < 0 or past the end are masked. Returns y shaped like x, and with
        ``return_lse=True`` also the sink-inclusive lse ([T, H] or [B, S, H], fp32).
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        head_dim: int,
        scale: Optional[float] = None,
        *,
        bias: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.dim, self.n_heads, self.head_dim = dim, n_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        factory = {"device": device, "dtype": dtype}
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias, **factory)
        self.wkv = nn.Linear(dim, head_dim, bias=bias, **factory)
        self.attn_sink = nn.Parameter(torch.zeros(n_heads, device=device, dtype=torch.float32))
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias, **factory)

    def forward(
        self, x: Tensor, indices: Tensor, return_lse: bool = False
    ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        if x.dim() not in (2, 3) or x.shape[-1] != self.dim:
            raise ValueError(
                f"SparseMLAAttention: x must have shape [T, {self.dim}] or [B, S, {self.dim}], "
                f"got shape {list(x.shape)}"
            )
        q = self.wq(x).unflatten(-1, (self.n_heads, self.head_dim))
        kv = self.wkv(x)
        # The op takes an fp32 sink (float64 only alongside float64 q); a no-op when it is one.
        sink = self.attn_sink.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        out, lse = sparse_mla(q, kv, indices, sink, self.scale, return_lse=True)
        y = self.wo(out.flatten(-2))
        return (y, lse) if return_lse else y

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_heads={self.n_heads}, head_dim={self.head_dim}, scale={self.scale:.4g}"
