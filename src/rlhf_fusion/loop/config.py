"""Everything one RLHF run needs to know, validated before any process starts.

``RLHFConfig`` nests four sections (models, generation, PPO, fusion); ``from_dict`` reads the
same layout from YAML/JSON (``rlhf-fusion train CONFIG.yaml``). Every bad value raises
:class:`LoopConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
MECHANISMS = ("kv", "tokens", "auto")


class LoopConfigError(ValueError):
    """A run configuration that cannot work; the message names the field and the fix."""


ModelSource = str | Mapping[str, Any]
"""A Hub id, a local directory, or a tiny config ``{"family": "llama", "layers": 2, ...}``."""


@dataclass
class ModelsConfig:
    """The four models. ``critic``/``ref`` default to the actor's source (the Critic gets the
    actor's backbone and a new value head; the Ref is a frozen copy of the initial Actor).
    ``reward`` is a model source, a Python callable ``f(prompt, response) -> float`` (token ids
    or, with a tokenizer, text), or the name of a built-in rule (``"vowels"``)."""

    actor: ModelSource = field(default_factory=lambda: {"family": "llama"})
    critic: ModelSource | None = None
    ref: ModelSource | None = None
    reward: ModelSource | Callable[..., float] = "vowels"
    tokenizer: str | None = None
    seed: int = 0


@dataclass
class GenerationConfig:
    """Sampling: ``prompts_per_iteration`` prompts, each answered once per iteration.

    ``backend``: ``"reference"`` (our transformers backend, any device) or ``"vllm"`` (an
    ``AsyncLLMEngine`` per rank built from ``models.actor``, a Hub id or directory, with
    ``vllm_engine_kwargs`` passed through; migration by the tokens mechanism).
    """

    prompts_per_iteration: int = 32
    max_new_tokens: int = 256
    temperature: float = 1.0
    seed: int = 0
    bs_max: int = 64
    kv_capacity_tokens: int | None = None
    backend: str = "reference"
    vllm_engine_kwargs: dict[str, Any] | None = None


@dataclass
class PPOLoopConfig:
    """The PPO update (TRL's names where TRL has one). ``micro_batches`` is per pipeline
    replica: with ``world_size / pipeline_stages`` replicas a mini-batch is split into
    ``micro_batches x replicas`` micro-batches (each loss a token mean over its micro-batch)."""

    num_ppo_epochs: int = 2
    num_mini_batches: int = 2
    micro_batches: int = 2
    learning_rate: float = 1e-3
    critic_learning_rate: float | None = None
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float | None = 0.2
    kl_coef: float = 0.05
    kl_mode: str = "reward"
    kl_estimator: str = "k1"
    whiten_advantages: bool = True
    max_grad_norm: float | None = 1.0
    weight_decay: float = 0.0


@dataclass
class FusionConfig:
    """The plugins. Both ``inter`` and ``intra`` off is the serial baseline (RLHFuse-Base).

    ``rt``: ``"auto"`` (chosen by simulation from the response lengths seen so far, refined
    every iteration), a fraction of the batch in (0, 1), or a sample count >= 1.
    ``pipeline_stages``: stages of the Actor's training pipeline (default: every rank);
    ``critic_stages``: the Critic's (it then runs ``pipeline_stages / critic_stages`` copies).
    """

    inter: bool = True
    intra: bool = True
    rt: str | float = "auto"
    mechanism: str = "kv"
    pipeline_stages: int | None = None
    critic_stages: int | None = None
    solver: str = "auto"
    solver_time_limit: float = 5.0
    timeout_s: float = 120.0

    @classmethod
    def off(cls) -> FusionConfig:
        return cls(inter=False, intra=False)


@dataclass
class PlacementSection:
    """Where each model function call runs (``docs/placement.md``): a FlexRLHF preset
    (``colocated``, ``interleaved``, ``interleaved2``, ``disaggregated``) or a plan file written
    by ``rlhf-fusion plan``. Neither (the default): every model on every rank, Actor and Critic
    training on the fused pipeline. Under a placement ``ppo.micro_batches`` counts the
    micro-batches of a whole mini-batch, shared by the data-parallel ranks of each training
    call, and the pipeline (if any) comes from the plan.

    ``profile``: with ``search``, the search's compute costs come from this machine: every
    model's decoder layers are timed first where the loop computes (as ``rlhf-fusion
    profile-layers`` does); the profiles are written next to the plan. Communication and
    generation stay the ``hardware`` preset's.

    ``offload``: the frozen models kept in host memory between their calls and prefetched at
    the start of each rollout (``docs/loop.md``): ``true`` (Ref and Reward), ``false``, or a
    list such as ``[ref]``; it needs no preset or plan. Unset (``None``): a plan file's
    ``offload``, else none. A rule reward has no weights: offloading it does nothing."""

    preset: str | None = None
    plan: str | None = None
    inference_fraction: float = 0.5
    search: float | None = None       # seconds: search a plan at start (rlhf-fusion train)
    hardware: str = "a100-80g"        # the devices the search plans for
    profile: bool = False             # the search's compute from this machine's own layers
    offload: bool | list[str] | None = None   # frozen models in host memory between calls

    @property
    def given(self) -> bool:
        return self.preset is not None or self.plan is not None or self.search is not None


@dataclass
class RLHFConfig:
    models: ModelsConfig = field(default_factory=ModelsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    ppo: PPOLoopConfig = field(default_factory=PPOLoopConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    placement: PlacementSection = field(default_factory=PlacementSection)
    world_size: int = 2
    iterations: int = 10
    prompts: str | None = None  # a text file (one prompt a line) or JSONL with "prompt"

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RLHFConfig:
        sections = {"models": ModelsConfig, "generation": GenerationConfig,
                    "ppo": PPOLoopConfig, "fusion": FusionConfig,
                    "placement": PlacementSection}
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - top)
        if unknown:
            raise LoopConfigError(f"config: unknown keys {unknown}; known: {sorted(top)}")
        kw: dict[str, Any] = {}
        for key, value in data.items():
            if key in sections:
                kw[key] = _section(sections[key], key, value or {})
            else:
                kw[key] = value
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> RLHFConfig:
        p = Path(path)
        text = p.read_text()
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            import json

            data = json.loads(text)
        cfg = cls.from_dict(data)
        if cfg.prompts is not None and not Path(cfg.prompts).is_absolute():
            cfg.prompts = str((p.parent / cfg.prompts).resolve())
        plan = cfg.placement.plan
        if plan is not None and not Path(plan).is_absolute():
            cfg.placement.plan = str((p.parent / plan).resolve())
        return cfg

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if callable(self.models.reward):
            out["models"]["reward"] = getattr(self.models.reward, "__name__", "callable")
        return out

    # -- checking --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`LoopConfigError` for anything that cannot run (no process started)."""
        g, p, f = self.generation, self.ppo, self.fusion
        _positive("world_size", self.world_size)
        _positive("iterations", self.iterations, zero=True)
        for src_name in ("actor", "critic", "ref"):
            src = getattr(self.models, src_name)
            if isinstance(src, Mapping):
                fam = src.get("family", "llama")
                if fam not in MODEL_FAMILIES:
                    raise LoopConfigError(
                        f"models.{src_name}.family: unknown model family {fam!r}; supported: "
                        f"{', '.join(MODEL_FAMILIES)}")
        _positive("generation.prompts_per_iteration", g.prompts_per_iteration)
        _positive("generation.max_new_tokens", g.max_new_tokens)
        _positive("generation.bs_max", g.bs_max)
        if g.backend not in ("reference", "vllm"):
            raise LoopConfigError(
                f"generation.backend: {g.backend!r}; use 'reference' or 'vllm'")
        if g.backend == "vllm":
            if not isinstance(self.models.actor, str):
                raise LoopConfigError(
                    "generation.backend: vllm builds its engine from a checkpoint; give "
                    "models.actor as a Hub id or a local directory (or use backend: reference)")
            if f.inter and f.mechanism == "kv":
                raise LoopConfigError(
                    "fusion.mechanism: vLLM engines export no KV cache; use tokens or auto "
                    "with generation.backend: vllm")
        if g.temperature <= 0:
            raise LoopConfigError("generation.temperature: must be > 0 (PPO needs the sampling "
                                  "distribution's logprobs)")
        for name in ("num_ppo_epochs", "num_mini_batches", "micro_batches"):
            _positive(f"ppo.{name}", getattr(p, name))
        batch = g.prompts_per_iteration
        if batch % p.num_mini_batches:
            raise LoopConfigError(
                f"ppo.num_mini_batches: {p.num_mini_batches} does not divide "
                f"generation.prompts_per_iteration={batch}; use a divisor of {batch}")
        mini = batch // p.num_mini_batches
        replicas = self.world_size // self.stages() if self.world_size > 1 else 1
        if self.placement.given:
            replicas = 1   # micro_batches counts a whole mini-batch (checked per call below)
        if mini % (p.micro_batches * replicas):
            raise LoopConfigError(
                f"ppo.micro_batches: a mini-batch of {mini} samples cannot be split into "
                f"{p.micro_batches} micro-batches x {replicas} data-parallel replicas; pick "
                f"micro_batches dividing {mini // replicas}")
        if p.kl_mode not in ("reward", "loss"):
            raise LoopConfigError(f"ppo.kl_mode: {p.kl_mode!r}; use 'reward' or 'loss'")
        if p.kl_estimator not in ("k1", "k2", "k3"):
            raise LoopConfigError(f"ppo.kl_estimator: {p.kl_estimator!r}; use k1, k2 or k3")
        if not (0 <= p.gamma <= 1 and 0 <= p.lam <= 1):
            raise LoopConfigError("ppo.gamma and ppo.lam must lie in [0, 1]")
        if f.mechanism not in MECHANISMS:
            raise LoopConfigError(f"fusion.mechanism: {f.mechanism!r}; use one of {MECHANISMS}")
        if f.inter:
            if self.world_size < 2:
                raise LoopConfigError(
                    "fusion.inter: inter-stage fusion needs world_size >= 2 generation "
                    "instances; set world_size: 2 or fusion.inter: false")
            self.rt_samples(None)
        if self.world_size > 1:
            n = self.stages()
            if self.world_size % n:
                raise LoopConfigError(
                    f"fusion.pipeline_stages: {n} does not divide world_size={self.world_size}")
            cs = f.critic_stages or n
            if n % cs:
                raise LoopConfigError(
                    f"fusion.critic_stages: {cs} does not divide pipeline_stages={n}")
            if (p.micro_batches % (n // cs)):
                raise LoopConfigError(
                    f"ppo.micro_batches: {p.micro_batches} cannot be shared by the {n // cs} "
                    f"Critic copies; use a multiple of {n // cs}")
        if f.timeout_s <= 0:
            raise LoopConfigError("fusion.timeout_s: must be > 0 seconds")
        offload_names(self.placement.offload)
        if self.placement.profile and self.placement.search is None:
            raise LoopConfigError("placement.profile: profiling feeds the plan search; give "
                                  "placement.search (seconds) with it")
        if self.placement.given:
            self.loop_placement()

    def offloaded(self, placement: Any = None) -> tuple[str, ...]:
        """The frozen models kept in host memory between their calls: ``placement.offload``
        when set, else the plan file's ``offload`` (``placement``: the resolved
        :class:`~rlhf_fusion.loop.placement.LoopPlacement`, resolved here when omitted)."""
        own = offload_names(self.placement.offload)
        if own is not None:
            return own
        if placement is None and self.placement.plan is not None:
            placement = self.loop_placement()
        return tuple(getattr(placement, "offload", ()))

    def loop_placement(self) -> Any:
        """The resolved :class:`~rlhf_fusion.loop.placement.LoopPlacement` (``None``: the
        default co-located loop), checked against the rest of the config."""
        from .placement import PlacementConfigError, resolve

        pl = self.placement
        if not pl.given:
            return None
        if pl.search is not None:
            if pl.preset is not None or pl.plan is not None:
                raise LoopConfigError("placement: give one of preset, plan or search")
            if not pl.search > 0:
                raise LoopConfigError(f"placement.search: {pl.search!r}; give the search "
                                      "time in seconds (> 0)")
            return None   # resolved once, before the processes start (loop.placement.search)
        if self.fusion.pipeline_stages is not None or self.fusion.critic_stages is not None:
            raise LoopConfigError(
                "fusion.pipeline_stages / critic_stages: under a placement the training "
                "layout comes from the placement (a plan's pp); remove them")
        if self.generation.backend != "reference":
            raise LoopConfigError("placement: runs with generation.backend: reference only")
        try:
            lp = resolve(pl.preset, pl.plan, self.world_size, pl.inference_fraction)
        except PlacementConfigError as exc:
            raise LoopConfigError(str(exc)) from exc
        m = self.ppo.micro_batches
        for call in ("actor_train", "critic_train"):
            dp = lp.calls[call].dp
            if m % dp:
                raise LoopConfigError(
                    f"ppo.micro_batches: {m} micro-batches per mini-batch cannot be shared by "
                    f"the {dp} data-parallel ranks of {call} in placement {lp.name}; use a "
                    f"multiple of {dp}")
        return lp

    def stages(self) -> int:
        return self.fusion.pipeline_stages or self.world_size

    def rt_samples(self, auto: int | None) -> int | None:
        """R_t in samples: the fixed value, or ``auto`` (the planner's) when ``rt="auto"``."""
        rt, batch = self.fusion.rt, self.generation.prompts_per_iteration
        if rt == "auto":
            return auto
        if isinstance(rt, str):
            raise LoopConfigError(f"fusion.rt: {rt!r}; use 'auto', a fraction in (0, 1) or a "
                                  "sample count")
        if 0 < rt < 1:
            return max(1, round(rt * batch))
        if rt >= 1 and float(rt).is_integer() and rt <= batch:
            return int(rt)
        raise LoopConfigError(
            f"fusion.rt: {rt} is outside the batch of {batch} samples; use a fraction in (0, 1) "
            f"or a count in 1..{batch} (or 'auto')")


FROZEN_MODELS = ("ref", "reward")


def offload_names(value: Any) -> tuple[str, ...] | None:
    """``placement.offload`` as a tuple of frozen model names (``None``: not set)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return FROZEN_MODELS if value else ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise LoopConfigError(f"placement.offload: {value!r}; give true (Ref and Reward), "
                              "false, or a list of model names such as [ref, reward]")
    for v in value:
        if v in ("actor", "critic"):
            raise LoopConfigError(
                f"placement.offload: {v} is trained every iteration and cannot live in host "
                "memory between calls; only the frozen ref and reward can: use [ref], "
                "[reward], [ref, reward] or true")
        if v not in FROZEN_MODELS:
            raise LoopConfigError(f"placement.offload: unknown model {v!r}; use [ref], "
                                  "[reward], [ref, reward] or true")
    return tuple(m for m in FROZEN_MODELS if m in value)


def _section(cls: type, name: str, value: Any) -> Any:
    if not isinstance(value, Mapping):
        raise LoopConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise LoopConfigError(f"{name}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**value)


def _positive(name: str, value: Any, *, zero: bool = False) -> None:
    ok = isinstance(value, int) and (value >= 0 if zero else value >= 1)
    if not ok or (isinstance(value, float) and math.isnan(value)):
        raise LoopConfigError(f"{name}: must be an integer >= {0 if zero else 1}, got {value!r}")
