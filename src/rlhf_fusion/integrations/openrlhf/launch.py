"""``rlhf-fusion openrlhf``: the stock ``train_ppo_ray`` with the plugins in every Ray worker.

The stock flags are passed through untouched: the module runs as ``__main__`` with them as its
argv, so OpenRLHF's own parser and validation see exactly what the user typed, before anything
starts. Our usage errors (flags, version guard, refused plugins) are reported earlier still,
argparse-style (exit 2). Ray is started by the stock ``train(args)``'s own ``ray.init``, with our
options (an environment variable) and setup hook merged into its ``runtime_env``.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from .options import ENV_VAR, FUSION_FLAGS, FusionFlagError, FusionOptions, split_argv

__all__ = ["main", "ray_runtime_env", "run"]

PROG = "rlhf-fusion openrlhf"
USAGE = (f"usage: {PROG} [every python -m openrlhf.cli.train_ppo_ray flag] "
         "[--fusion.stream] [--fusion.stream_scoring] [--fusion.rt auto|FRACTION] "
         "[--fusion.mechanism tokens|auto] [--fusion.wait_s SECONDS] [--fusion.gae] "
         "[--fusion.pipeline]")


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


def _merged_runtime_env(stock: dict[str, Any] | None, ours: dict[str, Any]) -> dict[str, Any]:
    env = dict(stock or {})
    env["env_vars"] = {**(env.get("env_vars") or {}), **ours["env_vars"]}
    env["worker_process_setup_hook"] = ours["worker_process_setup_hook"]
    return env


@contextlib.contextmanager
def _ray_init_with_hook(options: FusionOptions,
                        ray_init_kwargs: dict[str, Any] | None) -> Iterator[None]:
    """The stock ``train(args)`` calls ``ray.init(runtime_env=...)`` after its parser and
    checks: ours is merged into it there (so nothing starts before a usage error)."""
    import ray

    stock_init = ray.init

    def init(*args: Any, runtime_env: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        ours = ray_runtime_env(options)
        return stock_init(*args, runtime_env=_merged_runtime_env(runtime_env, ours),
                          **{**(ray_init_kwargs or {}), **kwargs})

    ray.init = init
    try:
        yield
    finally:
        ray.init = stock_init


def run(stock_argv: Sequence[str], options: FusionOptions, *,
        ray_init_kwargs: dict[str, Any] | None = None) -> None:
    """Check, install in the driver, run stock ``train_ppo_ray`` (whose ``ray.init`` gets the
    hook)."""
    import ray

    from .compat import TRAIN_MODULE, check_seams
    from .plugins import install_plugins

    check_seams(gae=options.gae, stream=options.stream, scoring=options.stream_scoring)
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process, so its workers would "
                           "not get the rlhf-fusion setup hook; call run() before ray.init, or "
                           "pass ray_runtime_env(options) to your own ray.init and call "
                           "openrlhf's train(args)")
    install_plugins(options, check=False)
    os.environ[ENV_VAR] = options.to_env()
    saved = sys.argv
    sys.argv = [TRAIN_MODULE.replace(".", "/") + ".py", *stock_argv]
    try:
        with _ray_init_with_hook(options, ray_init_kwargs):
            runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved


def _ours_help() -> str:
    lines = ["", "rlhf-fusion flags (docs/openrlhf.md):"]
    for flag, (takes, text) in FUSION_FLAGS.items():
        lines.append(f"  {flag + (' VALUE' if takes else ''):26s} {text}")
    return "\n".join(lines)


def _stock_help() -> str:
    """train_ppo_ray's own --help (its parser only: Ray is not started)."""
    from .compat import TRAIN_MODULE

    saved, buf = sys.argv, io.StringIO()
    sys.argv = [PROG, "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(TRAIN_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        sys.argv = saved
    return buf.getvalue().rstrip("\n")


def _usage_error(message: str) -> int:
    print(USAGE, file=sys.stderr)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _estimator(stock_argv: Sequence[str]) -> str:
    """``--algo.advantage.estimator`` as the stock parser will read it (its default: gae)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--algo.advantage.estimator", dest="estimator", default="gae")
    return parser.parse_known_args(list(stock_argv))[0].estimator


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from .compat import OpenRLHFVersionError, check_version

        try:
            check_version()
            print(_stock_help())
        except OpenRLHFVersionError as exc:
            print(f"{USAGE}\n\n(OpenRLHF's flags unavailable: {exc})")
        print(_ours_help())
        return 0
    try:
        stock, options = split_argv(argv)
    except FusionFlagError as exc:
        return _usage_error(str(exc))
    if options.pipeline:
        return _usage_error(
            "--fusion.pipeline: the fused Actor/Critic pipeline is not wired into OpenRLHF's "
            "DeepSpeed actor and critic groups; drop the flag (the other --fusion flags work "
            "without it)")
    from .compat import OpenRLHFVersionError, check_seams

    try:
        check_seams(gae=options.gae, stream=options.stream, scoring=options.stream_scoring)
    except OpenRLHFVersionError as exc:
        return _usage_error(str(exc))
    if options.gae and _estimator(stock) != "gae":
        print(f"{PROG}: note: --fusion.gae does nothing with --algo.advantage.estimator "
              f"{_estimator(stock)} (only gae computes GAE advantages); training is stock",
              file=sys.stderr)
    run(stock, options)
    return 0
