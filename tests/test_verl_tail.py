"""Tail consolidation through verl's load balancer (rlhf_fusion.integrations.verl.tail).

verl's own client (``FullyAsyncLLMServerClient``, through our subclass) and our subclass of
verl's ``GlobalRequestLoadBalancer`` run unchanged; what needs a GPU is stubbed: each vLLM
replica is an in-process async object with vLLMHttpServer's ``generate`` / ``abort_request``
signatures (pinned by ``test_stubs_match_verl``), and Ray's actor calls are an in-process shim
(``.remote`` runs a balancer method at once, as a one-at-a-time Ray actor would, and turns a
replica's coroutine into a task), so the test needs neither Ray workers nor verl imported in
five processes. The stub decodes one token per step, a token being a function of the whole
sequence so far, so a continuation resubmitted from any point must reproduce the tokens the
request would have had without migration.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import time
from typing import Any

import pytest

pytestmark = pytest.mark.verl

STEP_S = 0.004  # one decode step of the stub
DEADLINE_S = 60.0  # on every wait of a test


def _tail():
    try:
        return __import__("rlhf_fusion.integrations.verl.tail", fromlist=["tail"])
    except Exception as exc:  # noqa: BLE001 - verl or its rollout packages missing
        pytest.skip(f"verl's rollout client is not importable here: {type(exc).__name__}: {exc}")


def next_token(seq: list[int]) -> int:
    return (sum(seq) * 31 + len(seq) * 7) % 1000 + 3


def expected(prompt: list[int], budget: int) -> list[int]:
    """The tokens a request gets without migration: up to its target length (prompt[0]) or
    the budget, whichever is first."""
    seq, out = list(prompt), []
    while len(out) < min(prompt[0], budget):
        tok = next_token(seq)
        seq.append(tok)
        out.append(tok)
    return out


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if inspect.iscoroutinefunction(self.fn):
            return asyncio.ensure_future(self.fn(*args, **kwargs))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args, **kwargs))
        return fut


class Handle:
    """A Ray actor handle's ``.method.remote(...)``, in process."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self.obj, name))


class StubReplica:
    """vLLMHttpServer's ``generate`` and ``abort_request`` (the signatures are verl's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.live: dict[str, bool] = {}  # vLLM id -> abort asked
        self.calls: list[dict] = []  # one per generate call
        self.reset_prefix_cache: list[bool] = []

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                       request_id: str, image_data: Any = None, video_data: Any = None,
                       audio_data: Any = None, mm_processor_kwargs: Any = None,
                       priority: int = 0, kv_transfer_params: Any = None) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        target, plen, sample = prompt_ids[0], prompt_ids[1], prompt_ids[2]
        budget = sampling_params["max_tokens"]
        seq, out = list(prompt_ids), []
        call = {"sample": sample, "done_before": len(prompt_ids) - plen, "max_tokens": budget,
                "start": time.monotonic()}
        self.calls.append(call)
        self.live[request_id] = False
        try:
            while True:
                if self.live[request_id]:
                    call.update(stop="aborted", n=len(out), end=time.monotonic())
                    return TokenOutput(token_ids=out, log_probs=[0.0] * len(out),
                                       stop_reason="aborted", extra_fields={"global_steps": 1})
                if len(seq) - plen >= target or len(out) >= budget:
                    call.update(stop="completed", n=len(out), end=time.monotonic())
                    return TokenOutput(token_ids=out, log_probs=[0.0] * len(out),
                                       stop_reason="completed", extra_fields={"global_steps": 1})
                await asyncio.sleep(STEP_S)
                tok = next_token(seq)
                seq.append(tok)
                out.append(tok)
        finally:
            del self.live[request_id]

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        self.reset_prefix_cache.append(reset_prefix_cache)
        if request_id not in self.live:
            return {"aborted": False, "error": f"Request {request_id} not found"}
        self.live[request_id] = True
        return {"aborted": True, "request_id": request_id}


def _config(budget: int):
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "name": "vllm", "response_length": budget, "full_determinism": False}}})


async def _run(balancer: Any, replicas: dict[str, StubReplica], requests: list[list[int]],
               budget: int, first: int) -> list[Any]:
    """Submit ``requests`` through verl's client (ours): the first ``first`` one by one (so
    least-loaded routing spreads them over the replicas), then the rest at once."""
    tail = _tail()
    client = tail.TailMigratingClient(config=_config(budget), load_balancer_handle=Handle(balancer))

    async def one(k: int) -> Any:
        return await client.generate(f"req-{k}", prompt_ids=requests[k],
                                     sampling_params={"max_tokens": budget})

    tasks = []
    for k in range(first):
        tasks.append(asyncio.ensure_future(one(k)))
        while sum(balancer._inflight_requests.values()) < k + 1:
            await asyncio.sleep(0.001)
    tasks += [asyncio.ensure_future(one(k)) for k in range(first, len(requests))]
    return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)


def _workload(n_long: int, n_short: int) -> list[list[int]]:
    # prompt = [target length, prompt length, sample index, ...]; long ones first
    longs = [[300 if k % 2 else 10_000, 6, k, 11, 12, 13] for k in range(n_long)]
    shorts = [[3, 5, n_long + k, 21, 22] for k in range(n_short)]
    return longs + shorts


def _balancer(tail: Any, policy: Any, replicas: dict[str, StubReplica]) -> Any:
    from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE

    # as verl's _create_global_sticky_inflight constructs a load_balancer_cls
    return tail.balancer_cls(policy)(
        servers={sid: Handle(r) for sid, r in replicas.items()},
        max_cache_size=DEFAULT_ROUTING_CACHE_SIZE)


def test_tail_moves_to_m_replicas_and_every_request_is_answered_once():
    tail = _tail()
    budget = 250
    replicas = {f"10.0.0.{i}:8000": StubReplica(f"r{i}") for i in range(4)}
    policy = tail.TailPolicy(rt=6, bs_max=4, longest_kv_tokens=6 + budget)
    assert policy.m == 2  # ceil(6 / 4)
    balancer = _balancer(tail, policy, replicas)
    requests = _workload(n_long=4, n_short=12)
    outs = asyncio.run(_run(balancer, replicas, requests, budget, first=4))

    # every request answered once, with the tokens it would have had without migration
    assert len(outs) == len(requests)
    for prompt, out in zip(requests, outs, strict=True):
        assert out.token_ids == expected(prompt, budget), prompt[2]
        assert len(out.token_ids) <= budget
        assert out.stop_reason == ("length" if prompt[0] > budget else "completed")

    status = balancer.tail_status()
    [mig] = status["migrations"]  # one tail, one migration
    assert mig["running"] < policy.rt and len(mig["targets"]) == policy.m
    assert sorted(mig["targets"] + mig["freed"]) == sorted(replicas)
    assert all(src in mig["freed"] and dst in mig["targets"] for src, dst in mig["moves"].values())
    # the four long requests sat one per replica: the two on the freed replicas moved (short
    # ones still decoding there may have moved too)
    long_moved = sorted(int(rid.split("-")[1]) for rid in mig["moves"] if int(rid.split("-")[1]) < 4)
    on_freed = sorted(c["sample"] for sid in mig["freed"] for c in replicas[sid].calls
                      if c["sample"] < 4)
    assert len(long_moved) == 2 and long_moved == on_freed
    resumed = [(sid, c) for sid, r in replicas.items() for c in r.calls if c["done_before"]]
    assert {c["sample"] for _, c in resumed} >= set(long_moved)
    assert len(resumed) <= len(mig["moves"])
    for sid, call in resumed:
        assert sid in mig["targets"]
        # verl's client resubmitted with the remaining budget
        assert call["max_tokens"] == budget - call["done_before"]
    # on the freed replicas the long requests were aborted mid-decode: the tail left them
    for sid in mig["freed"]:
        for call in replicas[sid].calls:
            if call["sample"] < 4:
                assert call["stop"] == "aborted" and call["n"] > 0
    # after the migration the freed replicas took no request
    t = max(c["end"] for sid in mig["freed"] for c in replicas[sid].calls)
    assert all(c["start"] < t for sid in mig["freed"] for c in replicas[sid].calls)
    # the aborts kept the prefix cache, and the wave ended: routing is verl's again
    assert all(flag is False for r in replicas.values() for flag in r.reset_prefix_cache)
    assert status["targets"] is None and status["running"] == 0 and not status["moving"]


def test_rt_zero_runs_the_tail_where_it_is():
    tail = _tail()
    budget = 250
    replicas = {f"10.0.0.{i}:8000": StubReplica(f"r{i}") for i in range(4)}
    balancer = _balancer(tail, tail.TailPolicy(rt=0, bs_max=4, longest_kv_tokens=256), replicas)
    assert balancer.require_acquire_fields() == [] and balancer.require_release_fields() == []
    requests = _workload(n_long=4, n_short=12)
    outs = asyncio.run(_run(balancer, replicas, requests, budget, first=4))
    for prompt, out in zip(requests, outs, strict=True):
        assert out.token_ids == expected(prompt, budget)
    assert balancer.tail_status()["migrations"] == []
    calls = [c for r in replicas.values() for c in r.calls]
    assert len(calls) == len(requests) and all(c["stop"] == "completed" for c in calls)
    assert all(not r.reset_prefix_cache for r in replicas.values())


def test_rt_zero_routes_as_verl():
    """Same acquire/release sequence, same random state: the same replica for every request
    as verl's GlobalRequestLoadBalancer."""
    tail = _tail()
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    servers = {f"s{i}": object() for i in range(5)}
    ours = tail.balancer_cls(tail.TailPolicy(rt=0, bs_max=2, longest_kv_tokens=8))(servers=servers)
    stock = GlobalRequestLoadBalancer(servers=servers)
    ops = random.Random(7)
    held: list[tuple[str, str]] = []
    routes: dict[str, list[str]] = {"ours": [], "stock": []}
    for step in range(300):
        if held and ops.random() < 0.45:
            rid, _ = held.pop(ops.randrange(len(held)))
            for lb in (ours, stock):
                lb.release_server(lb._request_id_to_server[rid], request_id=rid)
        else:
            rid = f"r{ops.randrange(40)}"  # repeats: sticky sessions
            state = random.getstate()
            a, _ = ours.acquire_server(rid)
            random.setstate(state)
            b, _ = stock.acquire_server(rid)
            routes["ours"].append(a)
            routes["stock"].append(b)
            held.append((rid, a))
        assert ours.get_status()["servers"] == stock.get_status()["servers"], step
    assert routes["ours"] == routes["stock"]


def test_abort_not_found_leaves_the_request_where_it_is():
    """An abort vLLM does not find: a request still decoding at its source (not admitted yet)
    is asked again, ABORT_TRIES times in all, then stays where it is; one that ended first is
    not waited for. Either way nothing waits for a resubmission that will not come."""
    tail = _tail()

    class Gone(StubReplica):
        async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
            self.reset_prefix_cache.append(reset_prefix_cache)
            return {"aborted": False, "error": f"Request {request_id} not found"}

    async def wave(release_first: bool) -> tuple[Any, dict]:
        replicas = {k: Gone(k) for k in "abc"}
        lb = tail.balancer_cls(tail.TailPolicy(rt=4, bs_max=3, longest_kv_tokens=8))(
            servers={k: Handle(v) for k, v in replicas.items()})
        assert lb.policy.m == 2
        got = {f"q{k}": lb.acquire_server(f"q{k}", **{tail.VLLM_ID_FIELD: f"v{k}"})[0]
               for k in range(4)}
        doubled = next(s for s in "abc" if list(got.values()).count(s) == 2)
        lb.release_server(doubled, request_id=next(r for r, s in got.items() if s == doubled))
        [mig] = lb.migrations  # 3 < R_t decoding, one per replica: one keeper fewer
        [(moved, (src, dst))] = mig["moves"].items()
        assert lb.tail_status()["moving"] == {moved: dst} and src in mig["freed"]
        if release_first:
            lb.release_server(src, request_id=moved)
        for _ in range(2 * tail.ABORT_TRIES):
            await asyncio.sleep(0)  # the abort answers
            lb._poll_aborts()
        return lb, {"src": src, "moved": moved, "replicas": replicas}

    lb, w = asyncio.run(asyncio.wait_for(wave(release_first=False), DEADLINE_S))
    assert lb.tail_status()["moving"] == {}
    assert lb._running[w["moved"]].server_id == w["src"]
    assert len(w["replicas"][w["src"]].reset_prefix_cache) == tail.ABORT_TRIES
    lb, w = asyncio.run(asyncio.wait_for(wave(release_first=True), DEADLINE_S))
    assert lb.tail_status()["moving"] == {}
    assert len(w["replicas"][w["src"]].reset_prefix_cache) == 1


def test_keepers_are_m_even_when_the_tail_sits_on_fewer():
    """The tail on one replica, m = 2: nothing moves, two replicas keep serving (the holder
    and an idle one), and next turns go to the keepers, never to the freed replica."""
    tail = _tail()
    lb = tail.balancer_cls(tail.TailPolicy(rt=2, bs_max=1, longest_kv_tokens=8))(
        servers={k: Handle(StubReplica(k)) for k in "abc"})
    assert lb.policy.m == 2
    got = {f"q{k}": lb.acquire_server(f"q{k}", **{tail.VLLM_ID_FIELD: f"v{k}"})[0]
           for k in range(3)}
    assert sorted(got.values()) == list("abc")
    lb.release_server(got["q0"], request_id="q0")
    assert lb.migrations == []  # 2 decoding: not fewer than R_t
    lb.release_server(got["q1"], request_id="q1")
    [mig] = lb.migrations
    assert mig["moves"] == {} and len(mig["targets"]) == 2 and got["q2"] in mig["targets"]
    [idle] = [s for s in mig["targets"] if s != got["q2"]]
    assert sorted(mig["freed"] + mig["targets"]) == list("abc")
    lb.acquire_server("t0", **{tail.VLLM_ID_FIELD: "t0"})  # 2 decoding again: routing is verl's
    assert lb._request_id_to_server["t0"] == idle
    assert lb.tail_status()["targets"] is None


def test_balancer_as_verl_builds_it_in_ray():
    """verl's get_router_handle makes our bound class a Ray actor (shipped by value, policy
    included); the migration aborts on a replica actor with a real ObjectRef, which the
    balancer settles, and the resubmission goes to the keeper."""
    tail = _tail()
    ray = pytest.importorskip("ray")
    from verl.workers.rollout.router import get_router_handle

    class Replica:
        """Nested: Ray ships it by value (the worker cannot import this test module)."""

        def __init__(self) -> None:
            self.aborts: list[tuple[str, bool]] = []

        async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
            self.aborts.append((request_id, reset_prefix_cache))
            return {"aborted": True, "request_id": request_id}

        def seen(self) -> list:
            return self.aborts

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        actor = ray.remote(num_cpus=0)(Replica)
        replicas = {k: actor.remote() for k in "abc"}
        policy = tail.TailPolicy(rt=4, bs_max=3, longest_kv_tokens=8)
        lb = get_router_handle(servers=replicas, load_balancer_cls=tail.balancer_cls(policy))

        def call(method: str, **kw: Any) -> Any:
            return ray.get(getattr(lb, method).remote(**kw), timeout=DEADLINE_S)

        assert call("require_acquire_fields") == [tail.VLLM_ID_FIELD]
        got = {f"q{k}": call("acquire_server", request_id=f"q{k}",
                             **{tail.VLLM_ID_FIELD: f"v{k}"})[0] for k in range(4)}
        doubled = next(s for s in "abc" if list(got.values()).count(s) == 2)
        call("release_server", server_id=doubled,
             request_id=next(r for r, s in got.items() if s == doubled))
        status = call("get_status")["tail"]
        [mig] = status["migrations"]
        [(moved, (src, dst))] = mig["moves"].items()
        assert status["rt"] == 4 and status["m"] == 2 and status["moving"] == {moved: dst}
        vid = f"v{moved[1:]}"
        deadline = time.monotonic() + DEADLINE_S
        while not ray.get(replicas[src].seen.remote(), timeout=DEADLINE_S):
            assert time.monotonic() < deadline, "the abort never reached the replica"
            time.sleep(0.05)
        assert ray.get(replicas[src].seen.remote(), timeout=DEADLINE_S) == [(vid, False)]
        call("release_server", server_id=src, request_id=moved)  # the aborted call returns
        while call("get_status")["tail"]["aborts_pending"]:  # settled through ray.wait
            assert time.monotonic() < deadline, "the balancer never saw the abort's answer"
            time.sleep(0.05)
        sid, _ = call("acquire_server", request_id=moved, **{tail.VLLM_ID_FIELD: "again"})
        assert sid == dst and call("get_status")["tail"]["moving"] == {}
    finally:
        ray.shutdown()


def test_policy_from_verl_config():
    tail = _tail()
    from rlhf_fusion.integrations.verl.options import VerlPluginError, plugins_from_config

    cfg = _verl_config("+rlhf_fusion.tail.rt=64", "+rlhf_fusion.tail.bs_max=16")
    policy = tail.tail_policy_from_config(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    assert policy == tail.TailPolicy(rt=64, bs_max=16, longest_kv_tokens=float(
        rollout.prompt_length + rollout.response_length))
    assert policy.m == 4
    assert plugins_from_config(cfg) == frozenset()  # a setting, not a plugin
    capped = tail.tail_policy_from_config(_verl_config(
        "+rlhf_fusion.tail.rt=64", "+rlhf_fusion.tail.kv_capacity_tokens=8192"))
    assert capped.bs_max == rollout.max_num_seqs
    assert capped.m == 8  # ceil(64 * 1024 / 8192)
    assert tail.tail_policy_from_config(_verl_config()) is None
    assert tail.tail_policy_from_config(_verl_config("+rlhf_fusion.tail.rt=0")) is None
    with pytest.raises(VerlPluginError, match="full_determinism"):
        tail.tail_policy_from_config(_verl_config(
            "+rlhf_fusion.tail.rt=8", "actor_rollout_ref.rollout.full_determinism=true"))


def test_trainer_mode_installs_balancer_and_client(monkeypatch):
    """``_setup`` swaps the manager's balancer for ours (built by verl's get_router_handle, the
    old one killed) and ``get_llm_client`` hands out our client; without the key, verl's."""
    tail = _tail()
    import ray
    import verl.workers.rollout.router as router

    made, killed = [], []
    monkeypatch.setattr(router, "get_router_handle",
                        lambda **kw: made.append(kw) or f"lb{len(made)}")
    monkeypatch.setattr(ray, "kill", killed.append)

    class Manager:
        server_addresses, server_handles = ["a", "b", "c"], ["ha", "hb", "hc"]
        global_load_balancer = "stock-lb"

        def get_client(self, client_cls=None, **kw):  # noqa: ANN001
            return (client_cls, self.global_load_balancer)

    class Base:
        def __init__(self, config):  # noqa: ANN001
            self.config = config

        def _setup(self):
            self.llm_server_manager = Manager()

        def get_llm_client(self):
            return "verl's client"

    class Mode(tail.TailConsolidationMixin, Base):
        pass

    stock = Mode(_verl_config())
    stock._setup()
    assert stock.get_llm_client() == "verl's client" and made == []
    mode = Mode(_verl_config("+rlhf_fusion.tail.rt=8"))
    mode._setup()
    [kw] = made
    assert kw["servers"] == {"a": "ha", "b": "hb", "c": "hc"}
    assert issubclass(kw["load_balancer_cls"], tail.TailConsolidatingLoadBalancer)
    assert kw["load_balancer_cls"].policy.rt == 8 and killed == ["stock-lb"]
    assert mode.get_llm_client() == (tail.TailMigratingClient, "lb1")


def test_stubs_match_verl():
    """The seams the balancer and client use, and the stub's replica methods, are verl 0.9.1's
    (vLLMHttpServer is read from its source: importing it needs vLLM)."""
    tail = _tail()
    import ast
    import pathlib

    import verl
    from verl.workers.rollout.llm_server import (
        FullyAsyncLLMServerClient,
        LLMServerClient,
        LLMServerManager,
    )
    from verl.workers.rollout.router import GlobalRequestLoadBalancer, get_router_handle

    from rlhf_fusion.integrations.verl.compat import check_tail_seam, check_version

    check_tail_seam(check_version())

    def params(fn):  # noqa: ANN001, ANN202
        return list(inspect.signature(fn).parameters)

    assert params(GlobalRequestLoadBalancer.__init__) == ["self", "servers", "max_cache_size",
                                                          "full_determinism"]
    assert params(GlobalRequestLoadBalancer.acquire_server) == ["self", "request_id"]
    assert params(GlobalRequestLoadBalancer.release_server) == ["self", "server_id", "request_id"]
    assert params(GlobalRequestLoadBalancer.remove_servers) == ["self", "server_ids"]
    for name in ("require_acquire_fields", "require_release_fields", "get_status",
                 "add_servers", "get_all_servers", "clear_sticky_cache", "get_total_inflight"):
        assert callable(getattr(GlobalRequestLoadBalancer, name))
    lb = GlobalRequestLoadBalancer(servers={"s": None})
    assert {"_servers", "_inflight_requests", "_request_id_to_server"} <= set(vars(lb))
    assert params(get_router_handle) == ["servers", "router_config_path", "full_determinism",
                                         "load_balancer_cls"]
    assert params(LLMServerClient._acquire_server) == ["self", "request_id", "extra"]
    assert params(LLMServerClient._vllm_request_id) == ["self", "request_id"]
    assert params(FullyAsyncLLMServerClient.__init__)[:3] == ["self", "config",
                                                              "load_balancer_handle"]
    assert "client_cls" in params(LLMServerManager.get_client)
    assert issubclass(tail.TailMigratingClient, FullyAsyncLLMServerClient)

    path = (pathlib.Path(verl.__file__).parent / "workers" / "rollout" / "vllm_rollout"
            / "vllm_async_server.py")
    cls = next(n for n in ast.parse(path.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "vLLMHttpServer")
    methods = {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs] for f in cls.body
               if isinstance(f, ast.AsyncFunctionDef)}
    assert methods["generate"] == params(StubReplica.generate)
    assert methods["abort_request"] == params(StubReplica.abort_request)


def _verl_config(*overrides: str):
    import os

    import verl.trainer.config
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(os.path.dirname(verl.trainer.config.__file__)),
                              "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))
