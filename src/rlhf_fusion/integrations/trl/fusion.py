"""Which rlhf-fusion plugins a TRL trainer runs (:class:`FusionConfig`). Imports no torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from ...errors import RLHFFusionError
from ...rollout.backend_registry import backend_names

__all__ = ["FusionConfig", "FusionConfigError", "vllm_fallback"]


class FusionConfigError(RLHFFusionError, ValueError):
    """A FusionConfig that cannot run; the message names the field and the fix."""


@dataclass(frozen=True)
class FusionConfig:
    """The plugins of a fused TRL trainer. The default turns every plugin on;
    :meth:`off` turns every plugin off and reproduces the stock trainer.

    - ``stream``: generate with our continuous-batching backend and score each finished sample
      (Ref, Reward, Critic, reward functions) while the rest still decode, instead of
      ``model.generate`` on the padded batch followed by scoring.
    - ``migrate``: with several processes, move the long tail to fewer processes when fewer
      than R_t samples are still decoding (``rt``: a fraction of the batch, or ``"auto"`` for
      the planner's choice) by ``mechanism`` (``"kv"``, ``"tokens"`` or ``"auto"``).
    - ``gae``: advantages by the blocked-matrix GAE kernel instead of TRL's reverse loop.
    - ``trim_padding``: each training micro-batch is cut to its own longest response rather
      than the batch's (the masked loss is unchanged; the padded columns cost nothing).
    - ``padding_free``: GRPO/RLOO: the policy/Ref forward packs every sample's real tokens into
      fewer rows (block-diagonal causal mask, original positions) instead of running the padded
      ``[B, prompt + longest completion]`` batch; the same logprobs and entropies.
    - ``pipeline_stages``: more than 1 trains Actor and Critic as one fused pipeline of that
      many stages (the processes divide into ``world / pipeline_stages`` replicas), on a
      schedule found by ``solver`` (``"auto"``: CP-SAT where installed, else greedy; or
      ``"greedy"``) within ``solver_time_limit`` seconds, from profiled stage times.
    - ``backend``: ``"reference"`` (transformers, any device), ``"vllm"`` (where installed),
      or any name registered in :mod:`rlhf_fusion.rollout.backend_registry`.
    - ``max_batch_size``: BS_max of a generation instance; ``generation_dtype``: the dtype of
      the generation copy of the Actor (``"float32"`` or ``"float64"``; the reference backend).
    - ``vllm_engine_kwargs``: extra ``vllm.AsyncEngineArgs`` for ``backend="vllm"`` (for
      example ``{"gpu_memory_utilization": 0.3}``).
    """

    stream: bool = True
    migrate: bool = True
    rt: float | Literal["auto"] = "auto"
    mechanism: Literal["kv", "tokens", "auto"] = "auto"
    gae: bool = True
    trim_padding: bool = True
    padding_free: bool = True
    pipeline_stages: int = 1
    solver: Literal["auto", "greedy", "cpsat"] = "auto"
    solver_time_limit: float = 5.0
    backend: str = "reference"
    max_batch_size: int = 64
    generation_dtype: Literal["float32", "float64"] = "float32"
    vllm_engine_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def off(cls) -> FusionConfig:
        """Every plugin off: the stock trainer's behaviour, step for step."""
        return cls(stream=False, migrate=False, gae=False, trim_padding=False,
                   padding_free=False)

    def with_(self, **changes: object) -> FusionConfig:
        """A copy with ``changes`` (``FusionConfig.off().with_(gae=True)``)."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise FusionConfigError(f"unknown FusionConfig field(s) {bad}; known: {sorted(known)}")
        return replace(self, **changes)  # type: ignore[arg-type]

    def validate(self) -> None:
        if self.rt != "auto" and not (isinstance(self.rt, (int, float)) and 0 < self.rt <= 1):
            raise FusionConfigError(
                f"rt={self.rt!r}: give a fraction of the batch in (0, 1], e.g. 0.25, or 'auto'")
        if self.mechanism not in ("kv", "tokens", "auto"):
            raise FusionConfigError(
                f"mechanism={self.mechanism!r}: use 'kv', 'tokens' or 'auto'")
        if self.backend not in backend_names():
            raise FusionConfigError(
                f"backend={self.backend!r}: use one of {list(backend_names())} (or "
                "register_backend yours in rlhf_fusion.rollout.backend_registry)")
        if self.pipeline_stages < 1:
            raise FusionConfigError(f"pipeline_stages={self.pipeline_stages}: must be >= 1")
        if self.solver not in ("auto", "greedy", "cpsat"):
            raise FusionConfigError(f"solver={self.solver!r}: use 'auto', 'greedy' or 'cpsat'")
        if self.max_batch_size < 1:
            raise FusionConfigError(f"max_batch_size={self.max_batch_size}: must be >= 1")
        if self.generation_dtype not in ("float32", "float64"):
            raise FusionConfigError(
                f"generation_dtype={self.generation_dtype!r}: use 'float32' or 'float64'")
        if self.migrate and not self.stream:
            raise FusionConfigError(
                "migrate=True needs stream=True (migration moves samples between our "
                "generation backends); set stream=True or migrate=False")


def vllm_fallback(fusion: FusionConfig, trainer: str, vllm_mode: str
                  ) -> tuple[FusionConfig, str | None]:
    """The plugins a GRPO/RLOO trainer runs with TRL's ``use_vllm=True``, and the one-line notice
    that says so (None when nothing changes).

    TRL's vLLM engine (``colocate``: an ``LLM`` in every process; ``server``: ``trl vllm-serve``)
    generates the whole batch, so there is nothing to stream from or migrate between: stream and
    migrate fall back to TRL's generation and its scoring after it. The plugins that work on
    the training forward stay on.
    """
    if not (fusion.stream or fusion.migrate):
        return fusion, None
    kept = [name for name in ("padding_free",) if getattr(fusion, name)]
    notice = (f"{trainer}: use_vllm=True (vllm_mode={vllm_mode!r}): TRL's vLLM engine generates "
              "and the batch is scored after generation, as stock (fusion.stream and "
              "fusion.migrate off); still fused: "
              f"{', '.join(kept) if kept else 'nothing'}. To stream through vLLM, set "
              "use_vllm=False and pass FusionConfig(backend='vllm').")
    return fusion.with_(stream=False, migrate=False), notice


def generation_backend(policy: Any, fusion: FusionConfig, *, seed: int, instance_id: int,
                       device: Any) -> Any:
    """This process's generation instance of ``fusion.backend`` (a name registered in
    :mod:`rlhf_fusion.rollout.backend_registry`), with its own copy of ``policy`` or, for an
    engine, the policy's checkpoint; the trainer pushes the training copy's weights into it
    before every rollout."""
    import torch

    from ...rollout.backend_registry import BackendRequest, make_backend
    from ...rollout.types import RolloutConfigError
    from .compat import generation_copy

    request = BackendRequest(
        copy_model=lambda: generation_copy(policy), instance_id=instance_id,
        max_batch_size=fusion.max_batch_size, seed=seed,
        checkpoint=getattr(policy.config, "_name_or_path", "") or None, device=device,
        dtype=getattr(torch, fusion.generation_dtype), engine_kwargs=fusion.vllm_engine_kwargs)
    try:
        return make_backend(fusion.backend, request)
    except RolloutConfigError as exc:
        raise FusionConfigError(str(exc)) from exc
