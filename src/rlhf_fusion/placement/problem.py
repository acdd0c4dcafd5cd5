"""What the planner plans for: the models (Actor and Ref, the Critic and the reward model when
the run has them), the cluster, the batch and the PPO shape.

``PlacementProblem.from_dict`` reads the ``rlhf-fusion place`` config (YAML/JSON); every bad
value raises a :class:`PlacementError` that names the field and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PlacementError
from .graph import MODELS, calls_of, check_models
from .hardware import Cluster
from .models import ModelShape, resolve_model
from .profile import Profile, load_profile

PARALLELISMS = ("megatron", "zero3", "deepspeed-chat")
PROBLEM_KEYS = frozenset({
    "models", "cluster", "batch", "prompt_len", "gen_len", "ppo_minibatches", "ppo_epochs",
    "micro_batch_tokens", "gradient_checkpointing", "offload_frozen", "lengths", "fusion",
    "oom_penalty", "iterations", "min_mesh_gpus", "name", "search", "parallelism", "profiles",
    "lora_dim", "whole_batch"})
"""The keys of a placement-problem file (``rlhf-fusion place``)."""


@dataclass(frozen=True)
class Fusion:
    """Which of our fused simulators replace the analytic costs (see ``hooks.py``)."""

    rollout: bool = False   # generation (+ inference on the generation mesh) from the R_t simulator
    train: bool = False     # Actor + Critic training on one mesh from the fused pipeline schedule


@dataclass(frozen=True)
class PlacementProblem:
    # The run's models: actor and ref always, critic (PPO; none for GRPO, RLOO, REINFORCE++)
    # and reward (a reward model; none for a rule or function reward) when it has them.
    models: dict[str, ModelShape]
    cluster: Cluster
    batch: int = 512                 # prompts (= samples) per iteration
    prompt_len: int = 1024
    gen_len: int = 1024              # generated tokens (the maximum when lengths are given)
    ppo_minibatches: int = 4
    ppo_epochs: int = 1
    micro_batch_tokens: int = 8192   # tokens per training micro-batch
    gradient_checkpointing: bool = True
    offload_frozen: bool = False     # Ref and Reward live in host memory between their calls
    length_median: float | None = None   # lognormal response lengths (median, sigma) for the
    length_sigma: float = 1.0            # rollout simulator; None: every response is gen_len
    fusion: Fusion = field(default_factory=Fusion)
    oom_penalty: float = 3.0         # ReaLHF multiplies an out-of-memory plan's time by 3
    iterations: int = 2              # iterations Algorithm 1 simulates
    min_mesh_gpus: int = 0           # 0: 1 on clusters of <= 8 GPUs, else 4 (ReaLHF's default)
    name: str = ""
    # What the runtime that will execute the plan can do (the loop: no tensor parallelism, no
    # pipeline for one model alone): strategies beyond these are never proposed.
    max_tp: int = 8
    max_pp: int | None = None
    # How presets and the co-located heuristic choose strategies: "megatron" (tp/pp/dp with a
    # distributed optimizer) or "zero3" (every call ZeRO-3 data parallel over its mesh,
    # generation through DeepSpeed's hybrid engine in a tensor-parallel layout: DeepSpeed-Chat,
    # OpenRLHF, FlexRLHF). With "zero3" the search also proposes ZeRO-3 strategies.
    # "deepspeed-chat": DeepSpeed-Chat as FlexRLHF measures it (presets.DS_CHAT_CONFIGS):
    # ZeRO-2 with replicated Ref/Reward where that fits, else ZeRO-3; the hybrid engine gathers
    # the Actor once per generation, or every decode step when the gathered model does not fit;
    # ZeRO-3 prefetch overlaps gathers with compute in training and inference.
    parallelism: str = "megatron"
    # LoRA rank on every linear layer of the Actor's and Critic's decoder layers (DeepSpeed-Chat
    # --actor_lora_dim/--critic_lora_dim with --only_optimize_lora; FlexRLHF V-A uses 4): only
    # the adapters get gradients and Adam state, the frozen weights no weight gradients, and
    # generation runs on weights with the adapters fused in. 0: full fine-tuning.
    lora_dim: int = 0
    # DeepSpeed-Chat's loop: a replica generates, scores and trains its whole share of a PPO
    # step at once (no generation rounds, one micro-batch), so memory grows with the batch and
    # "the largest batch that fits" (``max_batch``) binds. False: micro-batches of
    # ``micro_batch_tokens`` and generation in rounds that fit.
    whole_batch: bool = False
    # Measured per-layer times per model role (``rlhf-fusion profile-layers``): they replace
    # the FLOP-based compute of that model's calls.
    profiles: dict[str, Profile] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_models(self.models)
        for key in ("batch", "prompt_len", "gen_len", "ppo_minibatches", "ppo_epochs",
                    "micro_batch_tokens", "iterations"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlacementError(f"{key}: must be a positive integer, got {v!r}")
        if self.batch < self.ppo_minibatches:
            raise PlacementError(f"batch={self.batch} is smaller than ppo_minibatches="
                                 f"{self.ppo_minibatches}; raise batch or lower ppo_minibatches")
        if not isinstance(self.lora_dim, int) or self.lora_dim < 0:
            raise PlacementError(f"lora_dim: must be an integer >= 0 (0: full fine-tuning), got "
                                 f"{self.lora_dim!r}")
        if self.parallelism not in PARALLELISMS:
            raise PlacementError(f"parallelism {self.parallelism!r}: use one of {PARALLELISMS}")
        if self.oom_penalty < 1:
            raise PlacementError("oom_penalty must be >= 1 (a plan that does not fit must not "
                                 "look faster)")

    @property
    def roles(self) -> tuple[str, ...]:
        """The models present, in ``MODELS`` order."""
        return tuple(m for m in MODELS if m in self.models)

    @property
    def calls(self) -> tuple[str, ...]:
        """The calls of the models present, in ``CALLS`` order."""
        return calls_of(self.models)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def mesh_min_gpus(self) -> int:
        if self.min_mesh_gpus:
            return self.min_mesh_gpus
        return 1 if self.cluster.size <= 8 else 4

    def summary(self) -> dict[str, Any]:
        return {"name": self.name,
                "models": {k: v.name or (f"{v.params / 1e9:.3g}B" if v.params >= 1e9
                                         else f"{v.params / 1e6:.3g}M")
                           for k, v in self.models.items()},
                "cluster": [f"{g.name}: {g.nodes}x{g.gpus_per_node} {g.hardware.name}"
                            + (" (inference only)" if g.inference_only else "")
                            for g in self.cluster.groups],
                "batch": self.batch, "prompt_len": self.prompt_len, "gen_len": self.gen_len}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlacementProblem:
        if not isinstance(d, dict):
            raise PlacementError("the placement problem must be a mapping with models, cluster, "
                                 "batch, prompt_len, gen_len (see docs/placement.md)")
        known = PROBLEM_KEYS
        unknown = set(d) - known
        if unknown:
            raise PlacementError(f"unknown config keys {sorted(unknown)}; known keys: "
                                 f"{sorted(known)}")
        if "models" not in d or not isinstance(d["models"], dict):
            raise PlacementError("models: give a mapping such as {actor: llama-7b, critic: "
                                 "llama-7b}")
        raw = dict(d["models"])
        bad = set(raw) - set(MODELS)
        if bad:
            raise PlacementError(f"models: unknown roles {sorted(bad)}; use {list(MODELS)}")
        if raw.get("actor") in (None, "none"):
            raise PlacementError("models.actor is required (a preset such as llama-7b or "
                                 "{params: 7e9})")
        if "ref" in raw and raw["ref"] in (None, "none"):
            raise PlacementError("models.ref: every run has a Ref (the KL reference); leave it "
                                 "out to use the actor's model")
        # critic: null (a critic-free algorithm) or reward: null (a rule or function reward)
        # leaves that model out, with its calls.
        absent = {role for role in ("critic", "reward") if role in raw
                  and raw[role] in (None, "none")}
        for role in absent:
            del raw[role]
        # A role without its own model is the same network as another: so is its profile.
        same_as = {"critic": "actor", "ref": "actor",
                   "reward": "actor" if "critic" in absent else "critic"}
        defaulted = {role: src for role, src in same_as.items()
                     if role not in raw and role not in absent}
        for role, src in defaulted.items():
            raw[role] = raw[src]
        models = {role: resolve_model(raw[role], f"models.{role}") for role in MODELS
                  if role in raw}
        if "cluster" not in d:
            raise PlacementError("cluster: required, e.g. {nodes: 1, gpus_per_node: 8, "
                                 "hardware: a100-80g}")
        cluster = Cluster.from_dict(d["cluster"])
        lengths = d.get("lengths") or {}
        if lengths and "median" not in lengths:
            raise PlacementError("lengths: give median (and sigma) of the response lengths")
        fusion = d.get("fusion") or {}
        if not isinstance(fusion, dict) or set(fusion) - {"rollout", "train"}:
            raise PlacementError("fusion: a mapping with rollout and/or train (true/false)")
        kw: dict[str, Any] = {}
        for key in ("batch", "prompt_len", "gen_len", "ppo_minibatches", "ppo_epochs",
                    "micro_batch_tokens", "iterations", "min_mesh_gpus"):
            if key in d:
                kw[key] = _int(d[key], key)
        if "lora_dim" in d:
            kw["lora_dim"] = _int(d["lora_dim"], "lora_dim")
        for key in ("gradient_checkpointing", "offload_frozen", "whole_batch"):
            if key in d:
                kw[key] = bool(d[key])
        profiles = d.get("profiles") or {}
        if not isinstance(profiles, dict) or set(profiles) - set(models):
            raise PlacementError(f"profiles: a mapping from roles {list(models)} to a file "
                                 "written by `rlhf-fusion profile-layers` (or inline tables)")
        kw["profiles"] = {role: load_profile(spec, f"profiles.{role}")
                          for role, spec in profiles.items()}
        for role, src in defaulted.items():
            if role not in kw["profiles"] and src in kw["profiles"]:
                kw["profiles"][role] = kw["profiles"][src]
        if "parallelism" in d:
            kw["parallelism"] = str(d["parallelism"])
        if "oom_penalty" in d:
            kw["oom_penalty"] = float(d["oom_penalty"])
        return cls(models=models, cluster=cluster,
                   length_median=float(lengths["median"]) if lengths else None,
                   length_sigma=float(lengths.get("sigma", 1.0)) if lengths else 1.0,
                   fusion=Fusion(bool(fusion.get("rollout", False)), bool(fusion.get("train", False))),
                   name=str(d.get("name", "")), **kw)


def _int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise PlacementError(f"{key}: must be an integer, got {v!r}")
    return int(v)


def load_config(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON file as a dict."""
    p = Path(path)
    if not p.exists():
        raise PlacementError(f"config {p} does not exist; pass the path of a YAML/JSON "
                             "placement problem or train config")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise PlacementError(f"{p}: not valid YAML ({exc})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlacementError(f"{p}: not valid JSON ({exc}); YAML files need a .yaml suffix") from None
    return data
