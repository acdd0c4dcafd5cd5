"""Long-tail consolidation through verl's rollout load balancer (abort + resubmit).

verl routes every generation request through one load-balancer Ray actor
(``verl/workers/rollout/router.py``, ``GlobalRequestLoadBalancer``), which sees each request
acquire a replica and release it. :class:`TailConsolidatingLoadBalancer` subclasses it: once
fewer than R_t requests are still decoding (after at least R_t were), it picks the m replicas
that keep the tail (``m = max(ceil(R_t/BS_max), ceil(R_t*M/C))``,
:func:`rlhf_fusion.rollout.planning.required_instances`) and which request goes where
(:func:`rlhf_fusion.rollout.planning.assign_migration`: the replicas holding most of the tail
keep theirs, the rest move, fewest-loaded destination first), aborts the moving requests on
the replicas holding them (``vLLMHttpServer.abort_request``), and routes their resubmission to
their destination. The resubmission is verl's own: ``FullyAsyncLLMServerClient.generate``
sends an aborted request again as prompt + the tokens generated so far, with the remaining
token budget (verl/workers/rollout/llm_server.py:289-345), the ticket our token migration uses.
Until the wave ends (no request left, or R_t or more again: new work arrived), every request
goes to the m replicas, so the others stay free.

To abort a request the balancer needs the id vLLM knows it by, which verl's client draws
(``uuid4``) after the balancer answered. :class:`TailMigratingClient` draws it before and hands
it to the balancer as an acquire field (``require_acquire_fields``, the way verl's client
forwards what a balancer asks for), then gives vLLM the same id.

``R_t = 0`` (or no ``rlhf_fusion.tail`` key) installs nothing: verl's balancer and client run.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
from typing import Any
from uuid import uuid4

from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

from ...errors import RLHFFusionError
from ...rollout.planning import MovingSample, assign_migration, required_instances
from .options import HYDRA_KEY, VerlPluginError

__all__ = ["VLLM_ID_FIELD", "TailConsolidatingLoadBalancer", "TailMigratingClient", "TailPolicy",
           "balancer_cls", "install_balancer", "tail_policy_from_config"]

LOG = logging.getLogger("rlhf_fusion.verl")
# the acquire field that carries the vLLM request id from our client to our balancer
VLLM_ID_FIELD = "rlhf_fusion_vllm_request_id"
# aborts of one request that vLLM did not find before the balancer stops asking
ABORT_TRIES = 5
_VLLM_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlhf_fusion_vllm_id",
                                                                       default=None)


@dataclasses.dataclass(frozen=True)
class TailPolicy:
    """R_t and what sizes m: BS_max (requests one replica decodes at once), M (KV tokens of the
    longest request: prompt + response length) and C (KV tokens one replica holds; None: only
    BS_max bounds m)."""

    rt: int
    bs_max: int
    longest_kv_tokens: float
    kv_capacity_tokens: float | None = None

    def __post_init__(self) -> None:
        if self.rt < 0 or self.bs_max < 1 or self.longest_kv_tokens <= 0:
            raise VerlPluginError(
                f"{HYDRA_KEY}.tail: rt={self.rt} (>= 0), bs_max={self.bs_max} (>= 1) and "
                f"M={self.longest_kv_tokens} (> 0) are required")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.longest_kv_tokens:
            raise VerlPluginError(
                f"{HYDRA_KEY}.tail.kv_capacity_tokens={self.kv_capacity_tokens:g} is below one "
                f"request's M={self.longest_kv_tokens:g} (prompt_length + response_length)")

    @property
    def m(self) -> int:
        return required_instances(self.rt, self.bs_max, self.longest_kv_tokens,
                                  self.kv_capacity_tokens)


def tail_policy_from_config(config: Any) -> TailPolicy | None:
    """``+rlhf_fusion.tail.rt=N`` (with optional ``bs_max``, default the rollout's
    ``max_num_seqs``, and ``kv_capacity_tokens``); None when absent or ``rt`` is 0."""
    section = config.get(HYDRA_KEY) if hasattr(config, "get") else None
    tail = section.get("tail") if section is not None and hasattr(section, "get") else None
    if tail is None or int(tail.get("rt", 0) or 0) == 0:
        return None
    rollout = config.actor_rollout_ref.rollout
    if bool(rollout.get("full_determinism", False)):
        raise VerlPluginError(
            f"{HYDRA_KEY}.tail.rt={tail.get('rt')} with actor_rollout_ref.rollout."
            f"full_determinism=true: migration moves a request to another replica (vLLM seeds "
            f"per replica) and gives vLLM ids of its own; set {HYDRA_KEY}.tail.rt=0 or turn "
            f"full_determinism off")
    cap = tail.get("kv_capacity_tokens")
    return TailPolicy(
        rt=int(tail.rt),
        bs_max=int(tail.get("bs_max") or rollout.max_num_seqs),
        longest_kv_tokens=float(rollout.prompt_length + rollout.response_length),
        kv_capacity_tokens=None if cap is None else float(cap),
    )


@dataclasses.dataclass
class _Running:
    server_id: str
    vllm_id: str | None


@dataclasses.dataclass
class _Abort:
    request_id: str
    source: str
    vllm_id: str
    ref: Any  # the ObjectRef of abort_request's answer
    tries: int = 1


class TailConsolidatingLoadBalancer(GlobalRequestLoadBalancer):
    """verl's sticky least-loaded balancer that moves the long tail onto m replicas (module
    doc). :func:`balancer_cls` binds a :class:`TailPolicy`; verl's factory constructs it with
    ``servers`` and ``max_cache_size`` only (``_create_global_sticky_inflight``)."""

    policy: TailPolicy | None = None

    def __init__(self, servers: dict[str, Any],
                 max_cache_size: int = DEFAULT_ROUTING_CACHE_SIZE) -> None:
        super().__init__(servers=servers, max_cache_size=max_cache_size)
        self._running: dict[str, _Running] = {}  # request_id -> where it decodes now
        self._moving: dict[str, str] = {}  # request_id -> destination of its resubmission
        self._aborts: list[_Abort] = []  # aborts sent, not yet answered
        self._targets: list[str] | None = None  # the m replicas while a tail is consolidated
        self._armed = False  # R_t or more requests have run since the last wave ended
        self.migrations: list[dict[str, Any]] = []

    def _rt(self) -> int:
        return 0 if self.policy is None else self.policy.rt

    # ------------------------------------------------------------ verl's interface

    def require_acquire_fields(self) -> list[str]:
        return [VLLM_ID_FIELD] if self._rt() > 0 else super().require_acquire_fields()

    def require_release_fields(self) -> list[str]:
        return ["request_id"] if self._rt() > 0 else super().require_release_fields()

    def acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        if self._rt() == 0:
            return super().acquire_server(request_id)
        self._poll_aborts()
        dest = self._moving.pop(request_id, None)
        if dest is None and self._targets is not None:
            live = [s for s in self._targets if s in self._servers]
            if live:
                dest = min(live, key=lambda s: (self._inflight_requests[s], s))
        if dest is not None and dest in self._servers:
            self._request_id_to_server[request_id] = dest
            self._inflight_requests[dest] += 1
            server_id, handle = dest, self._servers[dest]
        else:
            server_id, handle = super().acquire_server(request_id)
        self._running[request_id] = _Running(server_id, extra.get(VLLM_ID_FIELD))
        if len(self._running) >= self._rt():
            self._armed = True
            self._targets = None  # new work: routing is verl's again
        return server_id, handle

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        super().release_server(server_id, request_id)
        if self._rt() == 0:
            return
        run = self._running.get(request_id) if request_id is not None else None
        if run is not None and run.server_id == server_id:
            del self._running[request_id]
        self._poll_aborts()
        if not self._running:
            # the wave ended; a moved request still to be resubmitted keeps its destination
            self._armed, self._targets = False, None
        self._maybe_migrate()

    def remove_servers(self, server_ids: list[str]) -> None:
        super().remove_servers(server_ids)
        if self._targets is not None and set(self._targets) & set(server_ids):
            self._targets = None  # a keeper left: route as verl does rather than guess
        self._moving = {r: d for r, d in self._moving.items() if d not in server_ids}

    def get_status(self) -> dict:
        status = super().get_status()
        status["tail"] = self.tail_status()
        return status

    # ------------------------------------------------------------ the tail

    def tail_status(self) -> dict[str, Any]:
        """R_t, m, the keepers now, the requests decoding and awaiting resubmission, and every
        migration so far (``migrations``: requests decoding then, keepers, freed, moves).
        Settles the aborts that have answered first."""
        if self.policy is not None and self.policy.rt > 0:
            self._poll_aborts()
        return {"rt": self._rt(), "m": None if self.policy is None else self.policy.m,
                "targets": self._targets, "running": len(self._running),
                "moving": dict(self._moving), "aborts_pending": len(self._aborts),
                "migrations": list(self.migrations)}

    def _maybe_migrate(self) -> None:
        assert self.policy is not None
        n = len(self._running)
        if not self._armed or self._targets is not None or not 0 < n < self._rt():
            return
        servers = sorted(self._servers)
        index = {sid: i for i, sid in enumerate(servers)}
        order = sorted(self._running)
        unfinished: dict[int, list[MovingSample]] = {i: [] for i in range(len(servers))}
        for k, rid in enumerate(order):
            sid = self._running[rid].server_id
            if sid in index:  # a request on a removed server finishes there
                unfinished[index[sid]].append(MovingSample(
                    sample_id=k, kv_tokens=0,
                    reserved_tokens=math.ceil(self.policy.longest_kv_tokens)))
        try:
            plan = assign_migration(unfinished, self.policy.m, bs_max=self.policy.bs_max,
                                    kv_capacity_tokens=self.policy.kv_capacity_tokens)
        except RLHFFusionError as exc:  # KV capacity: this tail stays where it is
            self._armed = False
            LOG.warning(f"rlhf_fusion: tail not consolidated: {exc}")
            return
        moves: dict[str, tuple[str, str]] = {}
        for src, per in plan.moves.items():
            for dst, ids in per.items():
                for k in ids:
                    rid = order[k]
                    run = self._running[rid]
                    if run.vllm_id is None:
                        continue  # not our client's request: no id to abort it by
                    self._aborts.append(_Abort(rid, servers[src], run.vllm_id,
                                               self._abort(servers[src], run.vllm_id)))
                    self._moving[rid] = servers[dst]
                    moves[rid] = (servers[src], servers[dst])
        keep, freed = list(plan.destinations), list(plan.freed)
        # the tail sits on fewer than m replicas: keep m anyway (idle ones, by id) so a
        # multi-turn loop's next turns spread over m, as R_t was sized for
        while len(keep) < self.policy.m and freed:
            keep.append(freed.pop(0))
        self._targets = sorted(servers[d] for d in keep)
        record = {"running": n, "targets": list(self._targets),
                  "freed": [servers[i] for i in freed], "moves": moves}
        self.migrations.append(record)
        LOG.warning(f"rlhf_fusion: {n} < R_t={self._rt()} requests decoding: tail kept on "
                    f"{len(self._targets)} replica(s), {len(moves)} request(s) moved, "
                    f"{len(freed)} replica(s) freed")

    def _abort(self, server_id: str, vllm_id: str) -> Any:
        # the prefix cache holds nothing stale (same weights): keep it for the keepers' sake
        return self._servers[server_id].abort_request.remote(vllm_id, reset_prefix_cache=False)

    def _poll_aborts(self) -> None:
        """Settle the aborts that have answered. One vLLM did not find either ended first (its
        request is released: nothing to resubmit) or is not admitted yet (the request still
        decodes there: abort again, up to ABORT_TRIES times; after that it ends where it is)."""
        if not self._aborts:
            return
        answered = _answered([a.ref for a in self._aborts])
        keep: list[_Abort] = []
        for a in self._aborts:
            if id(a.ref) not in answered:
                keep.append(a)
                continue
            result = answered[id(a.ref)]
            if isinstance(result, dict) and result.get("aborted"):
                continue
            run = self._running.get(a.request_id)
            if (run is not None and run.vllm_id == a.vllm_id and a.tries < ABORT_TRIES
                    and a.source in self._servers):
                keep.append(dataclasses.replace(a, ref=self._abort(a.source, a.vllm_id),
                                                tries=a.tries + 1))
            else:
                self._moving.pop(a.request_id, None)
        self._aborts = keep


def _answered(refs: list[Any]) -> dict[int, Any]:
    """``{id(ref): result}`` of the refs that have answered, without waiting. Ray ObjectRefs
    (the replicas' actor calls); an asyncio future stands for one where the replicas are
    in-process objects (tests/test_verl_tail.py)."""
    import ray

    out: dict[int, Any] = {}
    ray_refs = [r for r in refs if isinstance(r, ray.ObjectRef)]
    if ray_refs:
        done, _ = ray.wait(ray_refs, num_returns=len(ray_refs), timeout=0)
        for r in done:
            try:
                out[id(r)] = ray.get(r)
            except Exception as exc:  # noqa: BLE001 - a dead replica: the request is not moved
                out[id(r)] = {"aborted": False, "error": repr(exc)}
    for r in refs:
        if not isinstance(r, ray.ObjectRef) and r.done():
            out[id(r)] = r.result()
    return out


def balancer_cls(policy: TailPolicy) -> type[TailConsolidatingLoadBalancer]:
    """:class:`TailConsolidatingLoadBalancer` with ``policy`` bound (verl's factory passes no
    arguments of ours; cloudpickle ships the class, policy included, to the Ray actor)."""
    cls = type("TailConsolidatingLoadBalancer", (TailConsolidatingLoadBalancer,),
               {"policy": policy, "__module__": __name__})
    # a qualname the module does not hold: cloudpickle ships the class (and policy) by value
    cls.__qualname__ = f"TailConsolidatingLoadBalancer[rt={policy.rt}]"
    return cls


class TailMigratingClient(FullyAsyncLLMServerClient):
    """verl's resuming client (an aborted request comes back as prompt + generated tokens with
    the remaining budget) that draws the vLLM request id before acquiring a replica and hands
    it to the balancer, so the balancer can abort the request on the replica holding it."""

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        vllm_id = uuid4().hex
        _VLLM_ID.set(vllm_id)  # read by _vllm_request_id in the same generate() call
        return await super()._acquire_server(request_id, **extra, **{VLLM_ID_FIELD: vllm_id})

    def _vllm_request_id(self, request_id: str) -> str:
        vllm_id = _VLLM_ID.get()
        return super()._vllm_request_id(request_id) if vllm_id is None else vllm_id


def install_balancer(manager: Any, policy: TailPolicy, servers: dict[str, Any] | None = None) -> Any:
    """Replace ``manager.global_load_balancer`` (an ``LLMServerManager``'s) with a
    :class:`TailConsolidatingLoadBalancer` over ``servers`` (default: the manager's replicas),
    built by verl's own ``get_router_handle``; kills the balancer it replaces. Returns the new
    handle. Call before any client is handed out (clients hold the balancer's handle)."""
    import ray
    from verl.workers.rollout.router import get_router_handle

    if servers is None:
        servers = dict(zip(manager.server_addresses, manager.server_handles, strict=True))
    old = getattr(manager, "global_load_balancer", None)
    cls = balancer_cls(policy)
    manager._load_balancer_cls = cls
    manager.global_load_balancer = get_router_handle(servers=servers, load_balancer_cls=cls)
    if old is not None:
        ray.kill(old)
    n = len(servers)
    if n < 2 or policy.m >= n:
        LOG.warning(f"rlhf_fusion: tail consolidation with R_t={policy.rt} needs m={policy.m} "
                    f"keepers out of {n} replica(s): no replica can be freed (lower R_t or add "
                    f"replicas)")
    return manager.global_load_balancer


class TailConsolidationMixin:
    """Trainer-mode side: with ``+rlhf_fusion.tail.rt=N`` (N > 0), ``_setup`` puts a
    :class:`TailConsolidatingLoadBalancer` in front of the replicas the rollout client uses and
    ``get_llm_client`` hands out :class:`TailMigratingClient`; otherwise both are verl's."""

    config: Any
    _tail_policy: TailPolicy | None = None

    def _tail_manager(self) -> Any:
        # separate_async generates from its standalone replicas (plus the hybrid ones while
        # they are in rollout mode); the other modes from llm_server_manager
        return getattr(self, "standalone_server_manager", None) or self.llm_server_manager  # type: ignore[attr-defined]

    def _setup(self) -> None:
        super()._setup()  # type: ignore[misc]
        self._tail_policy = tail_policy_from_config(self.config)
        if self._tail_policy is None:
            return
        from .compat import check_tail_seam, check_version

        check_tail_seam(check_version())
        manager = self._tail_manager()
        servers = dict(zip(manager.server_addresses, manager.server_handles, strict=True))
        if manager is not self.llm_server_manager and getattr(  # type: ignore[attr-defined]
                getattr(self, "current_mode", None), "value", None) == "rollout":
            hybrid = self.llm_server_manager  # type: ignore[attr-defined]
            # verl's _setup added them to the balancer being replaced (add_replicas_to_balancer)
            servers.update(zip(hybrid.server_addresses, hybrid.server_handles, strict=True))
        install_balancer(manager, self._tail_policy, servers)
        LOG.warning(f"rlhf_fusion: verl rollout tail consolidation on: R_t={self._tail_policy.rt}"
                    f", m={self._tail_policy.m} of {len(servers)} replica(s)")

    def get_llm_client(self) -> Any:
        if self._tail_policy is None:
            return super().get_llm_client()  # type: ignore[misc]
        return self._tail_manager().get_client(client_cls=TailMigratingClient)
