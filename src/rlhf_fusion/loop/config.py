"""Everything one RLHF run needs to know, validated before any process starts.

``RLHFConfig`` nests five sections (models, generation, ppo, fusion, placement) beside three
top-level keys; ``from_file``/``from_dict`` read the same layout from YAML/JSON (``rlhf-fusion
train CONFIG.yaml``). Every bad value raises :class:`LoopConfigError` naming the field and the
fix, before any process starts (docs/loop.md lists every field).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rollout.backend_registry import backend_names
from .algorithm_config import AlgorithmConfig, algorithm_from, check_algorithm
from .errors import LoopConfigError
from .reward_functions import is_function_spec, resolve_reward_spec
from .sections import check_boolean as _boolean
from .sections import check_choice as _choice
from .sections import check_integer as _integer
from .sections import check_number as _number
from .sections import section

MECHANISMS = ("kv", "tokens", "auto")


ModelSource = str | Mapping[str, Any]
"""A Hub id, a local directory, or a tiny config ``{"family": "llama", "layers": 2, ...}``."""


@dataclass
class ModelsConfig:
    """The four models. ``critic``/``ref`` default to the actor's source (the Critic gets the
    actor's backbone and a new value head; the Ref is a frozen copy of the initial Actor).
    ``reward`` is a model source, a Python callable ``f(prompt, response) -> float`` (token ids
    or, with a tokenizer, text), the name of a built-in rule (``"vowels"``, ``"arithmetic"``),
    or reward functions by import path, called as TRL's (``{function: "pkg.mod:fn"}`` or
    ``{functions: [{function: ..., weight: ...}, ...]}``, :mod:`.reward_functions`).
    ``tokenizer``: a Hub id, a folder, or a built-in (``chars``, ``arithmetic``)."""

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
    ``vllm_engine_kwargs`` passed through; migration by the tokens mechanism), or any name
    registered in :mod:`rlhf_fusion.rollout.backend_registry`.
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
    """The PPO update (TRL's names where TRL has one). ``micro_batches``: the micro-batches
    one training replica runs per mini-batch (each loss a token mean over its micro-batch);
    docs/loop.md ("Mini-batches and micro-batches") and :mod:`rlhf_fusion.loop.placement`
    say what a replica is under each placement."""

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
class FusionLoopConfig:
    """The plugins of the loop (a run config's ``fusion:``; the TRL trainers have their own,
    :class:`rlhf_fusion.integrations.trl.FusionConfig`). Both ``inter`` and ``intra`` off is the
    serial baseline (RLHFuse-Base).

    ``rt``: ``"auto"`` (chosen by simulation from the response lengths seen so far, refined
    every iteration), a fraction of the batch in (0, 1), or a sample count >= 1.
    ``pipeline_stages``: stages of the Actor's training pipeline (default: every rank);
    ``critic_stages``: the Critic's (it then runs ``pipeline_stages / critic_stages`` copies).
    ``balance_scoring``: a rollout that does not migrate balances its scoring between ranks
    through the stream (:class:`~rlhf_fusion.rollout.config.RolloutConfig`).
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
    balance_scoring: bool = False

    @classmethod
    def off(cls) -> FusionLoopConfig:
        return cls(inter=False, intra=False)


@dataclass
class PlacementSection:
    """Where each model function call runs (``docs/placement.md``): a FlexRLHF preset
    (``colocated``, ``interleaved``, ``interleaved2``, ``disaggregated``) or a plan file written
    by ``rlhf-fusion place``. Neither (the default): every model on every rank, Actor and Critic
    training on the fused pipeline. A placement's training is one replica
    (``ppo.micro_batches`` per mini-batch, shared by each training call's data-parallel
    ranks), and the pipeline (if any) comes from the plan.

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
    fusion: FusionLoopConfig = field(default_factory=FusionLoopConfig)
    placement: PlacementSection = field(default_factory=PlacementSection)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)   # loop/algorithm_config
    world_size: int = 2
    iterations: int = 10
    prompts: str | None = None  # a text file (one prompt a line) or JSONL with "prompt"

    # -- reading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RLHFConfig:
        sections = {"models": ModelsConfig, "generation": GenerationConfig,
                    "ppo": PPOLoopConfig, "fusion": FusionLoopConfig,
                    "placement": PlacementSection}
        if not isinstance(data, Mapping):
            raise LoopConfigError(f"config: expected a mapping of sections, got "
                                  f"{type(data).__name__}")
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - top)
        if unknown:
            raise LoopConfigError(f"config: unknown keys {unknown}; known: {sorted(top)}")
        kw: dict[str, Any] = {}
        for key, value in data.items():
            if key in sections:
                kw[key] = section(sections[key], key, value or {})
            elif key == "algorithm":   # a name or a mapping
                kw[key] = algorithm_from(value)
            else:
                kw[key] = value
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> RLHFConfig:
        """Read a YAML (``.yaml``/``.yml``, or any other name) or JSON (``.json``) config;
        every error names the file, and the line for a syntax error."""
        p = Path(path)
        if p.is_dir():
            raise LoopConfigError(f"{p} is a directory; give the config file inside it (YAML or "
                                  "JSON, see examples/configs/)")
        if not p.exists():
            raise LoopConfigError(f"{p} does not exist; give the path of a YAML or JSON config "
                                  "(see examples/configs/)")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise LoopConfigError(f"{p}: cannot be read ({exc}); give a YAML or JSON text "
                                  "file") from None
        if p.suffix == ".json":
            import json

            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise LoopConfigError(f"{p}: line {exc.lineno}, column {exc.colno}: invalid "
                                      f"JSON ({exc.msg}); fix the syntax there") from None
        else:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
                what = getattr(exc, "problem", None) or type(exc).__name__
                raise LoopConfigError(
                    f"{p}: {where}invalid YAML ({what}); fix the syntax there (nested keys "
                    "indented under their section, a space after each colon, values holding "
                    "': ' quoted)") from None
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise LoopConfigError(f"{p}: holds a {type(data).__name__}, not a mapping; write "
                                  "top-level keys such as models:, generation:, ppo:")
        try:
            cfg = cls.from_dict(data)
        except LoopConfigError as exc:
            raise LoopConfigError(f"{p}: {exc}") from None
        if cfg.prompts is not None and isinstance(cfg.prompts, str) and not Path(
                cfg.prompts).is_absolute():
            cfg.prompts = str((p.parent / cfg.prompts).resolve())
        plan = cfg.placement.plan
        if isinstance(plan, str) and not Path(plan).is_absolute():
            cfg.placement.plan = str((p.parent / plan).resolve())
        for name in ("actor", "critic", "ref", "reward", "tokenizer"):
            # a local folder written relative to the config, as prompts and plan are
            src = getattr(cfg.models, name)
            if isinstance(src, str) and src.startswith(("./", "../")):
                setattr(cfg.models, name, str((p.parent / src).resolve()))
        return cfg

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if callable(self.models.reward):
            out["models"]["reward"] = getattr(self.models.reward, "__name__", "callable")
        return out

    # -- checking --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`LoopConfigError` for what the fields alone cannot run: every field's
        type and range and the rules between fields. The placement and the model sources are
        checked against them by :func:`rlhf_fusion.loop.resolve.resolve_run`, once."""
        self._check_fields()
        check_algorithm(self)
        g, p, f = self.generation, self.ppo, self.fusion
        if g.backend == "vllm":
            if not isinstance(self.models.actor, str):
                raise LoopConfigError(
                    "generation.backend: vllm builds its engine from a checkpoint; give "
                    "models.actor as a Hub id or a local directory (or use backend: reference)")
            if f.inter and f.mechanism == "kv":
                raise LoopConfigError(
                    "fusion.mechanism: vLLM engines export no KV cache; use tokens or auto "
                    "with generation.backend: vllm")
        elif g.vllm_engine_kwargs:
            raise LoopConfigError("generation.vllm_engine_kwargs: only used with backend: vllm; "
                                  "remove it or set generation.backend: vllm")
        if g.kv_capacity_tokens is not None:
            need = -(-(g.max_new_tokens + 1) // 16) * 16   # one prompt token + the response
            if g.kv_capacity_tokens < need:
                raise LoopConfigError(
                    f"generation.kv_capacity_tokens: {g.kv_capacity_tokens} cannot hold one "
                    f"sample of max_new_tokens={g.max_new_tokens} (at least {need} with its "
                    "prompt); raise it, lower generation.max_new_tokens, or leave it unset "
                    "(no limit)")
        batch = g.prompts_per_iteration
        if batch % p.num_mini_batches and self.algorithm.n == 1:   # n > 1: check_algorithm's
            raise LoopConfigError(
                f"ppo.num_mini_batches: {p.num_mini_batches} does not divide "
                f"generation.prompts_per_iteration={batch}; use a divisor of {batch}")
        if f.inter:
            if self.world_size < 2:
                raise LoopConfigError(
                    "fusion.inter: inter-stage fusion needs world_size >= 2 generation "
                    "instances; set world_size: 2 or fusion.inter: false")
        if f.inter or not isinstance(f.rt, str):
            self.rt_samples(None)
        offload_names(self.placement.offload)
        if self.placement.profile and self.placement.search is None:
            raise LoopConfigError("placement.profile: profiling feeds the plan search; give "
                                  "placement.search (seconds) with it")

    def _check_fields(self) -> None:
        """Each field on its own: its type and its range."""
        m, g, p, f, pl = self.models, self.generation, self.ppo, self.fusion, self.placement
        _integer("world_size", self.world_size, 1)
        _integer("iterations", self.iterations, 0)
        if self.prompts is not None:
            _prompts_file(self.prompts)
        _source("models.actor", m.actor)
        for name in ("critic", "ref"):
            if getattr(m, name) is not None:
                _source(f"models.{name}", getattr(m, name))
        if is_function_spec(m.reward):   # imported now, before any rank starts
            resolve_reward_spec(m.reward)
        elif not callable(m.reward):
            _source("models.reward", m.reward)
        if m.tokenizer is not None and not (isinstance(m.tokenizer, str) and m.tokenizer):
            raise LoopConfigError(f"models.tokenizer: {m.tokenizer!r}; give a Hub id or a local "
                                  "tokenizer folder (or leave it unset: the actor's)")
        _integer("models.seed", m.seed, 0)
        _integer("generation.prompts_per_iteration", g.prompts_per_iteration, 1)
        _integer("generation.max_new_tokens", g.max_new_tokens, 1)
        _number("generation.temperature", g.temperature, above=0.0,
                why="PPO needs the sampling distribution's logprobs")
        _integer("generation.seed", g.seed, 0)
        _integer("generation.bs_max", g.bs_max, 1)
        if g.kv_capacity_tokens is not None:
            _integer("generation.kv_capacity_tokens", g.kv_capacity_tokens, 1, unset=True)
        _choice("generation.backend", g.backend, backend_names())
        if g.vllm_engine_kwargs is not None and not isinstance(g.vllm_engine_kwargs, Mapping):
            raise LoopConfigError(
                f"generation.vllm_engine_kwargs: {g.vllm_engine_kwargs!r}; give a mapping of "
                "AsyncEngineArgs fields, e.g. {gpu_memory_utilization: 0.3}")
        for name in ("num_ppo_epochs", "num_mini_batches", "micro_batches"):
            _integer(f"ppo.{name}", getattr(p, name), 1)
        _number("ppo.learning_rate", p.learning_rate, above=0.0)
        if p.critic_learning_rate is not None:
            _number("ppo.critic_learning_rate", p.critic_learning_rate, above=0.0, unset=True)
        _number("ppo.gamma", p.gamma, least=0.0, most=1.0)
        _number("ppo.lam", p.lam, least=0.0, most=1.0)
        _number("ppo.cliprange", p.cliprange, above=0.0)
        if p.cliprange_value is not None:
            _number("ppo.cliprange_value", p.cliprange_value, above=0.0, unset=True)
        _number("ppo.kl_coef", p.kl_coef, least=0.0)
        _choice("ppo.kl_mode", p.kl_mode, ("reward", "loss"))
        _choice("ppo.kl_estimator", p.kl_estimator, ("k1", "k2", "k3"))
        _boolean("ppo.whiten_advantages", p.whiten_advantages)
        if p.max_grad_norm is not None:
            _number("ppo.max_grad_norm", p.max_grad_norm, above=0.0, unset=True,
                    why="a negative norm would flip the gradients' sign")
        _number("ppo.weight_decay", p.weight_decay, least=0.0)
        _boolean("fusion.inter", f.inter)
        _boolean("fusion.intra", f.intra)
        if f.rt != "auto":
            if isinstance(f.rt, bool) or not isinstance(f.rt, (int, float)) or not math.isfinite(
                    f.rt) or f.rt <= 0:
                raise LoopConfigError(f"fusion.rt: {f.rt!r}; use 'auto', a fraction in (0, 1) "
                                      "or a sample count")
        _choice("fusion.mechanism", f.mechanism, MECHANISMS)
        for name in ("pipeline_stages", "critic_stages"):
            if getattr(f, name) is not None:
                _integer(f"fusion.{name}", getattr(f, name), 1, unset=True)
        if f.pipeline_stages is not None and f.pipeline_stages > self.world_size:
            raise LoopConfigError(
                f"fusion.pipeline_stages: {f.pipeline_stages} stages need as many ranks; "
                f"world_size is {self.world_size}: use a divisor of it")
        if f.critic_stages is not None and self.world_size > 1 and f.critic_stages > self.stages():
            raise LoopConfigError(
                f"fusion.critic_stages: {f.critic_stages} is more than the pipeline's "
                f"{self.stages()} stages; use a divisor of {self.stages()}")
        from ..schedule.solve import SOLVERS

        _choice("fusion.solver", f.solver, SOLVERS)
        _number("fusion.solver_time_limit", f.solver_time_limit, above=0.0)
        _number("fusion.timeout_s", f.timeout_s, above=0.0)
        _boolean("fusion.balance_scoring", f.balance_scoring)
        for name in ("preset", "plan"):
            v = getattr(pl, name)
            if v is not None and not (isinstance(v, str) and v):
                raise LoopConfigError(f"placement.{name}: {v!r}; give a name or leave it unset")
        if pl.preset is not None:
            from ..placement.presets import PRESET_NAMES

            if pl.preset not in PRESET_NAMES:
                raise LoopConfigError(f"placement.preset: unknown placement preset "
                                      f"{pl.preset!r}; use one of {', '.join(PRESET_NAMES)}")
        _number("placement.inference_fraction", pl.inference_fraction, above=0.0, below=1.0)
        if pl.search is not None:
            _number("placement.search", pl.search, above=0.0, unset=True,
                    why="the search time in seconds")
        from ..placement.hardware import HARDWARE

        if not isinstance(pl.hardware, str) or pl.hardware.lower() not in HARDWARE:
            raise LoopConfigError(f"placement.hardware: {pl.hardware!r}; use one of "
                                  f"{sorted(HARDWARE)}")
        _boolean("placement.profile", pl.profile)

    def offloaded(self) -> tuple[str, ...]:
        """The frozen models kept in host memory between their calls: ``placement.offload``
        when set, else the plan file's ``offload``."""
        own = offload_names(self.placement.offload)
        if own is not None:
            return own
        if self.placement.plan is None:
            return ()
        import json

        try:   # the plan file's own list (the placement checks the file when resolved)
            raw = json.loads(Path(self.placement.plan).read_text())
        except (OSError, ValueError):
            return ()
        return tuple(m for m in FROZEN_MODELS if m in (raw.get("offload") or ()))

    def stages(self) -> int:
        return self.fusion.pipeline_stages or self.world_size

    def rt_samples(self, auto: int | None) -> int | None:
        """R_t in samples: the fixed value, or ``auto`` (the planner's) when ``rt="auto"``.
        A fraction is of the iteration's samples (prompts x ``algorithm.n``)."""
        rt = self.fusion.rt
        batch = self.generation.prompts_per_iteration * self.algorithm.n
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


def _source(name: str, value: Any) -> None:
    if isinstance(value, Mapping):
        return   # its keys are checked with the model (models.check_sources)
    if not isinstance(value, str) or not value:
        extra = ", a built-in rule name" if name == "models.reward" else ""
        raise LoopConfigError(
            f"{name}: {value!r}; give a Hub id, a local model folder{extra} or a tiny config "
            "such as {family: llama, layers: 2}")


def _prompts_file(value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise LoopConfigError(f"prompts: {value!r}; give the path of a prompt file (one prompt "
                              "a line, or JSONL with a \"prompt\" field)")
    p = Path(value)
    if p.is_dir():
        raise LoopConfigError(f"prompts: {p} is a directory; give a prompt file (one prompt a "
                              "line, or JSONL with a \"prompt\" field)")
    if not p.exists():
        raise LoopConfigError(f"prompts: {p} does not exist; give a prompt file (one prompt a "
                              "line, or JSONL with a \"prompt\" field), or remove the key to use "
                              "the demo's prompts")
