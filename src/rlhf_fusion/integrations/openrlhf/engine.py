"""Engine side of streaming and migration: methods added to OpenRLHF's ``RolloutRayActor``.

The driver hands an engine its samples in batches (``fusion_submit``: one Ray call per engine
per wave, the tokenizer sent once per engine by ``fusion_set_tokenizer``) and collects finished
ones in batches (``fusion_poll``: one outstanding call per engine, so the driver waits on as
many refs as there are engines, not samples). Each sample runs OpenRLHF's own agent executor (so
tokenisation, truncation and rewards stay stock); the executor's ``llm_engine.generate`` call is
the one this class overrides, to record progress and to stop at an export with a snapshot of the
tokens generated so far. A resumed sample (``resume=``) runs the executor again and its
``generate`` submits prompt + generated ids with the remaining token budget: the tokens
mechanism.

vLLM's abort semantics (since vLLM PR #22283, so 0.29 and later): ``AsyncLLM.abort`` makes the
request's stream yield one last output with ``finished=True`` and ``finish_reason == "abort"``.
That output is never a finished sample: for an export it becomes the snapshot (every token and
logprob so far), any other abort is an error. A sample that finished before the abort landed
(its last output says "stop" or "length") is returned as finished, once.
"""

from __future__ import annotations

import asyncio
import contextvars
import traceback
from copy import deepcopy
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ...errors import RLHFFusionError
from ...rollout.sampling import derive_seed

__all__ = ["FusionRolloutMixin", "make_fusion_rollout_actor"]

_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("rlhf_fusion_sample", default=None)


class _Migrated(RLHFFusionError):  # noqa: N818 - control flow, not an error
    def __init__(self, snapshot: dict[str, Any]) -> None:
        super().__init__("exported for migration")
        self.snapshot = snapshot


@dataclass
class _Live:
    key: int
    prefix_ids: list[int]
    prefix_lps: list[float] | None
    request_id: str | None = None
    prompt_len: int = 0
    max_tokens: int = 0
    new_ids: list[int] = field(default_factory=list)
    new_lps: list[float] | None = None
    export: bool = False  # the coordinator asked for this sample


@dataclass
class _Run:
    """One driver call's samples on this engine: results wait here until polled."""

    live: dict[int, _Live] = field(default_factory=dict)
    done: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[Any] = field(default_factory=set)


def _lp_dicts(ids: list[int], lps: list[float] | None) -> list[dict[int, Any]] | None:
    if lps is None:
        return None
    return [{t: SimpleNamespace(logprob=x)} for t, x in zip(ids, lps)]


class FusionRolloutMixin:
    """Mixed in front of OpenRLHF's ``RolloutRayActor`` (needs its ``llm``, ``executor`` and
    ``_mm_pad_token_ids``)."""

    llm: Any
    executor: Any

    def _fusion_runs(self) -> dict[str, _Run]:
        if not hasattr(self, "_fusion_run_table"):
            self._fusion_run_table: dict[str, _Run] = {}
        return self._fusion_run_table

    def _fusion_live(self, run: str) -> dict[int, _Live]:
        got = self._fusion_runs().get(run)
        return {} if got is None else got.live

    def fusion_can_migrate(self) -> bool:
        # A multi-turn agent would redo its earlier turns when resumed: stream it, never move it.
        from openrlhf.utils.agent import SingleTurnAgentExecutor

        return isinstance(self.executor, SingleTurnAgentExecutor)

    def fusion_set_tokenizer(self, tokenizer: Any) -> None:
        """The driver's tokenizer, sent once per engine (not with every sample)."""
        self._fusion_tokenizer = tokenizer

    def fusion_has_tokenizer(self) -> bool:
        return getattr(self, "_fusion_tokenizer", None) is not None

    async def fusion_submit(self, run: str, samples: list[tuple[Any, ...]], sampling_params: Any,
                            max_length: int) -> None:
        """Start these samples, each ``(key, prompt, label, images, resume)``; their results are
        collected by ``fusion_poll(run)``."""
        tokenizer = getattr(self, "_fusion_tokenizer", None)
        if tokenizer is None:
            raise RuntimeError("rlhf_fusion: fusion_submit before fusion_set_tokenizer")
        state = self._fusion_runs().setdefault(run, _Run())
        for key, prompt, label, images, resume in samples:
            task = asyncio.ensure_future(self._fusion_one(
                state, int(key), prompt, label, sampling_params, max_length, tokenizer, images,
                resume))
            state.tasks.add(task)
            task.add_done_callback(state.tasks.discard)

    async def _fusion_one(self, state: _Run, key: int, prompt: str, label: Any,
                          sampling_params: Any, max_length: int, tokenizer: Any, images: Any,
                          resume: dict[str, Any] | None) -> None:
        try:
            out = await self.fusion_generate_sample(
                key, prompt, label, sampling_params, max_length, tokenizer, images, resume,
                live_table=state.live)
        except Exception:  # reported to the driver, which raises it with the engine's trace
            out = {"fusion_error": traceback.format_exc()}
        state.done.append((key, out))
        state.ready.set()

    async def fusion_poll(self, run: str) -> list[tuple[int, dict[str, Any]]]:
        """Every result of ``run`` finished since the last poll; waits for at least one."""
        state = self._fusion_runs().setdefault(run, _Run())
        while not state.done:
            state.ready.clear()
            await state.ready.wait()
        got, state.done = state.done, []
        if not state.live and all(t.done() for t in state.tasks):  # the run's last results
            self._fusion_runs().pop(run, None)
        return got

    async def fusion_generate_sample(self, key: int, prompt: str, label: Any, sampling_params: Any,
                                     max_length: int, hf_tokenizer: Any, images: Any = None,
                                     resume: dict[str, Any] | None = None,
                                     live_table: dict[int, _Live] | None = None
                                     ) -> dict[str, Any]:
        """One sample through the stock executor; returns its response dict, or
        ``{"fusion_migrated": snapshot}`` when ``fusion_export`` took it away."""
        live = _Live(key=key, prefix_ids=list(resume["ids"]) if resume else [],
                     prefix_lps=(list(resume["lps"]) if resume and resume["lps"] is not None
                                 else None))
        table = {} if live_table is None else live_table
        table[key] = live
        token = _CURRENT.set((live, hf_tokenizer))
        try:
            return await self.executor.execute(
                prompt=prompt, label=label, sampling_params=sampling_params,
                max_length=max_length, hf_tokenizer=hf_tokenizer, llm_engine=self, images=images)
        except _Migrated as moved:
            return {"fusion_migrated": moved.snapshot}
        finally:
            _CURRENT.reset(token)
            table.pop(key, None)

    async def generate(self, prompt_token_ids: Any, sampling_params: Any,
                       multi_modal_data: Any = None) -> Any:
        current = _CURRENT.get()
        if current is None:  # a stock call (generate_responses, eval): untouched
            return await super().generate(prompt_token_ids, sampling_params,  # type: ignore[misc]
                                          multi_modal_data)
        live, tokenizer = current
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        prompt_token_ids = list(prompt_token_ids)
        pad_ids = getattr(self, "_mm_pad_token_ids", None)
        if multi_modal_data and pad_ids:
            # as stock generate: collapse pre-expanded image/video pad tokens, so vLLM's
            # multimodal processor expands them exactly once
            from openrlhf.utils.vlm_utils import dedup_media_tokens

            prompt_token_ids = list(dedup_media_tokens(prompt_token_ids, pad_ids))
        params = deepcopy(sampling_params)
        done = len(live.prefix_ids)
        live.prompt_len = len(prompt_token_ids)
        live.max_tokens = int(params.max_tokens)
        if done:
            params.max_tokens = int(params.max_tokens) - done
            if getattr(params, "min_tokens", None):
                params.min_tokens = max(0, int(params.min_tokens) - done)
            if getattr(params, "seed", None) is not None:
                # a migration point continues one fixed way (as VLLMBackend's tokens path)
                params.seed = derive_seed(int(params.seed), live.key, done)
        if live.export or params.max_tokens < 1:
            raise _Migrated(self._snapshot(live))
        prompt = TokensPrompt(prompt_token_ids=prompt_token_ids + live.prefix_ids)
        if multi_modal_data:
            prompt["multi_modal_data"] = multi_modal_data
        live.request_id = random_uuid()
        final = None
        async for out in self.llm.generate(prompt, params, request_id=live.request_id):
            final = out
            comp = out.outputs[0]
            # cumulative outputs: the abort output, too, carries every token so far
            live.new_ids = list(comp.token_ids)
            if comp.logprobs is not None:
                live.new_lps = [float(d[t].logprob) for d, t in zip(comp.logprobs, comp.token_ids)]
            if out.finished:
                break
        reason = None if final is None else final.outputs[0].finish_reason
        if final is None or not final.finished or reason == "abort":
            if live.export:
                raise _Migrated(self._snapshot(live))
            raise RuntimeError(f"rlhf_fusion: request {live.request_id} ended "
                               f"{'aborted' if reason == 'abort' else 'unfinished'} without an "
                               "export (aborted by someone else?)")
        # finished ("stop"/"length") before any export landed: a whole sample, returned once
        if not done:
            return final
        comp = final.outputs[0]
        ids = live.prefix_ids + list(comp.token_ids)
        lps = (None if comp.logprobs is None or live.prefix_lps is None
               else _lp_dicts(live.prefix_ids, live.prefix_lps) + list(comp.logprobs))
        text = tokenizer.decode(ids, skip_special_tokens=getattr(
            sampling_params, "skip_special_tokens", False))
        return SimpleNamespace(request_id=final.request_id, finished=True, prompt_token_ids=(
            prompt_token_ids), outputs=[SimpleNamespace(
                index=0, token_ids=ids, text=text, logprobs=lps,
                finish_reason=comp.finish_reason, cumulative_logprob=None)])

    @staticmethod
    def _snapshot(live: _Live) -> dict[str, Any]:
        lps = None if live.prefix_lps is None and not live.new_lps else (
            (live.prefix_lps or []) + (live.new_lps or []))
        return {"ids": live.prefix_ids + live.new_ids, "lps": lps}

    def fusion_progress(self, run: str) -> list[tuple[int, int, int, int]]:
        """(key, prompt tokens, generated tokens, token budget) of every sample of ``run``
        decoding here."""
        return [(k, v.prompt_len, len(v.prefix_ids) + len(v.new_ids), v.max_tokens)
                for k, v in sorted(self._fusion_live(run).items()) if not v.export]

    async def fusion_export(self, run: str, keys: list[int]) -> list[int]:
        """Abort these samples; each one's result is a snapshot unless it finished first.
        Returns the keys asked of a sample still here."""
        if not self.fusion_can_migrate():
            return []
        asked = []
        table = self._fusion_live(run)
        for key in keys:
            live = table.get(int(key))
            if live is None or live.export:
                continue
            live.export = True
            asked.append(int(key))
            if live.request_id is not None:
                await self.llm.abort(live.request_id)
        return asked


def make_fusion_rollout_actor(stock_actor_class: Any) -> Any:
    """A Ray actor class: OpenRLHF's ``RolloutRayActor`` with the fusion methods in front."""
    import ray

    modified = stock_actor_class.__ray_metadata__.modified_class
    base = getattr(modified, "__ray_actor_class__", modified)  # the class as OpenRLHF wrote it
    cls = type("FusionRolloutRayActor", (FusionRolloutMixin, base), {
        "__module__": __name__, "__doc__": base.__doc__})
    return ray.remote(cls)
