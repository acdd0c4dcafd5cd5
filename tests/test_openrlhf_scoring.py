"""OpenRLHF integration, --fusion.stream_scoring: the Reward/Ref/Critic/Actor forwards streamed
while generation runs, on real local Ray actors: OpenRLHF's RolloutRayActor over a fake engine
with vLLM AsyncLLM's semantics (greedy), and OpenRLHF's RayActorGroup/BaseModelActor batching
over fake model actors (``testing.FakeModel``: a deterministic forward that also depends on the
padded micro-batch width, so a different micro-batch would show). The experiences are compared, tensor for tensor,
with OpenRLHF's stock make_experience_batch on the same samples."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import fields
from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf")
ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from rlhf_fusion.integrations.openrlhf import FusionOptions  # noqa: E402
from rlhf_fusion.testing.openrlhf import (  # noqa: E402
    HOOK_WITH_STUBS,
    StubTokenizer,
    fake_model_actor_class,
    install_cpu_stubs,
    remove_cpu_stubs,
)

MODEL = "fake:vocab=12,eos=0,tick_s=0.01"
PROMPTS = [f"prompt {i} " + "x" * (i % 5) for i in range(8)]
N = 2  # samples per prompt
MICRO = 2  # rollout.micro_batch_size: a micro-batch per prompt
GEN = dict(max_len=40, max_new_tokens=24, temperature=0.0, top_p=1.0)


@pytest.fixture(scope="module")
def setup():
    added = install_cpu_stubs()
    from openrlhf.trainer.ray import vllm_engine as ve
    from openrlhf.trainer.ray.launcher import RayActorGroup

    from rlhf_fusion.integrations.openrlhf import plugins
    from rlhf_fusion.integrations.openrlhf.engine import make_fusion_rollout_actor
    from rlhf_fusion.integrations.openrlhf.launch import ray_runtime_env

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env=ray_runtime_env(FusionOptions(), hook=HOOK_WITH_STUBS))
    fake = fake_model_actor_class()

    def group(kind, ranks):
        g = RayActorGroup.__new__(RayActorGroup)  # its batching is stock; the actors are fakes
        g.duplicate_actors = 1
        g._actor_handlers = [fake.options(num_cpus=0).remote(kind, ranks, r)
                             for r in range(ranks)]
        return g

    groups = {"actor": group("actor", 1), "critic": group("critic", 2),
              "reward": group("reward", 1), "ref": group("ref", 2)}
    engines = [make_fusion_rollout_actor(ve.RolloutRayActor).options(num_cpus=0).remote(
        model=MODEL, seed=i, num_gpus=0) for i in range(2)]
    ray.get([e.get_num_unfinished_requests.remote() for e in engines], timeout=180)
    ray.get([a.report.remote() for g in groups.values() for a in g._actor_handlers], timeout=180)
    yield SimpleNamespace(engines=engines, groups=groups, plugins=plugins)
    plugins.uninstall_plugins()
    ray.shutdown()
    remove_cpu_stubs(added)


def _args(**train):
    ns = SimpleNamespace
    flags = dict(colocate_all=False, colocate_actor_ref=False, colocate_critic_reward=False,
                 dynamic_batch_enable=False, async_enable=False)
    return ns(
        train=ns(**{**flags, **train}),
        rollout=ns(n_samples_per_prompt=N, batch_size=len(PROMPTS), micro_batch_size=MICRO,
                   vllm_generate_batch_size=None),
        ds=ns(ring_attn_size=1, tensor_parallel_size=1),
        algo=ns(advantage=ns(estimator="gae", gamma=1.0, lambd=0.95, no_std_norm=False,
                             is_correction_level="tis"),
                kl=ns(use_loss=False, estimator="k1", target=None, init_coef=0.01),
                dynamic_filtering_enable=False, dynamic_filtering_range=(0.0, 1.0)),
        reward=ns(clip_range=None),
        vllm=ns(enable_sleep=False),
        logger=ns(wandb=ns(key=None), tensorboard_dir=None),
        ckpt=ns(best_metric_key=""),
        data=ns(max_len=40),
    )


def _trainer(setup, args, engines=None, prompts=PROMPTS):
    """OpenRLHF's BasePPOTrainer.__init__ (as PPOTrainer calls it: generator first)."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    engines = engines or setup.engines

    class Trainer(BasePPOTrainer):
        def __init__(self):
            strategy = SimpleNamespace(args=args)
            loader = [(None, prompts[i:i + 4], [f"l{i + j}" for j in range(4)], [None] * 4)
                      for i in range(0, len(prompts), 4)]
            self.samples_generator = SamplesGenerator(strategy, loader, None, StubTokenizer(),
                                                      engines)
            g = setup.groups
            super().__init__(strategy, g["actor"], g["critic"], g["reward"], g["ref"],
                             engines, StubTokenizer())

    return Trainer()


def _reports(setup):
    return {name: [c for a in g._actor_handlers for c in ray.get(a.report.remote(), timeout=60)]
            for name, g in setup.groups.items()}


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def _stock_experiences(setup, samples):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    setup.plugins.uninstall_plugins()
    assert RemoteExperienceMaker.make_experience_batch.__module__.startswith("openrlhf.")
    trainer = _trainer(setup, _args())
    return trainer.experience_maker.make_experience_batch(samples)


def _streamed(setup, rt=None, args=None, engines=None, prompts=PROMPTS, gen_kwargs=GEN,
              **train):
    setup.plugins.uninstall_plugins()
    setup.plugins.install_plugins(FusionOptions(stream_scoring=True, rt=rt))
    trainer = _trainer(setup, args or _args(**train), engines, prompts)
    _reports(setup)  # clear
    gen = trainer.samples_generator
    samples, _, consumed, exhausted = gen.generate_samples(**gen_kwargs)
    if args is None:
        assert len(samples) == len(PROMPTS) * N and consumed == len(PROMPTS)
    during = _reports(setup)
    stock_input = copy.deepcopy(samples)
    experiences = trainer.experience_maker.make_experience_batch(samples)
    after = _reports(setup)
    return SimpleNamespace(trainer=trainer, gen=gen, samples=samples, stock_input=stock_input,
                           experiences=experiences, during=during, after=after,
                           link=gen._fusion_link)


def _check(setup, run, streamed_groups):
    # (2) the experiences are the stock make_experience_batch's, tensor for tensor
    assert run.link.used == 1 and run.link.fallbacks == 0
    want = _stock_experiences(setup, run.stock_input)
    assert len(run.experiences) == len(want) == -(-len(run.samples) // MICRO)
    for i, (got, ref) in enumerate(zip(run.experiences, want)):
        for f in fields(got):
            _same(getattr(got, f.name), getattr(ref, f.name), f"experience {i}.{f.name}")
    # (3) every sample scored exactly once by every model
    samples = Counter(tuple(s.sequences[0].tolist()) for s in run.samples)
    for name in ("actor", "critic", "reward", "ref"):
        if name == "reward" and run.samples[0].rewards is not None:
            assert not run.during[name] and not run.after[name]  # rewards came with the samples
            continue
        rows = Counter(r for calls in (run.during[name], run.after[name])
                       for _, rs in calls for r in rs)
        assert rows == samples, name
    # (1) the streamed groups started while samples were still decoding
    stats = run.gen._fusion_scoring_stats
    assert stats.live_at_first_dispatch and stats.live_at_first_dispatch > 0
    for name in streamed_groups:
        assert run.during[name], f"{name} did not run during generation"
        first = min(t for t, _ in run.during[name])
        assert first < stats.finished_at, name


def test_scoring_streams_while_decoding_and_equals_stock(setup):
    run = _streamed(setup)
    _check(setup, run, ("actor", "critic", "reward", "ref"))
    # waves: ref and critic have two data-parallel ranks, so at least one wave of two
    assert run.gen._fusion_scoring_stats.waves["ref"] >= 2


def test_scoring_with_migration_scores_each_sample_once(setup):
    run = _streamed(setup, rt=0.75)
    assert run.gen._fusion_stats.migrated, "nothing migrated; the test would prove nothing"
    _check(setup, run, ("actor", "critic", "reward", "ref"))


def test_colocated_pairs_stream_one_member_and_serialise_the_other(setup):
    run = _streamed(setup, colocate_actor_ref=True, colocate_critic_reward=True)
    _check(setup, run, ("reward", "ref"))
    assert not run.during["actor"] and not run.during["critic"]  # deferred to make_experience
    assert min(t for t, _ in run.after["actor"]) > max(t for t, _ in run.during["ref"])


REWARD_FUNC = """
import torch


def reward_func(queries, prompts, labels):
    # kept while the mean of a prompt's two scores is in (-0.5, 0.75): labels l1 and l5 score
    # 1 (filtered), the replacements (l8, l12, ...) 0 (kept), the others a coin per sample
    i = int(labels[0][1:])
    if i >= 8:
        score = 0.0
    else:
        score = 1.0 if i % 4 == 1 else float(sum(map(int, queries[0].split())) % 2)
    return {"rewards": torch.tensor(score), "scores": torch.tensor(score)}
"""


def test_dynamic_filtering_scores_only_accepted_prompts(setup, tmp_path):
    """A remote reward function (run by the executor on the engine, so already streamed) with
    dynamic filtering: filtered prompts are never scored, replacements are, and the batch is
    the stock make_experience_batch's."""
    from openrlhf.trainer.ray import vllm_engine as ve

    from rlhf_fusion.integrations.openrlhf.engine import make_fusion_rollout_actor

    path = tmp_path / "reward.py"
    path.write_text(REWARD_FUNC)
    engines = [make_fusion_rollout_actor(ve.RolloutRayActor).options(num_cpus=0).remote(
        model=MODEL, seed=10 + i, num_gpus=0, remote_rm_url=str(path)) for i in range(2)]
    try:
        ray.get([e.get_num_unfinished_requests.remote() for e in engines], timeout=180)
        args = _args()
        args.algo.dynamic_filtering_enable = True
        args.algo.dynamic_filtering_range = (-0.5, 0.75)
        prompts = [f"prompt {i} " + "y" * (i % 3) for i in range(32)]
        run = _streamed(setup, args=args, engines=engines, prompts=prompts,
                        gen_kwargs={**GEN, "temperature": 1.0})
        assert run.samples[0].rewards is not None
        labels = {e.labels[0] for e in run.samples}
        assert not {"l1", "l5"} & labels
        assert any(int(lab[1:]) >= len(PROMPTS) for lab in labels)  # replacements were drawn
        _check(setup, run, ("actor", "critic", "ref"))
    finally:
        for e in engines:
            ray.kill(e)


def test_colocate_all_keeps_the_stock_path(setup):
    setup.plugins.uninstall_plugins()
    setup.plugins.install_plugins(FusionOptions(stream_scoring=True))
    trainer = _trainer(setup, _args(colocate_all=True))
    link = trainer.samples_generator._fusion_link
    assert "colocate_all" in link.reason
    _reports(setup)
    samples, _, _, _ = trainer.samples_generator.generate_samples(**GEN)
    assert not any(_reports(setup).values())  # nothing scored during generation
    stock_input = copy.deepcopy(samples)
    got = trainer.experience_maker.make_experience_batch(samples)
    assert link.used == 0
    want = _stock_experiences(setup, stock_input)
    for a, b in zip(got, want):
        for f in fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f.name)


def test_stock_reasons():
    from rlhf_fusion.integrations.openrlhf.scoring import stock_reason

    assert stock_reason(_args()) is None
    assert "async" in stock_reason(_args(async_enable=True))
    args = _args(dynamic_batch_enable=True)
    assert "dynamic_batch" in stock_reason(args)
    args = _args()
    args.rollout.vllm_generate_batch_size = 2 * len(PROMPTS)
    assert "vllm_generate_batch_size" in stock_reason(args)
