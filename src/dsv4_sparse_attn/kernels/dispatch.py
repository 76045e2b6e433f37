"""Choose, for a CUDA call, the Triton kernel or (for shapes it cannot take) the reference."""
from __future__ import annotations

from .. import reference


def forward(q, kv, indices, attn_sink, p):
    return reference.sparse_mla_fwd(q, kv, indices, attn_sink, p.scale)


def backward(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p):
    return reference.sparse_mla_bwd(grad_out, grad_lse, q, kv, out, lse, indices, attn_sink, p.scale)
