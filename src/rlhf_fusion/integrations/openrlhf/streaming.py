"""Driver side of streaming and migration: ``SamplesGenerator._generate_vllm`` replaced.

Stock OpenRLHF sends each prompt to one engine (``generate_responses``, all its samples) and
collects whole prompts. Here each sample is one request (``fusion_generate_sample``), collected
the moment it finishes; a prompt's experiences are built, in sample order, with the stock
``_process_response_into_experience`` once its last sample is in (dynamic filtering is per
prompt, as stock). With migration on, once at most R_t samples of the batch still decode, the
long tail is consolidated on the m engines that hold most of it (``rollout.planning``): the
others abort their samples and the coordinator resubmits each, prompt plus generated ids with
the remaining budget, to its destination. Every sample is collected exactly once. With
``--fusion.stream_scoring`` each accepted prompt also goes to a ``scoring.StreamScorer``, which
dispatches the model forwards of full micro-batches while the rest still decodes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from ...rollout.planning import MovingSample, assign_migration, required_instances
from ...rollout.types import RolloutError
from .options import FusionOptions

__all__ = ["AUTO_RT_FRACTION", "StreamStats", "fusion_generate_vllm"]

# rt="auto": a quarter of the batch, the R_t the TRL integration starts from before it has seen
# lengths (OpenRLHF's engines report no decode timings to refine it with).
AUTO_RT_FRACTION = 0.25
# vLLM's default max_num_seqs: the batch slots of one engine (BS_max of the planner).
ENGINE_BS_MAX = 256
WAIT_S = 600.0  # no sample for this long: an engine is stuck


@dataclass
class StreamStats:
    """What the last batch did; kept on the generator as ``_fusion_stats``."""

    samples: int = 0
    requests: int = 0
    migrated: list[int] = field(default_factory=list)  # keys resubmitted elsewhere
    engines: dict[int, int] = field(default_factory=dict)  # key -> engine that finished it


def _sampling_params(self: Any, generate_kwargs: dict[str, Any]) -> Any:
    # The stock _dispatch_prompts_to_vllm's parameters, field for field.
    from vllm import SamplingParams

    return SamplingParams(
        temperature=generate_kwargs.get("temperature", 1.0),
        top_p=generate_kwargs.get("top_p", 1.0),
        top_k=generate_kwargs.get("top_k", -1),
        max_tokens=generate_kwargs.get("max_new_tokens"),
        min_tokens=generate_kwargs.get("min_new_tokens", 1),
        skip_special_tokens=generate_kwargs.get("skip_special_tokens", False),
        logprobs=1 if self.args.algo.advantage.is_correction_level != "off" else None,
    )


def _options() -> FusionOptions:
    from . import plugins

    return plugins.current_options() or FusionOptions(stream=True)


def fusion_generate_vllm(self: Any, dataloader_iter: Any, num_prompts: int,
                         dynamic_filtering: Any, **generate_kwargs: Any
                         ) -> tuple[list[Any], int, bool]:
    """Drop-in for ``SamplesGenerator._generate_vllm`` (same arguments and return)."""
    import ray
    from openrlhf.trainer.ppo_utils.samples_generator import _collect_prompt_batch

    opts = _options()
    engines = list(self.vllm_engines)
    prompts_consumed = 0
    accepted: list[Any] = []
    prompts, labels, images, exhausted = _collect_prompt_batch(dataloader_iter, num_prompts)
    if not prompts:
        return [], prompts_consumed, True
    if not engines:
        raise RolloutError("--fusion.stream needs vLLM engines (--vllm.num_engines >= 1)")

    params = _sampling_params(self, generate_kwargs)
    max_length = generate_kwargs.get("max_len", 2048)
    n = generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt)
    stats = StreamStats()
    self._fusion_stats = stats
    scorer = _scorer(self, dataloader_iter, num_prompts) if opts.stream_scoring else None

    groups: dict[int, dict[str, Any]] = {}  # prompt index -> prompt, label, image, responses
    owner: dict[int, int] = {}  # key -> prompt index
    route: dict[int, int] = {}  # key -> engine to resubmit to after its export
    pending: dict[Any, tuple[int, int]] = {}  # ref -> (key, engine)
    load = [0] * len(engines)
    next_key = 0

    def submit(key: int, engine: int, resume: dict[str, Any] | None = None) -> None:
        g = groups[owner[key]]
        ref = engines[engine].fusion_generate_sample.remote(
            key, g["prompt"], g["label"], params, max_length, self.tokenizer, g["image"],
            resume)
        pending[ref] = (key, engine)
        load[engine] += 1
        stats.requests += 1

    def add_prompts(ps: list[Any], ls: list[Any], ims: list[Any]) -> None:
        nonlocal next_key
        heap = [(c, i) for i, c in enumerate(load)]
        heapq.heapify(heap)
        for p, lab, im in zip(ps, ls, ims or [None] * len(ps)):
            idx = len(groups)
            groups[idx] = {"prompt": p, "label": lab, "image": im, "responses": {}}
            for _ in range(n):
                c, e = heapq.heappop(heap)  # least loaded engine, as stock balances prompts
                owner[next_key] = idx
                submit(next_key, e)
                heapq.heappush(heap, (c + 1, e))
                next_key += 1
            stats.samples += n

    add_prompts(prompts, labels, images)
    prompts_consumed += len(prompts)
    migrated_once = not opts.migrate or len(engines) < 2
    frac = AUTO_RT_FRACTION if opts.rt == "auto" else float(opts.rt or 0)

    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1,
                            timeout=0.05 if not migrated_once else WAIT_S)
        if not ready and migrated_once:
            raise RolloutError(f"no sample finished in {WAIT_S:.0f} s; a vLLM engine is stuck")
        for ref in ready:
            key, engine = pending.pop(ref)
            load[engine] -= 1
            out = ray.get(ref)
            if "fusion_migrated" in out:
                stats.migrated.append(key)
                submit(key, route.pop(key), resume=out["fusion_migrated"])
                continue
            route.pop(key, None)  # an export that arrived after it finished
            g = groups[owner[key]]
            if key in g["responses"]:
                raise RolloutError(f"sample {key} was collected twice (engine {engine})")
            g["responses"][key] = out
            stats.engines[key] = engine
            if len(g["responses"]) < n:
                continue
            experiences = [self._process_response_into_experience(g["responses"][k],
                                                                  **generate_kwargs)
                           for k in sorted(g["responses"])]
            if dynamic_filtering and all(e.scores is not None for e in experiences):
                scores = [e.scores[0].item() for e in experiences]
                lo, hi = self.args.algo.dynamic_filtering_range
                if not (lo < sum(scores) / len(scores) < hi):
                    experiences = []
            if experiences:
                accepted.extend(experiences)
                if scorer is not None:  # their forwards start now, while the rest decodes
                    scorer.add(experiences, live=len(pending))
            elif dynamic_filtering:  # a replacement prompt, as stock
                ps, ls, ims, exhausted = _collect_prompt_batch(dataloader_iter, 1)
                prompts_consumed += len(ps)
                if ps:
                    add_prompts(ps, ls, ims)
        if not migrated_once:
            live = len(pending)
            if 0 < live <= max(1, math.floor(frac * stats.samples)):
                migrated_once = True
                _migrate(engines, live, route)
    if scorer is not None:
        self._fusion_link.pending = scorer.finish()
        self._fusion_scoring_stats = scorer.stats
    return accepted, prompts_consumed, exhausted


def _scorer(self: Any, dataloader_iter: Any, num_prompts: int) -> Any:
    """A StreamScorer when this call makes exactly the next training batch of a trainer whose
    topology streams scoring (``scoring.link_scoring``); None: OpenRLHF scores it stock."""
    link = getattr(self, "_fusion_link", None)
    if link is None or link.reason is not None:
        return None
    link.pending = None
    if dataloader_iter is not getattr(self, "_dataloader_iter", None):
        return None  # evaluation (generate_eval_samples): never scored
    if getattr(self, "_sample_buffer", None) or num_prompts != self.args.rollout.batch_size:
        return None  # the batch would not be exactly what this call returns
    from .scoring import StreamScorer

    return StreamScorer(link)


def _migrate(engines: list[Any], live: int, route: dict[int, int]) -> None:
    """Consolidate the tail on m engines; records each exported key's destination in route."""
    import ray

    if not all(ray.get([e.fusion_can_migrate.remote() for e in engines], timeout=60)):
        return
    reports = ray.get([e.fusion_progress.remote() for e in engines], timeout=60)
    unfinished = {i: [MovingSample(sample_id=k, kv_tokens=p + max(g - 1, 0), reserved_tokens=p + b)
                      for k, p, g, b in rep] for i, rep in enumerate(reports)}
    m = required_instances(live, ENGINE_BS_MAX, 0.0, None)
    plan = assign_migration(unfinished, m)
    asks = []
    for src, by_dst in plan.moves.items():
        keys = []
        for dst, ids in by_dst.items():
            for k in ids:
                route[k] = dst
            keys.extend(ids)
        asks.append(engines[src].fusion_export.remote(keys))
    asked = {k for got in ray.get(asks, timeout=60) for k in got}
    for k in [k for k in route if k not in asked]:
        del route[k]  # finished before the export reached it: collected where it ran
