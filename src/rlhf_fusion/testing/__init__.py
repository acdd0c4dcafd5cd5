"""Test support shipped with the package (as ``torch.testing``): tiny models, synthetic PPO
experience, exactness cases and rank workers, a tiny Lightning module, a tiny distributed
rollout with fault injection, the Triton-interpreter runner for kernel tests, tiny TRL
models and tokenizers, the fake vLLM engine, the CPU stubs for OpenRLHF and the emulated
executor of a placement plan.

The project's tests, benchmarks and examples use it; so can code built on rlhf-fusion.
Everything a spawned rank runs is defined at module level, so ``rlhf_fusion.launch.run_ranks``
can pickle it by reference.

=========================  ===================================================================
submodule                  what
=========================  ===================================================================
``testing.models``         ``tiny_config``, ``build_causal_lm``, ``build_value_model`` (re-
                           exported from ``loop.models``), ``build_models``
``testing.pipeline``       ``make_experience``, ``Case``, ``run_reference``,
                           ``exactness_worker``, ``fault_worker``, ``max_abs_diff``, ...
``testing.lightning``      ``TinyPPOModule``, ``ExperienceDataset``, ``full_state``
                           (imports Lightning)
``testing.rollout``        ``TinyJob``, ``tiny_job_worker``, the injectable ``FAULTS``
``testing.kernels``        ``InterpreterChild``, ``in_interpreter_child`` (no torch import)
``testing.trl``            ``tiny_tokenizer``, ``tiny_causal_lm``, ``tiny_model_dir``, prompt
                           datasets and reward functions for TRL trainer tests
``testing.vllm``           ``FakeAsyncLLM``, the one fake vLLM engine, and
                           ``fake_vllm_module`` (kept honest by the vLLM contract tests)
``testing.openrlhf``       ``install_cpu_stubs`` (vllm, flash_attn, deepspeed stubs),
                           ``HOOK_WITH_STUBS`` (the Ray hook with them), ``StubTokenizer``,
                           ``FakeModel``
``testing.emulate``        ``emulate_plan``, ``local_hardware``, ``measure_links``: a placement
                           plan's timeline run on gloo processes to check the estimator
=========================  ===================================================================

``import rlhf_fusion.testing`` imports nothing heavy; each name below loads its submodule on
first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    # models
    "VOCAB": ".models",
    "tiny_config": ".models",
    "build_causal_lm": ".models",
    "build_value_model": ".models",
    "build_models": ".models",
    "seeded": ".models",
    # the fused PPO pipeline
    "Case": ".pipeline",
    "make_experience": ".pipeline",
    "run_reference": ".pipeline",
    "exactness_worker": ".pipeline",
    "merge_states": ".pipeline",
    "max_abs_diff": ".pipeline",
    "clone_models": ".pipeline",
    "fault_case": ".pipeline",
    "fault_worker": ".pipeline",
    # Lightning
    "ExperienceDataset": ".lightning",
    "TinyPPOModule": ".lightning",
    "full_state": ".lightning",
    # rollout
    "TinyJob": ".rollout",
    "tiny_job_worker": ".rollout",
    "model_config": ".rollout",
    "FAULTS": ".rollout",
    # Triton kernels
    "CHILD_ENV": ".kernels",
    "InterpreterChild": ".kernels",
    "in_interpreter_child": ".kernels",
    # TRL
    "CHARS": ".trl",
    "byte_bpe_tokenizer": ".trl",
    "tiny_family_model_dir": ".trl",
    "tiny_causal_lm": ".trl",
    "tiny_model_dir": ".trl",
    "tiny_prompt_dataset": ".trl",
    "tiny_tokenizer": ".trl",
    "vowel_reward": ".trl",
    "length_reward": ".trl",
    # vLLM
    "POSITION_KEY": ".vllm",
    "FakeAsyncLLM": ".vllm",
    "FakeSamplingParams": ".vllm",
    "fake_vllm_module": ".vllm",
    # OpenRLHF
    "HOOK_WITH_STUBS": ".openrlhf",
    "FakeModel": ".openrlhf",
    "StubTokenizer": ".openrlhf",
    "fake_model_actor_class": ".openrlhf",
    "install_cpu_stubs": ".openrlhf",
    "setup_worker_with_cpu_stubs": ".openrlhf",
    # the emulated placement-plan executor
    "EmulationError": ".emulate",
    "EmulationResult": ".emulate",
    "LinkMeasurement": ".emulate",
    "build_program": ".emulate",
    "emulate_plan": ".emulate",
    "local_hardware": ".emulate",
    "measure_links": ".emulate",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
