"""Both kernels compile to cubin for sm_80 and sm_90 without a GPU, with no register spills.

``triton.compile`` targets an explicit ``GPUTarget``; the ptxas bundled in Triton's wheel
assembles the PTX and reports registers and spill traffic, and cuobjdump reads the resource
usage of the cubin Triton produced. The configurations are the ones the launchers pick
(``rlhf_fusion.triton_kernels._compile.kernel_configs``), specialised like a launch on
contiguous tensors.
"""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from rlhf_fusion.testing import in_interpreter_child  # noqa: E402
from rlhf_fusion.triton_kernels import _compile  # noqa: E402

if in_interpreter_child() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip(
        "compilation needs the real JIT; TRITON_INTERPRET=1 is set", allow_module_level=True
    )

_CONFIGS = _compile.kernel_configs()


def _ptxas_or_skip(capability: int) -> None:
    ok, why = _compile.ptxas_available(capability)
    if not ok:
        pytest.skip(f"ptxas/cuobjdump from the Triton wheel cannot run here: {why}")


@pytest.mark.parametrize("capability", _compile.ARCHS, ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize("config", _CONFIGS, ids=[c.name for c in _CONFIGS])
def test_compiles_without_spills(config, capability):
    _ptxas_or_skip(capability)
    report = _compile.compile_kernel(config, capability)
    assert report.arch.startswith(f"sm_{capability}")
    assert report.spill_stores == 0 and report.spill_loads == 0, report.ptxas_log
    assert report.stack_bytes == 0 and report.cubin_stack_bytes == 0, report.ptxas_log
    # the reassembled PTX and Triton's own cubin agree, so the report describes that cubin
    assert report.registers == report.cubin_registers


def test_spill_check_can_fail():
    """The same check reports spills for a tile that is too large for the register file."""
    _ptxas_or_skip(80)
    import dataclasses

    base = next(c for c in _CONFIGS if c.name.startswith("decode_split[bf16,G=4,D=128"))
    # Unspecialised strides defeat vectorised loads: one 64-bit address per element.
    heavy = dataclasses.replace(base, ones=(), divisible=(), num_warps=4)
    report = _compile.compile_kernel(heavy, 80)
    assert report.spills > 0


def test_configs_cover_launcher_choices():
    names = {c.name.split("[")[0] for c in _CONFIGS}
    assert names == {"gae", "decode_split", "decode_merge"}
    gae = [c for c in _CONFIGS if c.name.startswith("gae")]
    assert {c.constexprs["SKIP"] for c in gae} == {False, True}
    assert {c.constexprs["PACKED"] for c in gae} == {False, True}
