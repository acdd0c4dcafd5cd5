"""Triton kernels with torch references that double as CPU fallbacks.

* :func:`gae` / :func:`gae_packed` -- Generalized Advantage Estimation as a blocked matrix
  product (module ``rlhf_fusion.triton_kernels.gae``);
* :func:`decode_attention` -- paged, grouped-query, split-K decode attention, also available to
  ``transformers`` models via :func:`register_transformers_attention`
  (module ``rlhf_fusion.triton_kernels.decode_attention``).

Triton is optional: without it this package still imports and every function falls back to
its torch implementation. The package attributes ``gae`` and ``decode_attention`` are the
functions; reach the modules through ``sys.modules`` or ``importlib`` if you need them.
"""

from . import decode_attention as _decode_attention
from . import gae as _gae
from .decode_attention import *  # noqa: F403 (after the module imports: the function wins)
from .gae import *  # noqa: F403

__all__ = [*_decode_attention.__all__, *_gae.__all__]
