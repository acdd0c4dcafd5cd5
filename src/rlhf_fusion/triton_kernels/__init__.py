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

from .decode_attention import (
    ATTENTION_NAME,
    decode_attention,
    decode_attention_reference,
    decode_attention_torch,
    decode_attention_triton,
    register_transformers_attention,
    transformers_attention_forward,
)
from .gae import (
    gae,
    gae_packed,
    gae_packed_reference,
    gae_reference,
    gae_torch,
    gae_triton,
)

__all__ = [
    "ATTENTION_NAME",
    "decode_attention",
    "decode_attention_reference",
    "decode_attention_torch",
    "decode_attention_triton",
    "gae",
    "gae_packed",
    "gae_packed_reference",
    "gae_reference",
    "gae_torch",
    "gae_triton",
    "register_transformers_attention",
    "transformers_attention_forward",
]
