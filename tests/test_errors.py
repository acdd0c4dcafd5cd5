"""Errors of one family that show where.

Every exception class the package defines derives from ``rlhf_fusion.errors.RLHFFusionError``
(read from the imported classes and from the source, so a module whose optional dependency is
missing is still held to the rule). Errors that show where: the step x rank grid of instruction
streams around a failure.

``format_stream_grid`` is checked on exact strings; the engine is driven through a fake comm
that fails a chosen wait, so what it appends to the error is checked without processes. The
multi-process fault tests (``tests/test_runtime.py``) check the same grid on real failures.
"""

from __future__ import annotations

import ast
import builtins
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_fusion.runtime.comm import Transfer
from rlhf_fusion.runtime.engine import EmulatedStageRunner, PipelineEngine
from rlhf_fusion.runtime.errors import (
    PeerError,
    PipelineError,
    PipelineTimeoutError,
    format_stream_grid,
)
from rlhf_fusion.runtime.fused import fused_problem, plan_from
from rlhf_fusion.schedule import Action

# --------------------------------------------------------------------------------------------
# one root
# --------------------------------------------------------------------------------------------

SRC = Path(__file__).resolve().parents[1] / "src"

# BaseExceptions on purpose, outside the root (see rlhf_fusion/errors.py): a stop request must
# pass `except Exception` wrappers, and a verl plugin that fails to load must not be swallowed
# by verl's own `except Exception`.
NOT_UNDER_THE_ROOT = {
    "rlhf_fusion.launch.RunInterrupted",
    "rlhf_fusion.integrations.verl._entry.VerlPluginLoadError",
}

# Run in a fresh interpreter: importing every module (Lightning, TRL, the test stubs) must not
# leak into the other tests of this process.
_COLLECT = r"""
import importlib, json, sys
from pathlib import Path

from rlhf_fusion.errors import RLHFFusionError

src = Path(sys.argv[1])
found, skipped = {}, {}
for path in sorted((src / "rlhf_fusion").rglob("*.py")):
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[-1] == "__main__":
        continue  # runs its command on import; the source check below reads its classes
    name = ".".join(parts)
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        missing = exc if isinstance(exc, ModuleNotFoundError) else exc.__cause__
        if (isinstance(missing, ModuleNotFoundError) and missing.name
                and missing.name.split(".")[0] != "rlhf_fusion"):
            skipped[name] = missing.name  # an optional third-party package is not installed
            continue
        raise
    for obj in list(vars(module).values()):
        if (isinstance(obj, type) and issubclass(obj, BaseException)
                and obj.__module__ == name):
            found[f"{name}.{obj.__qualname__}"] = issubclass(obj, RLHFFusionError)
print(json.dumps({"found": found, "skipped": skipped}))
"""


@pytest.fixture(scope="module")
def exception_classes() -> dict:
    out = subprocess.run([sys.executable, "-c", _COLLECT, str(SRC)], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_exception_class_derives_from_the_root(exception_classes):
    found = exception_classes["found"]
    # the reader must see the errors of each layer, or the rule below holds vacuously
    assert {"rlhf_fusion.placement.errors.PlacementError", "rlhf_fusion.loop.errors.LoopConfigError",
            "rlhf_fusion.runtime.errors.PipelineTimeoutError",
            "rlhf_fusion.schedule.evaluate.DeadlockError",
            "rlhf_fusion.rollout.types.CoordinatorTimeout"} <= set(found)
    assert len(found) >= 35
    outside = sorted(n for n, rooted in found.items() if not rooted and n not in NOT_UNDER_THE_ROOT)
    assert not outside, (f"derive these from rlhf_fusion.errors.RLHFFusionError (keeping their "
                         f"builtin base): {outside}")
    wrongly = sorted(n for n in NOT_UNDER_THE_ROOT if found.get(n))
    assert not wrongly, f"{wrongly} must stay outside the root (see rlhf_fusion/errors.py)"


def test_modules_left_unimported_miss_only_optional_packages(exception_classes):
    # Only adapters of optional third-party stacks may be skipped; the source check below still
    # reads their classes.
    skipped = exception_classes["skipped"]
    assert all(m.split(".")[1] in {"integrations", "triton_kernels", "rollout", "testing"}
               for m in skipped), skipped


_BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items()
                       if isinstance(v, type) and issubclass(v, BaseException)}


def _class_bases() -> dict[str, list[str]]:
    """``module.Class`` -> the names of its bases, for every class in the source, nested ones
    and those of modules that cannot be imported here included."""
    out = {}
    for path in (SRC / "rlhf_fusion").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                out[f"{'.'.join(parts)}.{node.name}"] = [
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                    for b in node.bases]
    return out


def test_no_class_in_the_source_derives_from_a_builtin_exception_alone():
    bad = sorted(name for name, bases in _class_bases().items()
                 if set(bases) & _BUILTIN_EXCEPTIONS and "RLHFFusionError" not in bases
                 and name not in NOT_UNDER_THE_ROOT | {"rlhf_fusion.errors.RLHFFusionError"})
    assert not bad, ("add rlhf_fusion.errors.RLHFFusionError to the bases of "
                     f"{bad} (keep the builtin after it)")


def test_the_root_is_exported_and_imports_nothing():
    import rlhf_fusion
    from rlhf_fusion.errors import RLHFFusionError

    assert rlhf_fusion.RLHFFusionError is RLHFFusionError
    tree = ast.parse((SRC / "rlhf_fusion" / "errors.py").read_text())
    assert [type(n).__name__ for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))] == ["ImportFrom"]  # __future__


def _tiny_loop_config(world: int, **kw):
    from rlhf_fusion.loop.config import (
        FusionLoopConfig,
        GenerationConfig,
        ModelsConfig,
        PPOLoopConfig,
        RLHFConfig,
    )

    return RLHFConfig(
        models=ModelsConfig(actor={"family": "llama", "layers": 2, "hidden": 16}, seed=3),
        generation=GenerationConfig(prompts_per_iteration=4, max_new_tokens=4, seed=5),
        ppo=PPOLoopConfig(num_ppo_epochs=1, num_mini_batches=1, micro_batches=2),
        fusion=FusionLoopConfig(inter=False, intra=False), world_size=world, iterations=1, **kw)


def test_the_workers_config_faults_are_ours_and_still_the_builtin_they_were():
    """The three faults PPOWorker raised as a bare ValueError / RuntimeError, before it builds
    anything, each with its message unchanged."""
    import dataclasses

    import torch.distributed as dist

    from rlhf_fusion.errors import RLHFFusionError
    from rlhf_fusion.loop import PlacementSection, PPOWorker
    from rlhf_fusion.loop.errors import LoopConfigError, LoopLaunchError
    from rlhf_fusion.loop.placement import PlacementConfigError, placement_of

    with pytest.raises(LoopLaunchError, match=r"a placement needs torch.distributed "
                                              r"initialised with world_size=2 ranks") as got:
        PPOWorker(_tiny_loop_config(2, placement=PlacementSection(preset="colocated")))
    assert isinstance(got.value, RuntimeError)

    cfg = _tiny_loop_config(1)
    lp = placement_of(cfg)
    calls = {**lp.calls, "actor_train": dataclasses.replace(lp.calls["actor_train"],
                                                             kind="expert_parallel")}
    with pytest.raises(PlacementConfigError, match="training layout 'expert_parallel'; the "
                                                   "loop runs data_parallel") as got:
        PPOWorker(cfg, placement=dataclasses.replace(lp, calls=calls))
    assert isinstance(got.value, ValueError)

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(LoopConfigError, match="world_size: the config says 2, the process "
                                                  "group has 1 ranks") as got:
            PPOWorker(_tiny_loop_config(2))
    finally:
        dist.destroy_process_group()
    assert isinstance(got.value, ValueError) and isinstance(got.value, RLHFFusionError)


# --------------------------------------------------------------------------------------------
# the formatter
# --------------------------------------------------------------------------------------------


def test_grid_window_marker_and_elisions():
    streams = {
        0: [f"a{i}" for i in range(11)],
        1: [f"bb{i}" for i in range(6)],
    }
    got = format_stream_grid(streams, 1, 4, before=2, after=3)
    assert got == (
        "         rank 0   rank 1\n"
        "...\n"
        "step 2:  a2       bb2\n"
        "step 3:  a3       bb3\n"
        "step 4:  a4      >bb4<\n"
        "step 5:  a5       bb5\n"
        "step 6:  a6\n"
        "step 7:  a7\n"
        "..."
    )


def test_grid_default_window_whole_short_streams_and_rank_labels():
    # ranks need not start at 0 (replica 1 of a 2-group plan is ranks 2 and 3)
    streams = {3: ["actor0:1RECV_F0@0", "actor0:1F0"], 2: ["actor0:0F0", "actor0:0SEND_F0@1"]}
    got = format_stream_grid(streams, 3, 0)
    assert got == (
        "         rank 2              rank 3\n"
        "step 0:  actor0:0F0         >actor0:1RECV_F0@0<\n"
        "step 1:  actor0:0SEND_F0@1   actor0:1F0"
    )


def test_grid_failure_after_the_last_instruction():
    got = format_stream_grid({0: ["x", "y"], 2: ["F0", "SEND_F0@0", "B0"]}, 0, 2, before=3)
    assert got == (
        "         rank 0          rank 2\n"
        "step 0:  x               F0\n"
        "step 1:  y               SEND_F0@0\n"
        "step 2: >end of stream<  B0"
    )


def test_grid_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank 5"):
        format_stream_grid({0: ["x"]}, 5, 0)
    with pytest.raises(ValueError, match=">= 0"):
        format_stream_grid({0: ["x"]}, 0, -1)


# --------------------------------------------------------------------------------------------
# the engine adds the grid to the error
# --------------------------------------------------------------------------------------------


def _plan():
    # rank 0: actor stage 0 + critic stage 1; rank 1: actor stage 1 + critic stage 0
    return plan_from(fused_problem(stage_groups=2, micro_batches=2), solver="concatenated_1f1b")


class FakeComm:
    """The part of PipelineComm the engine uses; fails where the test says."""

    def __init__(self, rank: int, *, recv_fail=None, send_fail=None, flush_fail=None):
        self.rank = rank
        self.recv_fail, self.send_fail, self.flush_fail = recv_fail, send_fail, flush_fail

    def where(self) -> str:
        return f"rank {self.rank} (replica 0, stage group {self.rank})"

    def post_receives(self, stream) -> None:
        pass

    def recv(self, a: Action) -> torch.Tensor:
        if str(a) == self.recv_fail:
            err = PipelineTimeoutError(
                f"{self.where()} timed out after 2 s waiting for {Transfer.of(a).describe()} "
                "from rank 0; that rank stalled or died"
            )
            err.transfer = Transfer.of(a)
            raise err
        return torch.zeros(4, 16, 8)

    def send_header(self, a, shape, dtype) -> None:
        pass

    def send(self, tensor, a: Action) -> None:
        if self.send_fail is not None and str(a) == self.send_fail[0]:
            # reclaiming an older send while starting this one: that older send failed
            err = PipelineTimeoutError(f"{self.where()} timed out sending; a peer stalled")
            err.transfer = Transfer.of(Action.parse(self.send_fail[1]))
            raise err

    def flush_sends(self) -> None:
        if self.flush_fail is not None:
            err = PeerError(f"{self.where()} failed sending: connection reset")
            err.transfer = Transfer.of(Action.parse(self.flush_fail))
            raise err


def _engine(comm: FakeComm, plan=None, **kw) -> PipelineEngine:
    plan = plan or _plan()
    runners = {
        "actor": EmulatedStageRunner(0.0, 0.0, is_first=comm.rank == 0, is_last=comm.rank == 1),
        "critic": EmulatedStageRunner(0.0, 0.0, is_first=comm.rank == 1, is_last=comm.rank == 0),
    }
    return PipelineEngine(plan, comm, runners, **kw)  # type: ignore[arg-type]


def test_receive_timeout_shows_the_streams_around_it():
    engine = _engine(FakeComm(1, recv_fail="actor0:1RECV_F1@0"))
    with pytest.raises(PipelineTimeoutError) as info:
        engine.run(None)
    msg = str(info.value)
    first, rest = msg.split("\n\n", 1)
    # the first line is what it was before the grid existed
    assert first == (
        "rank 1 (replica 0, stage group 1) timed out after 2 s waiting for actor copy 0 stage 1 "
        "input activation of micro-batch 1 (from stage 0) from rank 0; that rank stalled or died"
    )
    assert rest == (
        "rank 1 failed at step 4 of its instruction stream (actor0:1RECV_F1@0); the streams of "
        "replica 0 around it (>x< marks the failing spot):\n"
        "         rank 0              rank 1\n"
        "...\n"
        "step 1:  actor0:0SEND_F0@1   actor0:1F0\n"
        "step 2:  actor0:0F1          actor0:1B0\n"
        "step 3:  actor0:0SEND_F1@1   actor0:1SEND_B0@0\n"
        "step 4:  actor0:0RECV_B0@1  >actor0:1RECV_F1@0<\n"
        "step 5:  actor0:0B0          actor0:1F1\n"
        "step 6:  actor0:0RECV_B1@1   actor0:1B1\n"
        "step 7:  actor0:0B1          actor0:1SEND_B1@0\n"
        "..."
    )
    assert info.value.schedule == rest


def test_failed_send_is_marked_where_it_was_sent():
    # Starting critic0:0SEND_F1@0 (step 11) reclaims critic0:0SEND_F0@0 (step 9), which failed.
    comm = FakeComm(1, send_fail=("critic0:0SEND_F1@0", "critic0:0SEND_F0@0"))
    with pytest.raises(PipelineTimeoutError) as info:
        _engine(comm).run(None)
    msg = str(info.value)
    assert msg.startswith("rank 1 (replica 0, stage group 1) timed out sending; a peer stalled\n\n")
    assert (
        "rank 1 failed at step 9 of its instruction stream (critic0:0SEND_F0@0), having reached "
        "step 11;" in msg
    )
    assert "\nstep 9:   critic0:1F0         >critic0:0SEND_F0@0<\n" in msg


def test_failure_while_finishing_sends():
    comm = FakeComm(1, flush_fail="critic0:0SEND_F1@0")
    with pytest.raises(PeerError) as info:
        _engine(comm).run(None)
    msg = str(info.value)
    assert (
        "rank 1 failed at step 11 of its instruction stream (critic0:0SEND_F1@0), while finishing "
        "its sends after the last step;" in msg
    )
    assert "\nstep 11:  critic0:1SEND_B0@1  >critic0:0SEND_F1@0<\n" in msg


def test_grid_shows_the_stream_the_rank_actually_ran():
    plan = _plan()
    own = list(plan.stream(1))
    own[0], own[4] = own[4], own[0]  # RECV_F1 first: this rank's stream differs from the plan's
    with pytest.raises(PipelineTimeoutError) as info:
        _engine(FakeComm(1, recv_fail="actor0:1RECV_F1@0"), plan).run(None, stream=own)
    assert "\nstep 0:  actor0:0F0         >actor0:1RECV_F1@0<\n" in str(info.value)


def test_other_exceptions_get_the_grid_as_a_note():
    class Boom(EmulatedStageRunner):
        def backward(self, key, grad):  # noqa: ANN001, ANN201
            raise ValueError("out of memory")

    engine = _engine(FakeComm(0))
    engine.runners["actor"] = Boom(0.0, 0.0, is_first=True, is_last=False)
    with pytest.raises(ValueError) as info:
        engine.run(None)
    assert str(info.value) == "out of memory"  # the message itself is left alone
    if not hasattr(info.value, "add_note"):
        pytest.skip("exception notes need Python 3.11")
    (note,) = info.value.__notes__
    assert note.startswith("rank 0 failed at step 5 of its instruction stream (actor0:0B0);")
    assert "\nstep 5: >actor0:0B0<          actor0:1F1\n" in note


def test_the_grid_is_appended_once():
    err = PipelineError("first line")
    err.add_schedule("grid A")
    err.add_schedule("grid B")
    assert str(err) == "first line\n\ngrid A"
