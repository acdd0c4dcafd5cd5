"""Driver side of streaming and migration: ``SamplesGenerator._generate_vllm`` replaced.

Stock OpenRLHF sends each prompt to one engine (``generate_responses``, all its samples) and
collects whole prompts. Here prompts go to engines as stock balances them (all of a prompt's
samples on one engine, for its prefix cache), but each sample is its own request, collected the
moment it finishes (``engine.py``: one ``fusion_submit`` per engine per wave, one
``fusion_poll`` in flight per busy engine, so the driver waits on as many refs as there are
engines, and the tokenizer goes to each engine once); a prompt's experiences are built, in sample order, with the stock
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
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ...rollout.planning import MovingSample, assign_migration, required_instances
from ...rollout.types import RolloutError
from . import plugin_state
from .options import FusionOptions

__all__ = ["AUTO_RT_FRACTION", "StreamStats", "fusion_generate_vllm"]

# rt="auto": a quarter of the batch, the R_t the TRL integration starts from before it has seen
# lengths (OpenRLHF's engines report no decode timings to refine it with).
AUTO_RT_FRACTION = 0.25
# vLLM's default max_num_seqs: the batch slots of one engine (BS_max of the planner).
ENGINE_BS_MAX = 256
# While nothing finishes, the driver asks its busy engines whether they are alive this often, so
# a dead engine, or one Ray never scheduled, is an error naming it instead of a wait without end.
LIVENESS_EVERY_S = 10.0
# How long an engine may take to answer that question (its event loop answers between tokens).
LIVENESS_ANSWER_S = 60.0


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
    return plugin_state.current_options() or FusionOptions(stream=True)


def _send_tokenizer(self: Any, engines: list[Any]) -> None:
    """The tokenizer to every engine that lacks it, once for the generator's life (a Qwen-sized
    tokenizer takes ~0.3 s to serialise; stock sends it with every prompt)."""
    import ray

    sent: list[Any] = self.__dict__.setdefault("_fusion_tokenizer_sent", [])
    todo = [e for e in engines if not any(e is s for s in sent)]
    if todo:
        ref = ray.put(self.tokenizer)
        ray.get([e.fusion_set_tokenizer.remote(ref) for e in todo])
        sent.extend(todo)


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
    _send_tokenizer(self, engines)
    run = uuid.uuid4().hex  # this call's samples on the engines (keys restart at 0 per call)

    groups: dict[int, dict[str, Any]] = {}  # prompt index -> prompt, label, image, responses
    owner: dict[int, int] = {}  # key -> prompt index
    route: dict[int, int] = {}  # key -> engine to resubmit to after its export
    outstanding = [0] * len(engines)  # samples submitted to each engine, not yet returned
    polls: dict[Any, int] = {}  # the one fusion_poll in flight per busy engine -> engine
    submits: set[Any] = set()  # fusion_submit calls not yet seen to return (errors surface)
    next_key = 0

    def submit(by_engine: dict[int, list[tuple[int, dict[str, Any] | None]]]) -> None:
        for engine, items in by_engine.items():
            batch = []
            for key, resume in items:
                g = groups[owner[key]]
                batch.append((key, g["prompt"], g["label"], g["image"], resume))
            # one call per engine per wave
            submits.add(engines[engine].fusion_submit.remote(run, batch, params, max_length))
            outstanding[engine] += len(items)
            stats.requests += len(items)

    def ensure_polls() -> None:
        # Only here, once every result in hand is counted: a poll issued while a batch of
        # results was half counted could land on an engine left with nothing to return, and
        # would then wait for ever (the hang of the dynamic-filtering run: a filtered prompt's
        # replacement was submitted in the middle of its engine's last batch).
        for engine in range(len(engines)):
            if outstanding[engine] and engine not in polls.values():
                polls[engines[engine].fusion_poll.remote(run)] = engine
        idle = [e for e in polls.values() if not outstanding[e]]
        if idle:
            raise RolloutError(f"rlhf_fusion internal error: a poll is waiting on engine(s) "
                               f"{idle} with no sample outstanding there; please report it")

    def add_prompts(ps: list[Any], ls: list[Any], ims: list[Any]) -> None:
        nonlocal next_key
        # stock's balancing: each prompt, all its samples, to the engine with the fewest
        # unfinished requests (one prompt's samples share an engine: prefix-cache locality)
        counts = ray.get([e.get_num_unfinished_requests.remote() for e in engines])
        heap = [(c, i) for i, c in enumerate(counts)]
        heapq.heapify(heap)
        wave: dict[int, list[tuple[int, dict[str, Any] | None]]] = {}
        for p, lab, im in zip(ps, ls, ims or [None] * len(ps)):
            idx = len(groups)
            groups[idx] = {"prompt": p, "label": lab, "image": im, "responses": {}}
            c, e = heapq.heappop(heap)
            for _ in range(n):
                owner[next_key] = idx
                wave.setdefault(e, []).append((next_key, None))
                next_key += 1
            heapq.heappush(heap, (c + n, e))
            stats.samples += n
        submit(wave)

    add_prompts(prompts, labels, images)
    prompts_consumed += len(prompts)
    ensure_polls()
    migrated_once = not opts.migrate or len(engines) < 2
    frac = AUTO_RT_FRACTION if opts.rt == "auto" else float(opts.rt or 0)

    while polls:
        ready = _wait_for_any(engines, polls, submits, outstanding, opts.wait_s)
        moved: dict[int, list[tuple[int, dict[str, Any] | None]]] = {}
        for ref in ready:
            if ref in submits:
                submits.discard(ref)
                ray.get(ref)  # raises an engine's error in starting its samples
                continue
            engine = polls.pop(ref)
            results = ray.get(ref)
            outstanding[engine] -= len(results)  # the whole batch, before anything is submitted
            for key, out in results:
                if "fusion_error" in out:
                    raise RolloutError(f"vLLM engine {engine} failed on sample {key}:\n"
                                       f"{out['fusion_error']}")
                if "fusion_migrated" in out:
                    stats.migrated.append(key)
                    moved.setdefault(route.pop(key), []).append((key, out["fusion_migrated"]))
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
                        scorer.add(experiences, live=sum(outstanding))
                elif dynamic_filtering:  # a replacement prompt, as stock
                    ps, ls, ims, exhausted = _collect_prompt_batch(dataloader_iter, 1)
                    prompts_consumed += len(ps)
                    if ps:
                        add_prompts(ps, ls, ims)
        submit(moved)
        if not migrated_once:
            live = sum(outstanding)
            if 0 < live <= max(1, math.floor(frac * stats.samples)):
                migrated_once = True
                _migrate(engines, run, live, route)
        ensure_polls()
    if scorer is not None:
        self._fusion_link.pending = scorer.finish()
        self._fusion_scoring_stats = scorer.stats
    return accepted, prompts_consumed, exhausted


def _wait_for_any(engines: list[Any], polls: dict[Any, int], submits: set[Any],
                  outstanding: list[int], wait_s: float | None) -> list[Any]:
    """The next finished poll or submit. While none finishes, the busy engines are asked every
    ``LIVENESS_EVERY_S`` whether they are alive (a RolloutError names a dead or unanswering
    one), and with ``--fusion.wait_s`` set, nothing finishing for that long is an error too."""
    import ray

    start = time.monotonic()
    deadline = math.inf if wait_s is None else start + wait_s
    next_check = start + LIVENESS_EVERY_S
    while True:
        timeout = max(0.0, min(deadline, next_check) - time.monotonic())
        ready, _ = ray.wait([*polls, *submits], num_returns=1, timeout=timeout)
        if ready:
            return ready
        now = time.monotonic()
        if now >= deadline:
            raise RolloutError(
                f"no sample finished in {wait_s:g} s (--fusion.wait_s) with "
                f"{sum(outstanding)} still decoding; a vLLM engine is stuck, or raise the bound")
        if now >= next_check:
            _check_engines_alive(engines, sorted(set(polls.values())), outstanding)
            next_check = time.monotonic() + LIVENESS_EVERY_S


def _check_engines_alive(engines: list[Any], busy: list[int], outstanding: list[int]) -> None:
    import ray

    probes = {i: engines[i].__ray_ready__.remote() for i in busy}
    until = time.monotonic() + LIVENESS_ANSWER_S
    for i, probe in probes.items():
        try:
            ray.get(probe, timeout=max(0.0, until - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise RolloutError(
                f"vLLM engine {i} ({outstanding[i]} samples outstanding there) did not answer "
                f"in {LIVENESS_ANSWER_S:g} s: Ray has not scheduled it (no free resources: see "
                "`ray status`) or its process is stuck") from None
        except ray.exceptions.RayError as exc:
            raise RolloutError(f"vLLM engine {i} died with {outstanding[i]} samples "
                               f"outstanding there: {exc}") from exc


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


def _migrate(engines: list[Any], run: str, live: int, route: dict[int, int]) -> None:
    """Consolidate the tail on m engines; records each exported key's destination in route."""
    import ray

    if not all(ray.get([e.fusion_can_migrate.remote() for e in engines], timeout=60)):
        return
    reports = ray.get([e.fusion_progress.remote(run) for e in engines], timeout=60)
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
        asks.append(engines[src].fusion_export.remote(run, keys))
    asked = {k for got in ray.get(asks, timeout=60) for k in got}
    for k in [k for k in route if k not in asked]:
        del route[k]  # finished before the export reached it: collected where it ran


def fusion_metrics(generator: Any) -> dict[str, float]:
    """The plugins' counters for the batch the generator made last (each reported once): what
    OpenRLHF's ``train_step`` status carries to its logger, wandb and tensorboard."""
    out: dict[str, float] = {}
    stats = generator.__dict__.pop("_fusion_stats", None) if generator is not None else None
    if stats is not None:
        out["fusion/samples"] = stats.samples
        out["fusion/requests"] = stats.requests
        out["fusion/migrated_samples"] = len(stats.migrated)
    scoring = (generator.__dict__.pop("_fusion_scoring_stats", None)
               if generator is not None else None)
    if scoring is not None:
        out["fusion/scoring_micro_batches"] = scoring.micro_batches
        out["fusion/scoring_waves"] = sum(scoring.waves.values())
        if scoring.first_dispatch_at is not None and scoring.finished_at is not None:
            # how long before the last sample the first forwards went out: the overlap
            out["fusion/scoring_lead_s"] = scoring.finished_at - scoring.first_dispatch_at
    return out


def fusion_train_step(self: Any, rollout_samples: Any, global_step: int) -> Any:
    """Stock ``BasePPOTrainer.train_step``, its status with the plugins' counters added."""
    status, step = plugin_state.stock("stream", "train_step")(self, rollout_samples, global_step)
    status.update(fusion_metrics(getattr(self, "samples_generator", None)))
    return status, step
