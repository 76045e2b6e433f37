"""DeepSeek-V4 sparse-MLA attention for PyTorch (Triton kernels for NVIDIA Hopper).

Importing the package registers the ``torch.ops.dsv4`` ops.
"""
from . import ops  # noqa: F401  (registers torch.ops.dsv4.*)
from .api import sparse_attn, sparse_mla
from .checkpointing import checkpoint_contexts, sac_policy
from .kernels.dispatch import deterministic_backward, set_deterministic_backward, use_kernels
from .modules import SparseMLAAttention

__all__ = [
    "sparse_mla",
    "sparse_attn",
    "SparseMLAAttention",
    "sac_policy",
    "checkpoint_contexts",
    "set_deterministic_backward",
    "deterministic_backward",
    "use_kernels",
]
__version__ = "0.1.0"
