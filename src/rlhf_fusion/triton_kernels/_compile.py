"""Ahead-of-time compilation of the kernels to cubin, without a GPU.

``triton.compile`` lowers a kernel for an explicit ``GPUTarget`` with no device present; the
bundled ``ptxas`` then assembles the PTX, and its ``-v`` report gives the register count and any
spill traffic. CI uses this to check that every kernel configuration the launchers use compiles
for sm_80 and sm_90 without register spills (``tests/test_kernel_compile.py``).

Run ``python -m rlhf_fusion.triton_kernels._compile`` for a table.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ._triton_utils import require_triton, triton

__all__ = ["KernelConfig", "CompileReport", "kernel_configs", "compile_kernel", "ptxas_available"]

ARCHS = (80, 90)


@dataclass(frozen=True)
class KernelConfig:
    """One specialisation of a kernel: argument types, constexprs, launch options."""

    name: str
    kernel: Any
    types: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    # Mimic the launch-time specialisation Triton applies to contiguous tensors: integer
    # arguments equal to 1 become constants, pointers (and the listed integers) are known to be
    # multiples of 16. Without it, loads do not vectorise and register counts are not the real
    # ones.
    ones: tuple[str, ...] = ()
    divisible: tuple[str, ...] = ()

    def all_constexprs(self) -> dict[str, Any]:
        return {**{name: 1 for name in self.ones}, **self.constexprs}

    def attrs(self) -> dict[tuple[int, ...], list[list[Any]]]:
        sig = self.signature()
        out = {}
        for i, arg in enumerate(self.kernel.arg_names):
            if sig[arg].startswith("*") or (arg in self.divisible and sig[arg] != "constexpr"):
                out[(i,)] = [["tt.divisibility", 16]]
        return out

    def signature(self) -> dict[str, str]:
        sig = {}
        constexprs = self.all_constexprs()
        for arg in self.kernel.arg_names:
            if arg in constexprs:
                sig[arg] = "constexpr"
            elif arg in self.types:
                sig[arg] = self.types[arg]
            elif arg.startswith("stride"):
                sig[arg] = "i64"  # large caches have strides beyond int32
            else:
                raise KeyError(f"{self.name}: no type for argument {arg!r}")
        return sig


@dataclass
class CompileReport:
    config: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    cubin_bytes: int
    cubin_registers: int  # from cuobjdump on the cubin Triton itself produced
    cubin_stack_bytes: int
    ptxas_log: str = field(repr=False, default="")

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


_DECODE_ONES = ("stride_qd", "stride_kd", "stride_vd", "stride_btp", "stride_od", "stride_pod")
_DECODE_DIVISIBLE = (
    "stride_qb", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
    "stride_vh", "stride_ob", "stride_oh", "stride_pob", "stride_poh", "stride_pos",
)  # fmt: skip


def kernel_configs() -> list[KernelConfig]:
    """The specialisations the launchers produce for the shapes that matter."""
    require_triton("kernel_configs")
    import importlib

    # the package attributes `gae` / `decode_attention` are the functions, not the modules
    g = importlib.import_module(f"{__package__}.gae")
    da = importlib.import_module(f"{__package__}.decode_attention")

    configs: list[KernelConfig] = []
    for dtype in ("fp32", "bf16"):
        for skip in (False, True):
            for packed in (False, True):
                r_sub, blk, warps = (
                    (g._SKIP_R, g._SKIP_BLK, g._SKIP_WARPS)
                    if skip
                    else (g._ZERO_R, g._ZERO_BLK, g._ZERO_WARPS)
                )
                configs.append(
                    KernelConfig(
                        name=f"gae[{'skip' if skip else 'zero'},{dtype},"
                        f"{'packed' if packed else 'padded'}]",
                        kernel=g._gae_kernel,
                        types={
                            "R": f"*{dtype}",
                            "V": f"*{dtype}",
                            "M": "*u8",
                            "BOOT": "*fp32",
                            "CU": "*i32",
                            "ADV": "*fp32",
                            "RET": "*fp32",
                            "T": "i32",
                            "gamma": "fp32",
                            "log2w": "fp32",
                        },
                        constexprs={
                            "HAS_MASK": True,
                            "HAS_BOOT": True,
                            "PACKED": packed,
                            "SKIP": skip,
                            "R_SUB": r_sub,
                            "BLK": blk,
                        },
                        ones=("stride_rt", "stride_vt", "stride_mt", "stride_at", "stride_ot"),
                        num_warps=warps,
                    )
                )
    decode_cases = (
        # dtype, native dot, GQA group, head dim, page size, splits
        ("bf16", True, 4, 128, 16, 1),  # the benchmark shape (32 q heads / 8 kv heads)
        ("bf16", True, 4, 128, 16, 8),
        ("bf16", True, 8, 64, 1, 4),
        ("bf16", True, 1, 256, 32, 1),
        ("fp16", True, 4, 128, 16, 1),
        ("fp32", False, 4, 128, 16, 1),
        ("fp32", False, 16, 64, 64, 2),
    )
    for dtype, native, group, dim, page, splits in decode_cases:
        block_g, block_d, block_n, num_warps = da._tile_config(group, dim)
        configs.append(
            KernelConfig(
                name=f"decode_split[{dtype},G={group},D={dim},page={page},splits={splits}]",
                kernel=da._decode_split_kernel,
                types={
                    "Q": f"*{dtype}",
                    "K": f"*{dtype}",
                    "V": f"*{dtype}",
                    "BT": "*i32",
                    "SL": "*i32",
                    "Out": f"*{dtype}",
                    "PO": "*fp32",
                    "PL": "*fp32",
                    "qk_scale": "fp32",
                },
                constexprs={
                    "PAGE_SIZE": page,
                    "GROUP": group,
                    "BLOCK_G": block_g,
                    "HEAD_DIM": dim,
                    "BLOCK_D": block_d,
                    "BLOCK_N": block_n,
                    "NUM_SPLITS": splits,
                    "NATIVE_DOT": native,
                },
                num_warps=num_warps,
                ones=_DECODE_ONES,
                divisible=_DECODE_DIVISIBLE,
            )
        )
    configs.append(
        KernelConfig(
            name="decode_merge[bf16,D=128,splits=8]",
            kernel=da._decode_merge_kernel,
            types={"PO": "*fp32", "PL": "*fp32", "Out": "*bf16"},
            constexprs={"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 8, "BLOCK_S": 8},
            ones=("stride_pod", "stride_pls", "stride_od"),
            divisible=("stride_pob", "stride_poh", "stride_pos", "stride_plb", "stride_plh"),
        )
    )
    return configs


def _ptxas_path(capability: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(capability).path


def _tool_path(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_available(capability: int = 80) -> tuple[bool, str]:
    """Whether the ptxas that Triton uses for ``capability`` runs here (and why not)."""
    require_triton("ptxas_available")
    try:
        path = _ptxas_path(capability)
        for tool in (path, _tool_path("cuobjdump")):
            subprocess.run([tool, "--version"], check=True, capture_output=True, timeout=60)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot check here"
        return False, f"{type(exc).__name__}: {exc}"
    return True, path


_SPILL_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REG_RE = re.compile(r"Used (\d+) registers")
_RES_RE = re.compile(r"REG:(\d+) STACK:(\d+)")


def compile_kernel(config: KernelConfig, capability: int) -> CompileReport:
    """Compile ``config`` for ``sm_<capability>`` and read ptxas's resource report."""
    require_triton("compile_kernel")
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(
        fn=config.kernel,
        signature=config.signature(),
        constexprs=config.all_constexprs(),
        attrs=config.attrs(),
    )
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", capability, 32),
        options={
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "enable_fp_fusion": True,
        },
    )
    ptx = compiled.asm["ptx"]
    cubin = compiled.asm["cubin"]
    arch = re.search(r"\.target\s+(\S+)", ptx).group(1)  # type: ignore[union-attr]
    with tempfile.TemporaryDirectory() as tmp:
        # Triton ran ptxas already but keeps its log only on failure: assemble the PTX again
        # with Triton's flags, for the spill report ...
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as fh:
            fh.write(ptx)
        cmd = [_ptxas_path(capability), "-lineinfo", "-v", "--regAllocOptLevel=2"]
        cmd += [f"--gpu-name={arch}", ptx_path, "-o", os.path.join(tmp, "again.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        # ... and read the resource usage of Triton's own cubin.
        cubin_path = os.path.join(tmp, "kernel.cubin")
        with open(cubin_path, "wb") as fh:
            fh.write(cubin)
        usage = subprocess.run(
            [_tool_path("cuobjdump"), "--dump-resource-usage", cubin_path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    spill = _SPILL_RE.search(log)
    regs = _REG_RE.search(log)
    res = _RES_RE.search(usage)
    if spill is None or regs is None or res is None:
        raise RuntimeError(f"could not read the resource report for {config.name}:\n{log}{usage}")
    return CompileReport(
        config=config.name,
        arch=arch,
        registers=int(regs.group(1)),
        stack_bytes=int(spill.group(1)),
        spill_stores=int(spill.group(2)),
        spill_loads=int(spill.group(3)),
        cubin_bytes=len(cubin),
        cubin_registers=int(res.group(1)),
        cubin_stack_bytes=int(res.group(2)),
        ptxas_log=log,
    )


def main() -> None:
    print(f"{'kernel configuration':56s} {'arch':7s} {'regs':>4s} {'spill':>5s} {'stack':>5s}")
    for config in kernel_configs():
        for cap in ARCHS:
            rep = compile_kernel(config, cap)
            print(
                f"{rep.config:56s} {rep.arch:7s} {rep.cubin_registers:4d} {rep.spills:5d} "
                f"{rep.cubin_stack_bytes:5d}"
            )


if __name__ == "__main__":
    main()
