"""torch_sm90_sdpa: an SM90 (Hopper) attention backward for PyTorch.

Importing the package registers the ops ``torch.ops.torch_sm90_sdpa.sdpa_backward`` and
``torch.ops.torch_sm90_sdpa.sdpa`` (CPU reference everywhere; the SM90 CUDA kernels when
the extension ``torch_sm90_sdpa._C`` was built). The eager drop-in is
:func:`scaled_dot_product_attention`; :func:`build_info` says what was compiled.
"""
from . import ops  # noqa: F401  (registers the torch.library ops)
from ._extension import build_info
from .api import scaled_dot_product_attention
from .routing import apply_env as _apply_env
from .routing import disable, enable, routing_stats

__all__ = ["build_info", "disable", "enable", "routing_stats", "scaled_dot_product_attention"]
__version__ = "0.1.0"

_apply_env()  # TORCH_SM90_SDPA=1 / cpu enables routing at import
