"""``rlhf-fusion openrlhf``: the stock ``train_ppo_ray`` with the plugins in every Ray worker.

The stock flags are passed through untouched: the module runs as ``__main__`` with them as its
argv, so OpenRLHF's own parser and validation see exactly what the user typed. Before that, Ray
is started here with the options in an environment variable and our setup hook; ``train(args)``
then finds Ray up and skips its own ``ray.init``.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from .options import ENV_VAR, FUSION_FLAGS, FusionFlagError, FusionOptions, split_argv

__all__ = ["main", "ray_runtime_env", "run"]

USAGE = ("usage: rlhf-fusion openrlhf [every python -m openrlhf.cli.train_ppo_ray flag] "
         "[--fusion.stream] [--fusion.stream_scoring] [--fusion.rt auto|FRACTION] "
         "[--fusion.mechanism tokens|auto] [--fusion.gae] [--fusion.pipeline]")


def stock_env_vars() -> dict[str, str]:
    """The env vars the stock ``train`` passes to ``ray.init`` (openrlhf 0.11.2), same defaults."""
    return {
        "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get(
            "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
    }


def ray_runtime_env(options: FusionOptions, hook: str | None = None,
                    extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``runtime_env`` for ``ray.init``: stock env vars, the options, the setup hook."""
    from .hook import HOOK

    return {
        "env_vars": {**stock_env_vars(), ENV_VAR: options.to_env(), **(extra_env or {})},
        "worker_process_setup_hook": hook or HOOK,
    }


def run(stock_argv: Sequence[str], options: FusionOptions, *,
        ray_init_kwargs: dict[str, Any] | None = None) -> None:
    """Check, install in the driver, start Ray with the hook, run stock ``train_ppo_ray``."""
    import ray

    from .compat import TRAIN_MODULE, check_seams
    from .plugins import install_plugins

    check_seams(gae=options.gae, stream=options.stream, scoring=options.stream_scoring)
    install_plugins(options, check=False)
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process, so its workers would "
                           "not get the rlhf-fusion setup hook; call run() before ray.init, or "
                           "pass ray_runtime_env(options) to your own ray.init and call "
                           "openrlhf's train(args)")
    os.environ[ENV_VAR] = options.to_env()
    ray.init(runtime_env=ray_runtime_env(options), **(ray_init_kwargs or {}))
    saved = sys.argv
    sys.argv = [TRAIN_MODULE.replace(".", "/") + ".py", *stock_argv]
    try:
        runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help") and len(argv) == 1:
        print(USAGE)
        print("\nrlhf-fusion flags:")
        for flag, (_, text) in FUSION_FLAGS.items():
            print(f"  {flag:20s} {text}")
        print("\nOpenRLHF's flags: python -m openrlhf.cli.train_ppo_ray --help")
        return 0
    try:
        stock, options = split_argv(argv)
    except FusionFlagError as exc:
        print(f"rlhf-fusion openrlhf: error: {exc}", file=sys.stderr)
        return 2
    run(stock, options)
    return 0
