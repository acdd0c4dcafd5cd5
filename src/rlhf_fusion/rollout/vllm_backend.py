"""GenerationBackend on vLLM's async engine (extra ``vllm``; imported only when used).

One sample is one vLLM request, consumed by its own ``async for`` over ``engine.generate`` on a
private event loop thread, so ``step`` returns each sample the moment vLLM marks it finished.

Aborts follow vLLM (>= 0.10.2): ``engine.abort(id)`` makes the request's stream yield a last
output with ``finished=True`` and ``finish_reason == "abort"`` carrying the tokens so far. Such
an output is never a finished sample: ``export_samples`` turns it into a migration ticket with
every token and logprob generated so far, ``abort`` drops it. Only ``"stop"``/``"length"`` are
finishes; a sample that truly finished before the abort landed is emitted once, here.

Migration is the recompute path: ``export_samples(mode="tokens")`` aborts the request and
snapshots the tokens and logprobs streamed so far; ``import_samples`` resubmits prompt +
generated ids with the remaining token budget. vLLM seeds a request's generator once; our worker
extension (:meth:`WorkerExtension.rlhf_fusion_seed_by_position`, installed on engines this
backend builds) reseeds it before every draw from (seed, sample, response position), so the
token at a position does not depend on where the sample ran or whether it moved
(``capabilities.exact_migration``). KV transfer needs an engine with a KV connector; it is behind
``kv_transfer`` and off by default.

Sleep mode is a platform capability (``vllm.platforms.current_platform``): where it is missing
(vLLM on CPU) the engine is built without it, keeps its KV pool while training runs, and says
so once.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import types as rollout_types
from .sampling import derive_seed
from .types import (
    CapabilityError,
    MigrationTicket,
    RolloutError,
    SampleProgress,
    SampleResult,
    SampleSpec,
)

_INSTALL_HINT = 'the vLLM backend needs vLLM: pip install "rlhf-fusion[vllm]"'

log = logging.getLogger(__name__)

# SamplingParams.extra_args key read by the worker extension: (seed, sample id, tokens generated
# before this request), so the draw at response position p is keyed on (seed, sample, p).
POSITION_KEY = "rlhf_fusion_position_key"


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return vllm


def sleep_mode_available(vllm: Any) -> bool:
    """Whether vLLM's platform (CUDA, ROCm, XPU; not CPU) supports sleep mode."""
    platforms = getattr(vllm, "platforms", None)
    if platforms is None:
        platforms = importlib.import_module(f"{vllm.__name__}.platforms")
    return bool(platforms.current_platform.is_sleep_mode_available())


def _engine_sleeps(engine: Any) -> bool:
    """Whether ``engine`` was built with sleep mode (so ``sleep`` frees its memory)."""
    cfg = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    return bool(getattr(cfg, "enable_sleep_mode", False))


def _allow_engine_children() -> None:
    # vLLM starts its engine core as a child process; a rank started as a daemonic process
    # (rlhf_fusion.launch) may not have children. The engine core watches its parent and exits
    # with it, which is what the daemon flag was for.
    proc = multiprocessing.current_process()
    if proc.daemon:
        proc.daemon = False


def pack_weights(named: Iterable[tuple[str, Any]]) -> bytes:
    """Named tensors as one ``torch.save`` payload: ``collective_rpc`` arguments cross to the
    engine process through msgpack, which turns tensors nested in lists into plain lists."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save([(str(n), t.detach().cpu()) for n, t in named], buf)
    return buf.getvalue()


def unpack_weights(payload: bytes) -> list[tuple[str, Any]]:
    import io

    import torch

    return [tuple(x) for x in torch.load(io.BytesIO(payload), weights_only=True)]


class WorkerExtension:
    """Mixed into vLLM workers (``worker_extension_cls``); reached by ``collective_rpc``."""

    def rlhf_fusion_load_weights(self, payload: bytes) -> None:
        """Load :func:`pack_weights`' payload by Hugging Face parameter names."""
        weights = unpack_weights(payload)
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            # vLLM's in-place reload undoes and redoes the post-load processing (the CPU
            # backend repacks linear weights, which drops their loaders).
            reload(weights_iterator=iter(weights))
        else:
            self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]

    def rlhf_fusion_seed_by_position(self) -> bool:
        """Reseed every keyed request's generator before each sampling step from (seed, sample,
        response position), so a migrated sample draws the tokens it would have drawn unmoved.

        vLLM seeds a request's ``torch.Generator`` once and draws from it every step; whatever
        the sampler draws from it (CPU: one seed for the fused Gumbel-argmax kernel; CUDA:
        exponential noise) is then a function of the key alone. Requests without the key keep
        vLLM's behaviour.
        """
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        sampler = runner.sampler
        if getattr(sampler, "_rlhf_fusion_seeded", False):
            return True
        inner = sampler.forward

        def forward(logits: Any, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            gens = sampling_metadata.generators
            if gens:
                _reseed(runner, gens)
            return inner(logits, sampling_metadata, *args, **kwargs)

        sampler.forward = forward
        sampler._rlhf_fusion_seeded = True
        return True


def _reseed(runner: Any, generators: Mapping[int, Any]) -> None:
    req_ids = runner.input_batch.req_ids
    for i, gen in generators.items():
        if i >= len(req_ids) or req_ids[i] is None:
            continue  # a warm-up batch
        state = runner.requests.get(req_ids[i])
        params = getattr(state, "sampling_params", None)
        key = (getattr(params, "extra_args", None) or {}).get(POSITION_KEY)
        if key is not None:
            seed, sid, offset = key
            gen.manual_seed(derive_seed(seed, sid, offset + len(state.output_token_ids)))


@dataclass
class _Req:
    spec: SampleSpec
    request_id: str
    prefix_ids: list[int]
    prefix_lps: list[float]
    new_ids: list[int] = field(default_factory=list)
    new_lps: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop"/"length": a true finish, never "abort"
    stopping: bool = False  # we asked vLLM to abort it (abort or export)
    removed: bool = False  # aborted or exported: must never be emitted here
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class VLLMBackend:
    """Streams samples from a vLLM ``AsyncLLMEngine``/``AsyncLLM`` (or anything that quacks so).

    ``engine`` is an already built async engine; otherwise one is built from ``model`` and
    ``engine_kwargs`` (with ``enable_sleep_mode`` where the platform has it, and our
    :class:`WorkerExtension` with position seeding). ``sampling_params_cls`` defaults to
    ``vllm.SamplingParams``.
    """

    def __init__(
        self,
        engine: Any = None,
        *,
        model: str | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        instance_id: int = 0,
        sampling_params_cls: Any = None,
        kv_transfer: bool = False,
        max_batch_size: int = 256,
        poll_s: float = 0.002,
    ) -> None:
        if engine is None:
            if model is None:
                raise rollout_types.RolloutConfigError("VLLMBackend needs an engine or a model name/path")
            vllm = _import_vllm()
            can_sleep = sleep_mode_available(vllm)
            kwargs = {"worker_extension_cls": f"{__name__}.WorkerExtension",
                      "enable_sleep_mode": can_sleep, **dict(engine_kwargs or {})}
            if kwargs["enable_sleep_mode"] and not can_sleep:
                raise rollout_types.RolloutConfigError(
                    "enable_sleep_mode=True, but vLLM has no sleep mode on this platform "
                    "(vllm.platforms.current_platform.is_sleep_mode_available() is False, as "
                    "on CPU); drop it from the engine kwargs: the backend then keeps the KV "
                    "pool between rollouts")
            _allow_engine_children()
            engine = vllm.AsyncLLMEngine.from_engine_args(
                vllm.AsyncEngineArgs(model=model, **kwargs))
            self._owns_engine = True
        else:
            self._owns_engine = False
        if sampling_params_cls is None:
            sampling_params_cls = _import_vllm().SamplingParams
        self.engine = engine
        self.instance_id = instance_id
        self.max_batch_size = max_batch_size
        self._params_cls = sampling_params_cls
        self._poll_s = poll_s
        self._sleeps = _engine_sleeps(engine)
        self._asleep = False
        self._reqs: dict[int, _Req] = {}
        self._lock = threading.Lock()
        self._ready: dict[int, SampleResult] = {}
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"vllm-backend-{instance_id}")
        self._thread.start()
        self.position_seeded = self._seed_by_position()
        self.capabilities = rollout_types.BackendCapabilities(
            kv_export=kv_transfer, kv_import=kv_transfer, streaming=True,
            exact_migration=self.position_seeded)
        if not self._sleeps:
            log.info("vLLM instance %d: the engine has no sleep mode (vLLM has none on this "
                     "platform, or it was built without it), so sleep() keeps its KV cache pool "
                     "and weights in memory while training runs", instance_id)

    def _seed_by_position(self) -> bool:
        """Install the worker extension's position seeding; False on an engine built without
        our worker extension (migrated samples then continue with a derived per-request seed:
        the same distribution, other tokens than unmoved)."""
        rpc = getattr(self.engine, "collective_rpc", None)
        if rpc is None:
            return False
        try:
            return all(self._call(rpc, "rlhf_fusion_seed_by_position", timeout=120))
        except Exception as exc:  # noqa: BLE001 - any engine without the extension
            log.info("vLLM instance %d: no position seeding (%s: %s); migrated samples draw "
                     "other tokens than unmoved ones", self.instance_id, type(exc).__name__, exc)
            return False

    # -- plumbing -----------------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, timeout: float | None = 60.0, **kwargs: Any) -> Any:
        """Call an engine method on the loop thread (the engine is not thread-safe); sync or
        async methods alike."""
        async def run() -> Any:
            out = fn(*args, **kwargs)
            return await out if asyncio.iscoroutine(out) or asyncio.isfuture(out) else out
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def close(self) -> None:
        """Stop the event loop thread, and the engine's processes if this backend built it."""
        if self._owns_engine and callable(getattr(self.engine, "shutdown", None)):
            self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _params(self, spec: SampleSpec, generated: int) -> Any:
        return self._params_cls(
            n=1,
            max_tokens=spec.max_new_tokens - generated,
            temperature=spec.temperature,
            # A seed gives the request its own generator (position seeding reseeds it).
            seed=derive_seed(spec.seed, spec.sample_id, generated),
            stop_token_ids=list(spec.stop_token_ids),
            ignore_eos=True,  # stopping is the spec's stop_token_ids, as in every backend
            logprobs=0,
            extra_args={POSITION_KEY: [int(spec.seed), int(spec.sample_id), int(generated)]},
        )

    async def _consume(self, req: _Req, prompt: dict[str, Any], params: Any) -> None:
        ended = False
        try:
            async for out in self.engine.generate(prompt, params, request_id=req.request_id):
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                lps = [float(d[t].logprob) if hasattr(d[t], "logprob") else float(d[t])
                       for d, t in zip(comp.logprobs or [], ids, strict=False)]
                with self._lock:
                    req.new_ids, req.new_lps = ids, lps
                    if out.finished:
                        ended = True
                        self._finished(req, comp.finish_reason)
                        self._wake.notify_all()
                if out.finished:
                    break
        except asyncio.CancelledError:
            pass  # older vLLM may end an aborted stream by cancelling it
        except Exception as exc:
            with self._lock:
                req.error = exc
                self._wake.notify_all()
        finally:
            with self._lock:
                if not ended and not req.stopping and req.error is None:
                    req.error = RolloutError(
                        f"instance {self.instance_id}: vLLM ended the stream of request "
                        f"{req.request_id} without a final output")
                    self._wake.notify_all()
            req.done.set()

    def _finished(self, req: _Req, reason: str | None) -> None:
        """A final output (under the lock): only "stop"/"length" finish a sample."""
        if reason in ("stop", "length"):
            req.finish_reason = reason
            if not req.removed:
                self._ready[req.spec.sample_id] = self._result(req)
        elif reason != "abort" or not req.stopping:
            # An abort we did not ask for (engine paused or shut down) is no finish either.
            req.error = RolloutError(
                f"instance {self.instance_id}: vLLM ended request {req.request_id} with "
                f"finish_reason={reason!r} after {len(req.new_ids)} tokens; only 'stop' and "
                "'length' finish a sample (was the engine paused, put to sleep or shut down "
                "while generating?)")

    def _result(self, req: _Req) -> SampleResult:
        return SampleResult(
            sample_id=req.spec.sample_id, prompt_ids=req.spec.prompt_ids,
            token_ids=tuple(req.prefix_ids + req.new_ids),
            logprobs=tuple(req.prefix_lps + req.new_lps),
            finish_reason=req.finish_reason or "length", instance=self.instance_id,
            migrated=bool(req.prefix_ids),
        )

    def _start(self, spec: SampleSpec) -> None:
        self._require_awake("submit")
        if spec.sample_id in self._reqs:
            raise RolloutError(f"instance {self.instance_id}: sample {spec.sample_id} is already "
                               "here; submit each sample once")
        g = len(spec.generated_ids)
        req = _Req(spec=spec.without_kv(),
                   request_id=f"rf-{self.instance_id}-{spec.sample_id}-{next(self._ids)}",
                   prefix_ids=list(spec.generated_ids), prefix_lps=list(spec.logprobs))
        self._reqs[spec.sample_id] = req
        prompt = {"prompt_token_ids": list(spec.prompt_ids) + list(spec.generated_ids)}
        asyncio.run_coroutine_threadsafe(self._consume(req, prompt, self._params(spec, g)),
                                         self._loop)

    # -- GenerationBackend --------------------------------------------------------------------
    def submit(self, specs: Sequence[SampleSpec]) -> None:
        for s in specs:
            if s.kv is not None:
                raise CapabilityError("VLLMBackend takes no KV handles; use import_samples "
                                      "with mode='tokens' tickets")
            self._start(s)

    def import_samples(self, tickets: Sequence[MigrationTicket]) -> None:
        for t in tickets:
            if t.spec.kv is not None and not self.capabilities.kv_import:
                raise CapabilityError(
                    f"sample {t.sample_id}: a KV ticket, but this vLLM backend was built "
                    "without kv_transfer; export with mode='tokens' (the recompute path)")
        for t in tickets:
            self._start(t.spec.without_kv())

    def _raise_errors(self) -> None:
        for req in self._reqs.values():
            if req.error is not None:
                raise RolloutError(f"instance {self.instance_id}: request {req.request_id} "
                                   f"failed in the engine: {req.error!r}") from req.error

    def step(self) -> list[SampleResult]:
        with self._lock:
            if not self._ready and any(not r.done.is_set() for r in self._reqs.values()):
                self._wake.wait(self._poll_s)
            ready = [self._ready.pop(k) for k in sorted(self._ready)]
        self._raise_errors()
        for r in ready:
            self._reqs.pop(r.sample_id, None)
        return ready

    def results(self) -> Iterator[SampleResult]:
        while self._reqs:
            yield from self.step()

    def unfinished(self) -> list[int]:
        # Includes samples vLLM finished whose result step() has not returned yet.
        return sorted(self._reqs)

    def progress(self) -> list[SampleProgress]:
        with self._lock:
            return [SampleProgress(sid, len(r.spec.prompt_ids),
                                   len(r.prefix_ids) + len(r.new_ids), r.spec.max_new_tokens)
                    for sid, r in sorted(self._reqs.items())]

    def _stop(self, sids: Iterable[int]) -> list[_Req]:
        """Abort requests and wait until their streams ended; returns those still unemitted."""
        reqs = []
        for sid in sids:
            req = self._reqs.get(int(sid))
            if req is not None:
                reqs.append(req)
        with self._lock:
            for req in reqs:
                req.stopping = True
        for req in reqs:
            self._call(self.engine.abort, req.request_id)
        for req in reqs:
            if not req.done.wait(60):
                raise RolloutError(f"instance {self.instance_id}: request {req.request_id} "
                                   "did not stop within 60 s of its abort")
        return reqs

    def abort(self, ids: Iterable[int]) -> None:
        reqs = self._stop(ids)
        with self._lock:
            for req in reqs:
                req.removed = True
                self._ready.pop(req.spec.sample_id, None)
                self._reqs.pop(req.spec.sample_id, None)

    def export_samples(self, ids: Iterable[int], mode: rollout_types.MigrationMode = "tokens"
                       ) -> list[MigrationTicket]:
        rollout_types.check_migration_mode(mode)
        if mode == "kv" and not self.capabilities.kv_export:
            raise CapabilityError(
                "this vLLM backend was built without kv_transfer, so it cannot export KV; "
                "use mode='tokens' (abort + resubmit with the generated ids)")
        reqs = self._stop(ids)
        tickets = []
        with self._lock:
            for req in reqs:
                sid = req.spec.sample_id
                if req.error is not None:
                    continue  # step() raises it
                if req.finish_reason is not None:
                    continue  # vLLM finished it before the abort landed: it is emitted here
                gen = req.prefix_ids + req.new_ids
                stop = bool(req.new_ids) and req.new_ids[-1] in req.spec.stop_token_ids
                if len(gen) >= req.spec.max_new_tokens or stop:
                    # Complete, though the abort output came instead of the finish: done here.
                    req.finish_reason = "stop" if stop else "length"
                    self._ready[sid] = self._result(req)
                    continue
                req.removed = True
                self._reqs.pop(sid, None)
                spec = SampleSpec(
                    sample_id=sid, prompt_ids=req.spec.prompt_ids,
                    max_new_tokens=req.spec.max_new_tokens, seed=req.spec.seed,
                    temperature=req.spec.temperature, stop_token_ids=req.spec.stop_token_ids,
                    generated_ids=tuple(gen), logprobs=tuple(req.prefix_lps + req.new_lps))
                tickets.append(MigrationTicket(spec=spec, mode="tokens",
                                               source=self.instance_id))
        return tickets

    def update_weights(self, weights: Mapping[str, Any] | Iterable[Any]) -> None:
        if self._reqs:
            raise RolloutError(f"instance {self.instance_id}: update_weights with "
                               f"{len(self._reqs)} unfinished samples; finish, abort or export "
                               "them first")
        rpc = getattr(self.engine, "collective_rpc", None)
        if rpc is None:
            raise CapabilityError("this vLLM engine has no collective_rpc; upgrade vLLM "
                                  "(>= 0.8) to update weights in place")
        named = weights.items() if isinstance(weights, Mapping) else weights
        self._call(rpc, "rlhf_fusion_load_weights", args=(pack_weights(named),), timeout=600)

    def sleep(self) -> None:
        """Free the engine's KV cache (and offload its weights) while training runs; on an
        engine without sleep mode it keeps both (said once at construction)."""
        if self._reqs:
            raise RolloutError(f"instance {self.instance_id}: sleep with {len(self._reqs)} "
                               "unfinished samples would lose them; finish, abort or export "
                               "them first")
        if self._sleeps and not self._asleep:
            self._call(self.engine.sleep, 1)
        self._asleep = True

    def wake_up(self) -> None:
        if self._sleeps and self._asleep:
            self._call(self.engine.wake_up)
        self._asleep = False

    def _require_awake(self, what: str) -> None:
        if self._asleep:
            raise RolloutError(f"instance {self.instance_id}: {what} while asleep; call "
                               "wake_up()")

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until every running request has ended (for tests and shutdown)."""
        deadline = time.monotonic() + timeout
        for req in list(self._reqs.values()):
            req.done.wait(max(0.0, deadline - time.monotonic()))
