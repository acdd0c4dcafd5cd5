"""The OpenRLHF versions and private seams this integration patches, checked at start.

OpenRLHF has no plugin API: the integration replaces methods by name and reads its CLI module's
source. A release that renames or re-signs one of them must fail here, with the supported range,
not midway through a Ray job.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import textwrap
from pathlib import Path

from ...errors import RLHFFusionError
from .._versions import check_supported, installed, supported_text
from .plugin_state import STOCK

__all__ = ["SUPPORTED", "OpenRLHFVersionError", "check_seams", "check_version"]

SUPPORTED = (">=0.11.2", "<0.12")  # verified against 0.11.2; the seams below guard the rest
SUPPORTED_TEXT = supported_text("openrlhf", SUPPORTED)
TRAIN_MODULE = "openrlhf.cli.train_ppo_ray"


class OpenRLHFVersionError(RLHFFusionError, RuntimeError):
    """OpenRLHF missing, or a version whose seams differ from the ones patched here."""


def installed_version() -> str:
    return installed("openrlhf", SUPPORTED, OpenRLHFVersionError)


def check_version(version: str | None = None) -> str:
    """The installed (or given) OpenRLHF version if supported, else an OpenRLHFVersionError."""
    return check_supported(
        "openrlhf", installed_version() if version is None else version, SUPPORTED,
        OpenRLHFVersionError, "pip install 'openrlhf==0.11.2' or run OpenRLHF stock")


def _params(fn: object) -> list[str]:
    # Ray adds _ray_trace_ctx to the methods of an actor class
    return [p for p in inspect.signature(fn).parameters  # type: ignore[arg-type]
            if p != "_ray_trace_ctx"]


def _expect(where: str, got: list[str], want: list[str], version: str) -> None:
    if got != want:
        raise OpenRLHFVersionError(
            f"openrlhf {version}: {where} takes {got}, the integration patches {want}; "
            f"install {SUPPORTED_TEXT}")


# The stock bodies the integration copies or reproduces, hashed as in openrlhf 0.11.2
# (``body_hash``). A release that keeps a signature but changes the body (0.11.1 -> 0.11.2
# changed _dispatch_prompts_to_vllm's sampling parameters) must be re-read before it is trusted.
STOCK_BODIES: dict[str, str] = {
    # streaming: the collection loop, the sampling parameters and prompt balancing
    "SamplesGenerator._generate_vllm": "906d7c8a7369b6be",
    "SamplesGenerator._dispatch_prompts_to_vllm": "b80c3469cb996d47",
    # engine: generate's media-token dedup and prompt building
    "RolloutRayActor.generate": "1ef9bc2ba447baf6",
    # --fusion.gae: the recursion and its mask semantics
    "RemoteExperienceMaker.get_advantages_and_returns": "df55c3229effb53f",
    # --fusion.stream_scoring: the micro-batching and the group dispatch it reproduces
    "RemoteExperienceMaker.split_rollout_samples": "4666b971b926e2cb",
    "RayActorGroup.async_run_method_batch": "8bbc7ba8d7f7ecd9",
}


def body_hash(fn: object) -> str:
    """sha256 (16 hex digits) of a function's source, dedented, trailing spaces stripped."""
    src = textwrap.dedent(inspect.getsource(fn))  # type: ignore[arg-type]
    src = "\n".join(line.rstrip() for line in src.splitlines())
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _check_body(where: str, fn: object, version: str) -> None:
    if getattr(fn, "__module__", "").startswith("rlhf_fusion"):  # installed: check stock's
        name = where.rpartition(".")[2]
        fn = next(st[name] for st in STOCK.values() if name in st)
    got = body_hash(fn)
    if got != STOCK_BODIES[where]:
        raise OpenRLHFVersionError(
            f"openrlhf {version}: the body of {where} differs from openrlhf 0.11.2's (source "
            f"hash {got}, expected {STOCK_BODIES[where]}); the integration copies it, so it "
            f"must be re-read for this release. Install {SUPPORTED_TEXT} (openrlhf==0.11.2) "
            "or run OpenRLHF stock")


def check_train_module(version: str) -> Path:
    """``train_ppo_ray``'s file, after checking that ``train(args)`` skips ``ray.init`` when Ray
    is up and that the parser runs under ``__main__`` (read, not imported: the launcher runs
    the module as ``__main__`` once, with the stock argv)."""
    spec = importlib.util.find_spec(TRAIN_MODULE)
    if spec is None or spec.origin is None:
        raise OpenRLHFVersionError(f"openrlhf {version} has no {TRAIN_MODULE}; "
                                   f"install {SUPPORTED_TEXT}")
    src = Path(spec.origin).read_text()
    for needle in ("def train(args)", "if not ray.is_initialized()", 'if __name__ == "__main__"'):
        if needle not in src:
            raise OpenRLHFVersionError(f"openrlhf {version}: {TRAIN_MODULE} lacks {needle!r}, "
                                       f"which the launcher relies on; install {SUPPORTED_TEXT}")
    return Path(spec.origin)


def _source_has(where: str, obj: object, needles: tuple[str, ...], version: str) -> None:
    src = inspect.getsource(obj)  # type: ignore[arg-type]
    for needle in needles:
        if needle not in src:
            raise OpenRLHFVersionError(f"openrlhf {version}: {where} lacks {needle!r}, which "
                                       f"the integration relies on; install {SUPPORTED_TEXT}")


def check_scoring_seams(version: str) -> None:
    """The seams of ``--fusion.stream_scoring`` (``scoring.py``): the maker's three methods it
    answers from the stream, what their stock bodies call, the actor-group batching it
    reproduces per wave, and the trainer constructor it links generator and maker in."""
    em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
    ex = importlib.import_module("openrlhf.trainer.ppo_utils.experience")
    la = importlib.import_module("openrlhf.trainer.ray.launcher")
    pt = importlib.import_module("openrlhf.trainer.ppo_trainer")
    sg = importlib.import_module("openrlhf.trainer.ppo_utils.samples_generator")
    maker = em.RemoteExperienceMaker
    for name, want in (("make_experience_batch", ["self", "rollout_samples"]),
                       ("split_rollout_samples", ["self", "rollout_samples"]),
                       ("make_experience", ["self", "samples_list"]),
                       ("_dispatch_forward", ["self", "group", "sync_condition", "kwargs"]),
                       ("_flatten_results", ["self", "refs", "duplicate_factor"])):
        _expect(f"RemoteExperienceMaker.{name}", _params(getattr(maker, name)), want, version)
    _source_has("RemoteExperienceMaker.make_experience_batch", maker.make_experience_batch,
                ("self.split_rollout_samples(rollout_samples)", "self.make_experience(samples_list)",
                 "self.compute_advantages_and_returns(experiences)"), version)
    _source_has("RemoteExperienceMaker.split_rollout_samples", maker.split_rollout_samples,
                ("sample.index = [i]", "self.args.rollout.micro_batch_size",
                 "Experience.concat_experiences(", "self.tokenizer.pad_token_id"), version)
    _source_has("RemoteExperienceMaker.make_experience", maker.make_experience,
                ("samples_list[0].rewards is None", "self.reward_model_group",
                 "self.actor_model_group", "self.critic_model_group", "self.initial_model_group",
                 "self._dispatch_forward(", "pad_sequence=[True] * len(samples_list)",
                 'vlm_forward_kwargs["mm_train_inputs_list"]'), version)
    _source_has("RemoteExperienceMaker._dispatch_forward", maker._dispatch_forward,
                ('async_run_method_batch(method_name="forward"',), version)
    _check_body("RemoteExperienceMaker.split_rollout_samples", maker.split_rollout_samples,
                version)
    _check_body("RayActorGroup.async_run_method_batch", la.RayActorGroup.async_run_method_batch,
                version)
    _source_has("RemoteExperienceMaker._flatten_results", maker._flatten_results,
                ("[::duplicate_factor]",), version)
    group = la.RayActorGroup
    _expect("RayActorGroup.async_run_method_batch", _params(group.async_run_method_batch),
            ["self", "method_name", "kwargs"], version)
    _expect("RayActorGroup.async_run_method", _params(group.async_run_method),
            ["self", "method_name", "args", "kwargs"], version)
    _source_has("RayActorGroup.async_run_method_batch", group.async_run_method_batch,
                ("self._actor_handlers", "self.duplicate_actors", "execute_batch.remote("),
                version)
    _expect("BaseModelActor.execute_batch", _params(la.BaseModelActor.execute_batch),
            ["self", "method_name", "all_data", "start_idx", "end_idx"], version)
    _expect("Experience.concat_experiences", _params(ex.Experience.concat_experiences),
            ["experiences_list", "pad_token_id"], version)
    _expect("BasePPOTrainer.__init__", _params(pt.BasePPOTrainer.__init__),
            ["self", "strategy", "actor_model_group", "critic_model_group", "reward_model_group",
             "reference_model_group", "vllm_engines", "tokenizer"], version)
    _source_has("BasePPOTrainer.__init__", pt.BasePPOTrainer.__init__,
                ("self.experience_maker = RemoteExperienceMaker(",), version)
    _source_has("SamplesGenerator.generate_samples", sg.SamplesGenerator.generate_samples,
                ("self._sample_buffer", "dataloader_iter=self._dataloader_iter",
                 "rollout_samples = self._sample_buffer[:chunk_size]"), version)


def check_seams(*, gae: bool = True, stream: bool = True, scoring: bool = True) -> str:
    """Import the patched modules and check every seam; returns the version."""
    version = check_version()
    check_train_module(version)
    if scoring:
        check_scoring_seams(version)
    if gae:
        em = importlib.import_module("openrlhf.trainer.ppo_utils.experience_maker")
        _expect("RemoteExperienceMaker.get_advantages_and_returns",
                _params(em.RemoteExperienceMaker.get_advantages_and_returns),
                ["self", "values", "rewards", "action_mask", "gamma", "lambd"], version)
        _check_body("RemoteExperienceMaker.get_advantages_and_returns",
                    em.RemoteExperienceMaker.get_advantages_and_returns, version)
    if stream:
        sg = importlib.import_module("openrlhf.trainer.ppo_utils.samples_generator")
        _expect("SamplesGenerator._generate_vllm", _params(sg.SamplesGenerator._generate_vllm),
                ["self", "dataloader_iter", "num_prompts", "dynamic_filtering",
                 "generate_kwargs"], version)
        _expect("SamplesGenerator._dispatch_prompts_to_vllm",
                _params(sg.SamplesGenerator._dispatch_prompts_to_vllm),
                ["self", "prompts", "labels", "images", "generate_kwargs"], version)
        _expect("SamplesGenerator._process_response_into_experience",
                _params(sg.SamplesGenerator._process_response_into_experience),
                ["self", "response", "generate_kwargs"], version)
        _check_body("SamplesGenerator._generate_vllm", sg.SamplesGenerator._generate_vllm,
                    version)
        _check_body("SamplesGenerator._dispatch_prompts_to_vllm",
                    sg.SamplesGenerator._dispatch_prompts_to_vllm, version)
        pt = importlib.import_module("openrlhf.trainer.ppo_trainer")
        _expect("BasePPOTrainer.train_step", _params(pt.BasePPOTrainer.train_step),
                ["self", "rollout_samples", "global_step"], version)
        if not callable(getattr(sg, "_collect_prompt_batch", None)):
            raise OpenRLHFVersionError(f"openrlhf {version}: samples_generator has no "
                                       f"_collect_prompt_batch; install {SUPPORTED_TEXT}")
        ve = importlib.import_module("openrlhf.trainer.ray.vllm_engine")
        stock_actor = STOCK.get("stream", {}).get("RolloutRayActor", ve.RolloutRayActor)
        actor = getattr(getattr(stock_actor, "__ray_metadata__", None),
                        "modified_class", None)
        if actor is None:
            raise OpenRLHFVersionError(f"openrlhf {version}: RolloutRayActor is not a Ray actor "
                                       f"class; install {SUPPORTED_TEXT}")
        _expect("RolloutRayActor.generate", _params(actor.generate),
                ["self", "prompt_token_ids", "sampling_params", "multi_modal_data"], version)
        _check_body("RolloutRayActor.generate", actor.generate, version)
        _expect("create_vllm_engines' RolloutRayActor lookup",
                ["RolloutRayActor"] if "RolloutRayActor" in ve.create_vllm_engines.__code__.co_names
                else [], ["RolloutRayActor"], version)
    return version
