"""The loop's ``algorithm:`` section: PPO (a Critic and GAE, the default) or a critic-free
algorithm (GRPO, RLOO, REINFORCE++), with the knobs verl and TRL users know.

A run config writes either a name (``algorithm: grpo``) or a mapping
(``algorithm: {name: grpo, n: 8, scale_rewards: none, loss_agg_mode: seq-mean-token-sum}``).
:func:`check_algorithm` validates it with the rest of the config, before any process starts;
every error names the field (``algorithm.<field>``) and the fix. :meth:`AlgorithmConfig.resolved`
gives the worker one set of concrete values (aliases merged, ``None`` filled from ``ppo:``).
``docs/algorithms.md`` ("In the loop") maps every field onto verl's and TRL's names.

The tensor math lives in :mod:`rlhf_fusion.algorithms`; this module only names and checks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..algorithms import LOSS_AGG_MODES, TRL_LOSS_TYPES
from .errors import LoopConfigError
from .sections import check_boolean as _boolean
from .sections import check_choice as _choice
from .sections import check_integer as _integer
from .sections import check_number as _number
from .sections import section

# ``cfg`` below is a loop.config.RLHFConfig; config.py imports this module (loop/ has no
# import cycles, TYPE_CHECKING ones included: tests/test_layering.py).
RLHFConfig = Any

__all__ = [
    "ALGORITHMS",
    "CRITIC_FREE",
    "AlgorithmConfig",
    "ResolvedAlgorithm",
    "algorithm_from",
    "check_algorithm",
    "samples_per_iteration",
]

#: ``name`` values. ``reinforce_pp`` is verl's ``reinforce_plus_plus`` (returns whitened over
#: the batch), ``reinforce_pp_baseline`` its group-mean variant.
ALGORITHMS: tuple[str, ...] = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
CRITIC_FREE: frozenset[str] = frozenset(ALGORITHMS) - {"ppo"}
#: the algorithms whose advantage needs a group of at least two samples per prompt
GROUPED: frozenset[str] = frozenset({"grpo", "rloo", "reinforce_pp_baseline"})
SCALE_REWARDS = ("group", "batch", "none")
KL_TYPES = ("k1", "kl", "k2", "mse", "k3", "abs", "low_var_kl")
KL_CONTROLLERS = ("fixed", "adaptive")


@dataclass
class AlgorithmConfig:
    """The ``algorithm:`` section. Every field but ``name``, ``n`` and the KL controller's is
    for the critic-free algorithms only; under ``ppo`` the ``ppo:`` section holds the same
    knobs by TRL's PPO names, and setting one of these there is an error naming that field.

    ``n``: samples per prompt (verl ``rollout.n``, TRL ``num_generations``); one iteration
    trains on ``generation.prompts_per_iteration * n`` samples.
    ``scale_rewards`` (TRL) / ``norm_adv_by_std_in_grpo`` (verl, a bool alias): GRPO's
    division by the group std (``group``), the batch std (``batch``) or none (Dr.GRPO).
    ``loss_agg_mode`` (verl) / ``loss_type`` (TRL's GRPO names, an alias).
    ``use_kl_loss``/``kl_loss_coef``/``kl_loss_type``: the KL as a loss term (TRL's ``beta``);
    ``use_kl_in_reward``/``kl_coef``/``kl_penalty``: the KL subtracted from the reward.
    ``kl_ctrl: adaptive`` adapts the KL coefficient in effect (``ppo.kl_coef`` under ppo; the
    in-reward ``kl_coef``, else ``kl_loss_coef``, for the others) towards ``target_kl`` per
    token over ``kl_horizon`` samples (:class:`rlhf_fusion.algorithms.AdaptiveKLController`).
    ``clip_ratio_low``/``clip_ratio_high`` (DAPO's clip-higher) and ``ppo_epochs`` default
    to ``ppo.cliprange`` and ``ppo.num_ppo_epochs``; ``clip_ratio_c``: verl's dual clip
    (``None``: off, as TRL).
    """

    name: str = "ppo"
    n: int = 1
    scale_rewards: str = "group"
    norm_adv_by_std_in_grpo: bool | None = None
    epsilon: float = 1e-6
    loss_agg_mode: str = "token-mean"
    loss_type: str | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001
    kl_penalty: str = "k1"
    kl_ctrl: str = "fixed"
    target_kl: float = 0.1
    kl_horizon: int = 10000
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    ppo_epochs: int | None = None

    @property
    def critic_free(self) -> bool:
        return self.name in CRITIC_FREE

    def resolved(self, ppo: Any) -> ResolvedAlgorithm:
        """Concrete values for the worker: the aliases merged, ``None`` filled from ``ppo``
        (the run's :class:`~rlhf_fusion.loop.config.PPOLoopConfig`). Call after
        :func:`check_algorithm`."""
        scale = self.scale_rewards
        if self.norm_adv_by_std_in_grpo is not None:
            scale = "group" if self.norm_adv_by_std_in_grpo else "none"
        agg = TRL_LOSS_TYPES[self.loss_type] if self.loss_type is not None else self.loss_agg_mode
        if self.name == "ppo":
            kl_in_reward, kl_coef = ppo.kl_mode == "reward", float(ppo.kl_coef)
            kl_loss = 0.0 if kl_in_reward else float(ppo.kl_coef)
        else:
            kl_in_reward = self.use_kl_in_reward
            kl_coef = float(self.kl_coef) if kl_in_reward else 0.0
            kl_loss = float(self.kl_loss_coef) if self.use_kl_loss else 0.0
        return ResolvedAlgorithm(
            name=self.name, n=self.n, scale_rewards=scale, epsilon=float(self.epsilon),
            loss_agg_mode=agg, kl_in_reward=kl_in_reward, kl_coef=kl_coef,
            kl_penalty=self.kl_penalty if self.name != "ppo" else ppo.kl_estimator,
            kl_loss_coef=kl_loss, kl_loss_type=self.kl_loss_type,
            adaptive_kl=self.kl_ctrl == "adaptive", target_kl=float(self.target_kl),
            kl_horizon=int(self.kl_horizon),
            clip_ratio_low=float(ppo.cliprange if self.clip_ratio_low is None
                                 else self.clip_ratio_low),
            clip_ratio_high=float(ppo.cliprange if self.clip_ratio_high is None
                                  else self.clip_ratio_high),
            clip_ratio_c=None if self.clip_ratio_c is None else float(self.clip_ratio_c),
            epochs=int(ppo.num_ppo_epochs if self.ppo_epochs is None else self.ppo_epochs),
            gamma=float(ppo.gamma))


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """:meth:`AlgorithmConfig.resolved`: what the worker reads, nothing left to default.

    ``kl_coef`` is the in-reward coefficient (0 when the KL is not in the reward),
    ``kl_loss_coef`` the loss term's (0 when off); under ppo they come from ``ppo.kl_coef``
    and ``ppo.kl_mode``."""

    name: str
    n: int
    scale_rewards: str
    epsilon: float
    loss_agg_mode: str
    kl_in_reward: bool
    kl_coef: float
    kl_penalty: str
    kl_loss_coef: float
    kl_loss_type: str
    adaptive_kl: bool
    target_kl: float
    kl_horizon: int
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    epochs: int
    gamma: float


def algorithm_from(value: Any) -> AlgorithmConfig:
    """The section as a run config writes it: a name, a mapping, or an AlgorithmConfig."""
    if isinstance(value, AlgorithmConfig):
        return value
    if value is None:
        return AlgorithmConfig()
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise LoopConfigError(f"algorithm: expected a name ({', '.join(ALGORITHMS)}) or a "
                              f"mapping with name:, got {type(value).__name__}")
    return section(AlgorithmConfig, "algorithm", value)


def samples_per_iteration(cfg: RLHFConfig) -> int:
    """The samples one iteration generates and trains on: prompts x ``algorithm.n``."""
    return cfg.generation.prompts_per_iteration * cfg.algorithm.n


# Fields only the critic-free algorithms read, with the ppo: field that does the same job
# under ppo (None: none does).
_CRITIC_FREE_ONLY: dict[str, str | None] = {
    "scale_rewards": None, "norm_adv_by_std_in_grpo": None, "epsilon": None,
    "loss_agg_mode": None, "loss_type": None, "use_kl_loss": "ppo.kl_mode: loss",
    "kl_loss_coef": "ppo.kl_coef", "kl_loss_type": "ppo.kl_estimator",
    "use_kl_in_reward": "ppo.kl_mode: reward", "kl_coef": "ppo.kl_coef",
    "kl_penalty": "ppo.kl_estimator", "clip_ratio_low": "ppo.cliprange",
    "clip_ratio_high": "ppo.cliprange", "clip_ratio_c": None, "ppo_epochs": "ppo.num_ppo_epochs",
}


def check_algorithm(cfg: RLHFConfig) -> None:
    """Raise :class:`LoopConfigError` naming the field for anything ``cfg.algorithm`` cannot
    run: each field's type and range, then the rules across sections (no Critic for a
    critic-free algorithm, the group size, mini-batches over ``prompts x n`` samples)."""
    a = cfg.algorithm
    if not isinstance(a, AlgorithmConfig):
        raise LoopConfigError(f"algorithm: {a!r}; give a name ({', '.join(ALGORITHMS)}) or a "
                              "mapping with name:")
    _choice("algorithm.name", a.name, ALGORITHMS)
    _integer("algorithm.n", a.n, 1)
    _choice("algorithm.scale_rewards", a.scale_rewards, SCALE_REWARDS)
    if a.norm_adv_by_std_in_grpo is not None:
        _boolean("algorithm.norm_adv_by_std_in_grpo", a.norm_adv_by_std_in_grpo)
        implied = "group" if a.norm_adv_by_std_in_grpo else "none"
        if a.scale_rewards not in ("group", implied):
            raise LoopConfigError(
                f"algorithm.norm_adv_by_std_in_grpo: {a.norm_adv_by_std_in_grpo} (verl's name) "
                f"contradicts algorithm.scale_rewards: {a.scale_rewards} (TRL's); set one of them")
    _number("algorithm.epsilon", a.epsilon, above=0.0)
    _choice("algorithm.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
    if a.loss_type is not None:
        _choice("algorithm.loss_type", a.loss_type, tuple(TRL_LOSS_TYPES))
        if a.loss_agg_mode not in ("token-mean", TRL_LOSS_TYPES[a.loss_type]):
            raise LoopConfigError(
                f"algorithm.loss_type: {a.loss_type} (TRL's name) is loss_agg_mode "
                f"{TRL_LOSS_TYPES[a.loss_type]}, not algorithm.loss_agg_mode: "
                f"{a.loss_agg_mode}; set one of them")
    _boolean("algorithm.use_kl_loss", a.use_kl_loss)
    _number("algorithm.kl_loss_coef", a.kl_loss_coef, least=0.0)
    _kl_type("algorithm.kl_loss_type", a.kl_loss_type)
    _boolean("algorithm.use_kl_in_reward", a.use_kl_in_reward)
    _number("algorithm.kl_coef", a.kl_coef, least=0.0)
    _kl_type("algorithm.kl_penalty", a.kl_penalty)
    _choice("algorithm.kl_ctrl", a.kl_ctrl, KL_CONTROLLERS)
    _number("algorithm.target_kl", a.target_kl, above=0.0)
    _integer("algorithm.kl_horizon", a.kl_horizon, 1)
    if a.clip_ratio_low is not None:
        _number("algorithm.clip_ratio_low", a.clip_ratio_low, above=0.0, below=1.0,
                why="the ratio's lower bound is 1 - clip_ratio_low")
    if a.clip_ratio_high is not None:
        _number("algorithm.clip_ratio_high", a.clip_ratio_high, above=0.0)
    if a.clip_ratio_c is not None:
        _number("algorithm.clip_ratio_c", a.clip_ratio_c, above=1.0,
                why="the dual clip bounds a negative advantage's loss at -A * clip_ratio_c")
    if a.ppo_epochs is not None:
        _integer("algorithm.ppo_epochs", a.ppo_epochs, 1)
    _check_across(cfg, a)


def _check_across(cfg: RLHFConfig, a: AlgorithmConfig) -> None:
    if a.name == "ppo":
        if a.n != 1:
            raise LoopConfigError(
                f"algorithm.n: {a.n}; the PPO loop answers each prompt once (n: 1). For several "
                "samples per prompt use a critic-free algorithm (name: grpo, rloo, "
                "reinforce_pp_baseline)")
        defaults = AlgorithmConfig()
        for name, instead in _CRITIC_FREE_ONLY.items():
            if getattr(a, name) != getattr(defaults, name):
                fix = f"set {instead} instead" if instead else "remove it"
                raise LoopConfigError(f"algorithm.{name}: only the critic-free algorithms read "
                                      f"it; with algorithm.name: ppo {fix}")
    else:
        if a.name in GROUPED and a.n < 2:
            raise LoopConfigError(
                f"algorithm.n: {a.n}; {a.name} compares the samples of one prompt, so it needs "
                "n >= 2 samples per prompt (typically 4 to 16)")
        if cfg.models.critic is not None:
            raise LoopConfigError(f"models.critic: {a.name} builds no Critic; remove "
                                  "models.critic (or use algorithm.name: ppo)")
        if cfg.ppo.critic_learning_rate is not None:
            raise LoopConfigError(f"ppo.critic_learning_rate: {a.name} trains no Critic; "
                                  "remove it")
        if cfg.fusion.critic_stages is not None:
            raise LoopConfigError(f"fusion.critic_stages: {a.name} places no Critic; remove it")
        if a.use_kl_in_reward and a.use_kl_loss:
            raise LoopConfigError(
                "algorithm.use_kl_loss: the KL is already in the reward (use_kl_in_reward: "
                "true); keep one of the two (verl's GRPO recipes use the loss)")
    if a.kl_ctrl == "adaptive":
        if a.name == "ppo" and cfg.ppo.kl_coef == 0:
            raise LoopConfigError("algorithm.kl_ctrl: adaptive starts from ppo.kl_coef, which "
                                  "is 0; give ppo.kl_coef a starting value > 0")
        if a.name != "ppo" and not (a.use_kl_in_reward or a.use_kl_loss):
            raise LoopConfigError(
                "algorithm.kl_ctrl: adaptive needs a KL term to adapt; set "
                "algorithm.use_kl_in_reward: true (verl) or algorithm.use_kl_loss: true")
    samples = samples_per_iteration(cfg)
    mb = cfg.ppo.num_mini_batches
    if a.n > 1 and isinstance(mb, int) and mb >= 1 and samples % mb:   # n 1: config.py's
        raise LoopConfigError(
            f"ppo.num_mini_batches: {mb} does not divide the {samples} samples of an "
            f"iteration (generation.prompts_per_iteration x algorithm.n); use a divisor of "
            f"{samples}")


# -- field checks (the shared ones are loop/sections.py's) --
def _kl_type(name: str, value: Any) -> None:
    base = value[:-1] if isinstance(value, str) and value.endswith("+") else value
    if base not in KL_TYPES:
        raise LoopConfigError(f"{name}: {value!r}; use one of {', '.join(KL_TYPES)} (a "
                              "trailing '+' takes k2's gradient, as verl)")


