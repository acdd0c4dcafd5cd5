"""OpenRLHF integration, the streaming driver's bookkeeping (``fusion_generate_vllm``) against a
scripted Ray: engines that return their finished samples in whole batches, in an order the test
chooses, so the interleavings that real timing produces only now and then happen every run.

The case that hung CI (stop 32, issue 35): with dynamic filtering, an engine's poll returns a
batch whose first prompt is filtered out; its replacement is submitted while the rest of that
batch is still being counted, and a poll issued then lands on an engine that has nothing left
to return. Ray waits on it for ever. The scripted Ray here raises instead of waiting.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("openrlhf")
torch = pytest.importorskip("torch")

from rlhf_fusion.integrations.openrlhf import FusionOptions, plugin_state, streaming  # noqa: E402
from rlhf_fusion.rollout.types import RolloutError  # noqa: E402
from rlhf_fusion.testing.openrlhf import install_cpu_stubs, remove_cpu_stubs  # noqa: E402

N = 2  # samples per prompt


class _Ref:
    def __init__(self, engine: _Engine | None, kind: str, value: Any = None) -> None:
        self.engine, self.kind, self.value, self.resolved = engine, kind, value, kind != "poll"

    def ready(self) -> bool:
        return self.resolved or bool(self.engine.pending)

    def resolve(self) -> Any:
        if not self.resolved:  # a poll returns every sample finished on its engine, at once
            self.value, self.engine.pending = list(self.engine.pending), []
            self.resolved = True
        return self.value


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class _Engine:
    """An engine handle whose samples finish the moment they are submitted."""

    def __init__(self, index: int, score: dict[str, float], polls: list[_Ref]) -> None:
        self.index, self.pending, self.alive = index, [], True
        self.submitted: list[int] = []

        def submit(run: str, batch: list[tuple[Any, ...]], params: Any, max_length: int) -> _Ref:
            for key, _prompt, label, _, _ in batch:
                self.submitted.append(key)
                self.pending.append((key, {"key": key, "label": label, "score": score[label]}))
            return _Ref(None, "submit")

        def poll(run: str) -> _Ref:
            ref = _Ref(self, "poll")
            polls.append(ref)
            return ref

        self.fusion_submit = _Method(submit)
        self.fusion_poll = _Method(poll)
        self.fusion_set_tokenizer = _Method(lambda tok: _Ref(None, "set"))
        self.get_num_unfinished_requests = _Method(lambda: _Ref(None, "n", len(self.pending)))
        self.__ray_ready__ = _Method(lambda: _Ref(None, "ready", True))


class _ScriptedRay:
    """``ray.put/get/wait`` over the engines above: ``wait`` returns the first ready reference in
    the order given, and raises where real Ray would wait for ever."""

    def __init__(self) -> None:
        self.polls: list[_Ref] = []

    def put(self, obj: Any) -> Any:
        return obj

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        if isinstance(refs, list):
            return [r.resolve() for r in refs]
        return refs.resolve()

    def wait(self, refs: list[_Ref], num_returns: int = 1,
             timeout: float | None = None) -> tuple[list[_Ref], list[_Ref]]:
        for r in refs:
            if r.ready():
                return [r], [x for x in refs if x is not r]
        stuck = sorted(r.engine.index for r in refs if r.kind == "poll")
        raise AssertionError(f"deadlock: waiting on polls of engines {stuck}, each with "
                             "nothing left to return")


def _generator(engines: list[_Engine], dynamic_range: tuple[float, float]) -> Any:
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=N),
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off"),
                             dynamic_filtering_range=dynamic_range))

    def experience(out: dict[str, Any], **kw: Any) -> Any:
        return SimpleNamespace(key=out["key"], labels=[out["label"]],
                               scores=torch.tensor([out["score"]]))

    return SimpleNamespace(args=args, vllm_engines=engines, tokenizer=object(),
                           _process_response_into_experience=experience)


@pytest.fixture(scope="module")
def stubs():
    added = install_cpu_stubs()  # openrlhf's generator module imports vllm
    yield
    remove_cpu_stubs(added)


@pytest.fixture
def scripted(stubs, monkeypatch):
    import ray

    fake = _ScriptedRay()
    for name in ("put", "get", "wait"):
        monkeypatch.setattr(ray, name, getattr(fake, name))
    monkeypatch.setattr(streaming, "_sampling_params", lambda self, kw: SimpleNamespace())
    monkeypatch.setattr(plugin_state, "current_options", lambda: FusionOptions(stream=True))
    return fake


def test_a_filtered_prompt_in_the_middle_of_an_engines_last_batch_does_not_hang(scripted):
    # prompts 0 and 2 go to engine 0, 1 and 3 to engine 1 (stock balancing); engine 0 returns
    # first, then engine 1's one batch [p1, p1, p3, p3]: p1 (label l1) is filtered, and its
    # replacement goes to engine 0, the emptier one, while p3 is still to be counted
    score = {f"l{i}": 0.0 for i in range(8)} | {"l1": 1.0}
    engines = [_Engine(i, score, scripted.polls) for i in range(2)]
    gen = _generator(engines, dynamic_range=(-0.5, 0.75))
    loader = iter([(None, [f"prompt {i}"], [f"l{i}"], [None]) for i in range(8)])
    accepted, consumed, exhausted = streaming.fusion_generate_vllm(
        gen, loader, 4, dynamic_filtering=True, n_samples_per_prompt=N)
    assert engines[0].submitted == [0, 1, 4, 5, 8, 9] and engines[1].submitted == [2, 3, 6, 7]
    assert consumed == 5 and not exhausted
    keys = [e.key for e in accepted]
    assert sorted(keys) == [0, 1, 4, 5, 6, 7, 8, 9]  # every accepted sample once, p1 never
    assert {e.labels[0] for e in accepted} == {"l0", "l2", "l3", "l4"}
    # no poll was left on an engine with nothing to return
    assert all(r.resolved for r in scripted.polls)


@pytest.mark.parametrize("fault, message", [
    ("RayActorError", r"vLLM engine 1 died with 2 samples outstanding"),
    ("GetTimeoutError", r"vLLM engine 1 \(2 samples outstanding there\) did not answer"),
])
def test_a_dead_or_unscheduled_engine_is_an_error_naming_it(scripted, monkeypatch, fault,
                                                            message):
    import ray

    class Dead(_Engine):
        def __init__(self, *a: Any) -> None:
            super().__init__(*a)
            self.fusion_submit = _Method(lambda *args: _Ref(None, "submit"))  # never finishes

            def ready() -> _Ref:
                ref = _Ref(None, "ready")
                ref.resolve = lambda: (_ for _ in ()).throw(getattr(ray.exceptions, fault)())
                return ref

            self.__ray_ready__ = _Method(ready)

    waits = []

    def wait(refs, num_returns=1, timeout=None):  # real Ray: nothing ready within the timeout
        waits.append(timeout)
        return [], refs

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(streaming, "LIVENESS_EVERY_S", 0.0)
    score = {f"l{i}": 0.0 for i in range(4)}
    engines = [_Engine(0, score, scripted.polls), Dead(1, score, scripted.polls)]
    engines[0].fusion_submit = engines[1].fusion_submit
    loader = iter([(None, [f"prompt {i}"], [f"l{i}"], [None]) for i in range(2)])
    with pytest.raises(RolloutError, match=message):
        streaming.fusion_generate_vllm(_generator(engines, (0.0, 1.0)), loader, 2,
                                       dynamic_filtering=False, n_samples_per_prompt=N)
    assert waits  # it waited before it asked
