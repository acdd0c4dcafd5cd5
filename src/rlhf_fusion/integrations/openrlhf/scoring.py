"""Inter-stage fusion: the Reward/Ref/Critic (and Actor) forwards streamed while generation runs.

Stock OpenRLHF collects the whole batch, then ``RemoteExperienceMaker.make_experience_batch``
splits it into micro-batches (``split_rollout_samples``: ``rollout.micro_batch_size`` samples in
batch order, ``Experience.concat_experiences``) and dispatches every model's ``forward`` over
them (``_dispatch_forward`` -> ``RayActorGroup.async_run_method_batch``).

With ``--fusion.stream_scoring`` the streamed generator (``streaming.fusion_generate_vllm``)
hands each accepted prompt's experiences to a :class:`StreamScorer`. Accepted samples only ever
append to the batch (dynamic filtering drops or keeps whole prompts before they are appended),
so a micro-batch is final the moment it is full: it is concatenated exactly as
``split_rollout_samples`` would, and once a group has one full micro-batch per data-parallel
rank, that wave goes out through the group's own ``async_run_method_batch`` (Ray object refs;
nothing waits). At the end of generation the rest goes out. ``make_experience_batch`` then runs
stock, with two seams answered from the stream: ``split_rollout_samples`` returns the streamed
micro-batches and ``_dispatch_forward`` returns the refs already in flight, so KL, rewards,
advantages and everything after are OpenRLHF's own code on the same tensors.

Stock where there is nothing to overlap or the batch is not known while it streams
(:func:`stock_reason`): ``--train.colocate_all`` (the models share the GPUs with the engines, and
sleep while they decode), ``--train.async_enable`` (Actor and Critic train while the next batch
generates), ``--train.dynamic_batch_enable`` (micro-batches balanced over the whole batch's
lengths) and ``vllm_generate_batch_size != rollout.batch_size`` (samples buffered across steps).
A pair colocated by ``--train.colocate_actor_ref`` / ``--train.colocate_critic_reward`` streams one
member (Ref, Reward); the other runs at the end after it, as stock serialises them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from . import plugin_state

__all__ = ["ScoredBatch", "ScoringLink", "StreamScorer", "link_scoring", "stock_reason"]

ORDER = ("reward", "actor", "critic", "ref")  # stock make_experience's dispatch order


def stock_reason(args: Any) -> str | None:
    """Why this run's topology keeps the stock make_experience path, or None to stream."""
    train, rollout = args.train, args.rollout
    if getattr(train, "colocate_all", False):
        return ("--train.colocate_all: the models share the GPUs with the vLLM engines (and "
                "sleep while they decode), so there is nothing to overlap")
    if getattr(train, "async_enable", False):
        return ("--train.async_enable: Actor and Critic train while the next batch generates; "
                "their forwards must see the weights make_experience sees")
    if getattr(train, "dynamic_batch_enable", False):
        return ("--train.dynamic_batch_enable: micro-batches are balanced over the lengths of the "
                "whole batch, known only when the last sample is in")
    gen = getattr(rollout, "vllm_generate_batch_size", None) or rollout.batch_size
    if gen != rollout.batch_size:
        return ("--rollout.vllm_generate_batch_size != --rollout.batch_size: samples are buffered "
                "across steps and scored with the weights of a later step")
    return None


@dataclass
class ScoringStats:
    """What the last streamed batch did (on the generator as ``_fusion_scoring_stats``)."""

    micro_batches: int = 0
    waves: dict[str, int] = field(default_factory=dict)  # group -> async_run_method_batch calls
    first_dispatch_at: float | None = None  # time.time() of the first wave
    live_at_first_dispatch: int | None = None  # samples still decoding then
    finished_at: float | None = None  # the last sample collected


@dataclass
class ScoredBatch:
    """One batch whose forwards are in flight: the samples in batch order, their micro-batches
    (as ``split_rollout_samples`` builds them) and each streamed group's refs (in
    ``_flatten_results`` order: micro-batch order, ring/TP duplicates adjacent)."""

    samples: list[Any]
    micro_batches: list[Any]
    refs: dict[int, list[Any]]  # id(group) -> refs
    groups: dict[str, Any]  # streamed name -> group
    partners: dict[int, Any]  # id(deferred group) -> its streamed colocated partner

    def matches(self, rollout_samples: list[Any]) -> bool:
        return len(rollout_samples) == len(self.samples) and all(
            a is b for a, b in zip(rollout_samples, self.samples))


class ScoringLink:
    """Shared by a trainer's SamplesGenerator and RemoteExperienceMaker (same process)."""

    def __init__(self, groups: dict[str, Any], args: Any, pad_token_id: int,
                 reason: str | None) -> None:
        self.groups = groups  # name -> RayActorGroup or None, as the maker holds them
        self.args = args
        self.pad_token_id = pad_token_id
        self.reason = reason  # not None: stock path, and why
        self.pending: ScoredBatch | None = None
        self.used = 0  # batches made from the stream
        self.fallbacks = 0  # streamed batches that did not match what make_experience got

    def take(self, rollout_samples: list[Any]) -> ScoredBatch | None:
        scored, self.pending = self.pending, None
        if scored is None:
            return None
        if not scored.matches(rollout_samples):
            self.fallbacks += 1
            return None
        self.used += 1
        return scored


def link_scoring(trainer: Any) -> ScoringLink | None:
    """After ``BasePPOTrainer.__init__``: link its samples generator to its experience maker.
    None (and nothing linked) for a trainer without both (async TrainingActor)."""
    gen = getattr(trainer, "samples_generator", None)
    maker = getattr(trainer, "experience_maker", None)
    if gen is None or maker is None:
        if maker is not None:  # async TrainingActor: its samples come from another actor
            from openrlhf.utils.logging_utils import init_logger

            init_logger(__name__).info(
                "rlhf_fusion: --fusion.stream_scoring falls back to stock make_experience: "
                f"{stock_reason(maker.args) or 'the samples are generated in another actor'}")
        return None
    reason = stock_reason(maker.args)
    if reason is None and not getattr(gen, "vllm_engines", None):
        reason = "no vLLM engines"
    link = ScoringLink(
        {"reward": maker.reward_model_group, "actor": maker.actor_model_group,
         "critic": maker.critic_model_group, "ref": maker.initial_model_group},
        maker.args, maker.tokenizer.pad_token_id, reason)
    gen._fusion_link = link
    maker._fusion_link = link
    if reason is not None:
        from openrlhf.utils.logging_utils import init_logger

        init_logger(__name__).info(f"rlhf_fusion: --fusion.stream_scoring falls back to stock "
                                   f"make_experience: {reason}")
    return link


def _effective(group: Any) -> int:
    return len(group._actor_handlers) // group.duplicate_actors


def _dispatch(group: Any, **kwargs: Any) -> list[Any]:
    """``forward`` over these micro-batches on ``group``, as ``_dispatch_forward`` without the
    sync. ``async_run_method_batch`` itself where it accepts the count (>= one per rank);
    fewer (only the batch's last micro-batches) go one per rank to the first ranks."""
    total = len(next(iter(kwargs.values())))
    if total >= _effective(group):
        return group.async_run_method_batch(method_name="forward", **kwargs)
    import ray

    refs = []
    for i in range(total):
        chunk = ray.put({k: v[i:i + 1] for k, v in kwargs.items()})
        for j in range(group.duplicate_actors):
            actor = group._actor_handlers[i * group.duplicate_actors + j]
            refs.append(actor.execute_batch.remote("forward", chunk, 0, 1))
    return refs


class StreamScorer:
    """Builds micro-batches from accepted samples and dispatches each group's waves."""

    def __init__(self, link: ScoringLink) -> None:
        self.link = link
        self.samples: list[Any] = []
        self.micro: list[Any] = []
        self.sent: dict[str, int] = {}  # group name -> micro-batches dispatched
        self.refs: dict[str, list[Any]] = {}
        self.streamed: dict[str, Any] | None = None  # decided at the first micro-batch
        self.partners: dict[int, Any] = {}
        self.stats = ScoringStats()

    @property
    def micro_batch_size(self) -> int:
        return int(self.link.args.rollout.micro_batch_size)

    def _decide(self, first: Any) -> None:
        g, train = self.link.groups, self.link.args.train
        use_rm = first.rewards is None  # stock: samples_list[0].rewards is None
        streamed = {name: g[name] for name in ORDER if g[name] is not None
                    and (name != "reward" or use_rm)}
        # colocated pairs: stream one, the other runs after it at the end (stock serialises)
        if getattr(train, "colocate_actor_ref", False) and "ref" in streamed:
            self.partners[id(streamed.pop("actor"))] = streamed["ref"]
        if (getattr(train, "colocate_critic_reward", False) and "reward" in streamed
                and "critic" in streamed):
            self.partners[id(streamed.pop("critic"))] = streamed["reward"]
        self.streamed = streamed

    def _kwargs(self, name: str, mbs: list[Any]) -> dict[str, Any]:
        # make_experience's kwargs for this group, over these micro-batches
        seqs = [s.sequences for s in mbs]
        attn = [s.attention_mask for s in mbs]
        if name == "reward":
            return dict(sequences=seqs, attention_mask=attn, pad_sequence=[True] * len(mbs))
        kw = dict(sequences=seqs, action_mask=[s.action_mask for s in mbs], attention_mask=attn)
        if name in ("actor", "ref") and any(s.mm_train_inputs for s in mbs):
            kw["mm_train_inputs_list"] = [s.mm_train_inputs for s in mbs]
        return kw

    def _seal(self, members: list[Any]) -> None:
        from openrlhf.trainer.ppo_utils.experience import Experience

        self.micro.append(Experience.concat_experiences(members, self.link.pad_token_id))
        self.stats.micro_batches += 1
        if self.streamed is None:
            self._decide(members[0])

    def _send(self, final: bool, live: int) -> None:
        assert self.streamed is not None
        for name, group in self.streamed.items():
            start = self.sent.get(name, 0)
            ready = len(self.micro) - start
            if final:
                k = ready
            else:
                eff = _effective(group)
                k = ready // eff * eff  # whole waves: one micro-batch per data-parallel rank
            if k <= 0:
                continue
            mbs = self.micro[start:start + k]
            self.refs.setdefault(name, []).extend(_dispatch(group, **self._kwargs(name, mbs)))
            self.sent[name] = start + k
            self.stats.waves[name] = self.stats.waves.get(name, 0) + 1
            if self.stats.first_dispatch_at is None:
                self.stats.first_dispatch_at = time.time()
                self.stats.live_at_first_dispatch = live

    def add(self, experiences: list[Any], live: int) -> None:
        """A prompt's accepted experiences (appended to the batch in this order); ``live``:
        samples still decoding."""
        mb = self.micro_batch_size
        for e in experiences:
            e.index = [len(self.samples)]  # as split_rollout_samples numbers them
            self.samples.append(e)
            if len(self.samples) % mb == 0:
                self._seal(self.samples[-mb:])
        if self.streamed is not None:
            self._send(final=False, live=live)

    def finish(self) -> ScoredBatch | None:
        self.stats.finished_at = time.time()
        if not self.samples:
            return None
        rest = len(self.samples) % self.micro_batch_size
        if rest:
            self._seal(self.samples[-rest:])
        self._send(final=True, live=0)
        assert self.streamed is not None
        return ScoredBatch(
            samples=list(self.samples), micro_batches=list(self.micro),
            refs={id(g): self.refs[n] for n, g in self.streamed.items()},
            groups=dict(self.streamed), partners=dict(self.partners))


# -- the RemoteExperienceMaker seams -------------------------------------------------------------


def fusion_make_experience_batch(self: Any, rollout_samples: list[Any]) -> list[Any]:
    """Stock ``make_experience_batch``, answered from the stream when this batch was streamed."""
    stock = plugin_state.stock("stream_scoring", "make_experience_batch")
    link = getattr(self, "_fusion_link", None)
    scored = link.take(rollout_samples) if link is not None else None
    self._fusion_scored = scored
    try:
        return stock(self, rollout_samples)
    finally:
        self._fusion_scored = None


def fusion_split_rollout_samples(self: Any, rollout_samples: list[Any]) -> list[Any]:
    scored = getattr(self, "_fusion_scored", None)
    if scored is None:
        return plugin_state.stock("stream_scoring", "split_rollout_samples")(self, rollout_samples)
    for i, sample in enumerate(rollout_samples):
        sample.index = [i]
    return scored.micro_batches


def fusion_dispatch_forward(self: Any, group: Any, sync_condition: Any, **kwargs: Any) -> Any:
    import ray

    stock = plugin_state.stock("stream_scoring", "_dispatch_forward")
    scored = getattr(self, "_fusion_scored", None)
    if scored is None:
        return stock(self, group, sync_condition, **kwargs)
    refs = scored.refs.get(id(group))
    if refs is not None:  # in flight since generation
        if sync_condition:
            ray.get(refs)
            ray.get(group.async_run_method(method_name="empty_cache"))
        return refs
    partner = scored.partners.get(id(group))
    if partner is not None:  # colocated with a streamed group: after it, as stock serialises
        ray.get(scored.refs[id(partner)])
        ray.get(partner.async_run_method(method_name="empty_cache"))
    return stock(self, group, sync_condition, **kwargs)


def fusion_trainer_init(self: Any, *args: Any, **kwargs: Any) -> None:
    plugin_state.stock("stream_scoring", "__init__")(self, *args, **kwargs)
    link_scoring(self)
