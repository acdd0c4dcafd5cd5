"""Critic-free advantages and the policy loss (``rlhf_fusion.algorithms``) against the peers.

What is compared, on the same inputs, in float64, within 1e-6 (``ATOL``):

* verl 0.9.1's released functions (``@pytest.mark.verl``; they skip where verl does not import,
  and fail instead under ``RLHF_FUSION_NO_SKIP=1`` in the verl CI step):
  ``compute_grpo_outcome_advantage`` (std on and off), ``compute_rloo_outcome_advantage``,
  ``compute_reinforce_plus_plus_outcome_advantage`` (several ``gamma``),
  ``compute_reinforce_plus_plus_baseline_outcome_advantage``, ``agg_loss`` (every mode),
  ``compute_policy_loss`` (asymmetric and dual clip, every aggregation) and ``kl_penalty``
  (every name, values and gradients). Inputs: several shuffled groups of different sizes
  (a group of one included, a group with tied scores), right padding, holes and an empty row.
* TRL's own trainer methods, called on real trainers built on a tiny local model:
  ``GRPOTrainer._generate_and_score_completions`` for the GRPO advantages
  (``scale_rewards`` group/batch/none) and ``RLOOTrainer._generate_and_score_completions`` for
  the RLOO advantages (also with ``beta``: the KL in the reward, the policy's and the Ref's
  per-token logprobs fixed by replacing ``_get_per_token_logps_and_entropies``), with the
  rewards fixed by replacing ``_calculate_rewards`` on the instance;
  ``RLOOTrainer._compute_loss`` (its sequence-level ratio) against :func:`clipped_policy_loss`
  on sequence sums; ``GRPOTrainer._compute_loss`` for ``loss_type`` grpo/bnpo/dr_grpo/dapo with
  ``beta`` (k3 KL loss) and clip-higher, with the policy's per-token logprobs fixed by
  replacing ``_get_per_token_logps_and_entropies`` on the instance: the loss value and its
  gradient with respect to those logprobs.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from rlhf_fusion.algorithms import (
    TRL_LOSS_TYPES,
    agg_loss,
    clipped_policy_loss,
    group_stats,
    grpo_advantages,
    kl_penalty,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlhf_fusion.runtime.ppo import kl_penalized_rewards

ATOL = 1e-6


def _peer(module: str, attr: str):
    """``module.attr``, or skip: the peer is not installed, or its import chain needs packages
    this environment does not have."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means "not available here"
        pytest.skip(f"{module} is not importable here: {type(exc).__name__}: {exc}")
    return getattr(mod, attr)


def make_case(seed: int, r: int = 12):
    """Shuffled groups of sizes 4, 3, 5, 1 and 2 (the last with tied scores); a mask with
    right padding, holes (multi-turn) and one empty row; logprobs for a loss."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [4, 3, 5, 1, 2]
    index = torch.cat([torch.full((n,), 100 + 7 * g) for g, n in enumerate(sizes)])
    b = index.numel()
    scores = torch.randn(b, generator=gen, dtype=torch.float64) * 2 + 0.5
    scores[index == index[-1]] = 0.75  # tied: std 0
    perm = torch.randperm(b, generator=gen)
    index, scores = index[perm], scores[perm]
    lens = torch.randint(1, r + 1, (b,), generator=gen)
    mask = torch.arange(r)[None, :] < lens[:, None]
    holes = torch.rand(b, r, generator=gen) < 0.2
    mask = mask & ~(holes & (torch.arange(b) % 3 == 0)[:, None])
    mask[2] = False  # an empty row
    lp = -torch.rand(b, r, generator=gen, dtype=torch.float64) * 3
    old = lp + torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.3
    ref = lp + torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.5
    return scores, index, mask, lp, old, ref


def close(got, want, what):
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------
# our own definitions, independent of any peer
# --------------------------------------------------------------------------------------------


def test_group_stats_and_baselines_by_hand():
    """The per-group mean/std and the leave-one-out baseline against a loop over groups."""
    scores, index, mask, *_ = make_case(0)
    st = group_stats(scores, index)
    adv_rloo, _ = rloo_advantages(scores, index, mask)
    adv_grpo, _ = grpo_advantages(scores, index, mask, scale_rewards="none")
    for i in range(scores.numel()):
        same = index == index[i]
        g = scores[same]
        assert st.count[i] == same.sum()
        close(st.mean[i], g.mean(), "mean")
        if g.numel() > 1:
            close(st.std[i], g.std(), "std")
            others = scores[same & (torch.arange(scores.numel()) != i)]
            want = scores[i] - others.mean()
        else:
            want = scores[i]
        close(adv_rloo[i], want * mask[i], f"rloo row {i}")
    # the two baselines differ: a test comparing them to a peer can tell them apart
    assert not torch.allclose(adv_rloo, adv_grpo)


def test_agg_modes_by_hand():
    scores, index, mask, lp, old, ref = make_case(1)
    x = torch.randn_like(lp)
    m = mask.double()
    rows = [i for i in range(x.shape[0]) if mask[i].any()]
    sums = [float((x[i] * m[i]).sum()) for i in rows]
    means = [float((x[i] * m[i]).sum() / m[i].sum()) for i in rows]
    want = {
        "token-mean": float((x * m).sum() / m.sum()),
        "token-sum": float((x * m).sum()),
        "seq-mean-token-sum": sum(sums) / len(rows),
        "seq-mean-token-mean": sum(means) / len(rows),
        "seq-mean-token-sum-norm": sum(sums) / len(rows) / x.shape[1],
    }
    x_nan = torch.where(mask, x, torch.nan)  # masked entries never leak in
    for mode, w in want.items():
        assert abs(float(agg_loss(x_nan, mask, mode)) - w) < 1e-12, mode
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(x, mask, "seq-mean")


def test_kl_loss_without_ref_logprobs_names_the_fix():
    _, _, mask, lp, old, _ = make_case(2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        clipped_policy_loss(lp, old, torch.ones_like(lp), mask, kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_penalty(lp, old, "k4")


# --------------------------------------------------------------------------------------------
# verl 0.9.1's released functions
# --------------------------------------------------------------------------------------------

CORE = "verl.trainer.ppo.core_algos"


def _outcome(scores, mask):
    """verl's ``token_level_rewards`` of an outcome score: the score on the last valid token."""
    return kl_penalized_rewards(scores, torch.zeros_like(mask, dtype=torch.float64),
                                torch.zeros_like(mask, dtype=torch.float64), mask, 0.0)


@pytest.mark.verl
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_matches_verl(seed):
    fn = _peer(CORE, "compute_grpo_outcome_advantage")
    scores, index, mask, *_ = make_case(seed)
    m = mask.double()
    rows = m.sum(-1) > 0  # verl reads the score off the tokens: an empty row has none
    for norm in (True, False):
        want, want_ret = fn(_outcome(scores, mask), m, index.numpy(), epsilon=1e-6,
                            norm_adv_by_std_in_grpo=norm)
        # the empty row's score is 0 in verl's group statistics: give ours the same score
        s0 = torch.where(rows, scores, 0.0)
        got, ret = grpo_advantages(s0, index, m, scale_rewards="group" if norm else "none",
                                   epsilon=1e-6)
        close(got, want, f"grpo norm={norm}")
        close(ret, want_ret, f"grpo returns norm={norm}")
    assert want.abs().max() > 0.1


@pytest.mark.verl
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_matches_verl(seed):
    fn = _peer(CORE, "compute_rloo_outcome_advantage")
    scores, index, mask, *_ = make_case(seed)
    m = mask.double()
    s0 = torch.where(m.sum(-1) > 0, scores, 0.0)
    want, want_ret = fn(_outcome(scores, mask), m, index.numpy())
    got, ret = rloo_advantages(s0, index, m)
    close(got, want, "rloo")
    close(ret, want_ret, "rloo returns")


@pytest.mark.verl
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_matches_verl(seed, gamma):
    fn = _peer(CORE, "compute_reinforce_plus_plus_outcome_advantage")
    algo_config = _peer("verl.trainer.config", "AlgoConfig")
    scores, index, mask, lp, _, ref = make_case(seed)
    m = mask.double()
    # KL in the reward: per-token rewards, not only the outcome
    rewards = kl_penalized_rewards(scores, lp, ref, mask, 0.05, "k1")
    want, want_ret = fn(rewards, m, config=algo_config(gamma=gamma))
    got, ret = reinforce_pp_advantages(rewards, m, gamma=gamma)
    close(got, want, f"reinforce++ gamma={gamma}")
    close(ret, want_ret, f"reinforce++ returns gamma={gamma}")


@pytest.mark.verl
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_baseline_matches_verl(seed):
    fn = _peer(CORE, "compute_reinforce_plus_plus_baseline_outcome_advantage")
    scores, index, mask, *_ = make_case(seed)
    m = mask.double()
    s0 = torch.where(m.sum(-1) > 0, scores, 0.0)
    want, want_ret = fn(_outcome(scores, mask), m, index.numpy())
    got, ret = reinforce_pp_baseline_advantages(s0, index, m)
    close(got, want, "reinforce++-baseline")
    close(ret, want_ret, "reinforce++-baseline returns")


@pytest.mark.verl
def test_agg_loss_matches_verl():
    fn = _peer(CORE, "agg_loss")
    _, _, mask, lp, old, _ = make_case(3)
    x = torch.randn_like(lp)
    m = mask.double()
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                 "seq-mean-token-sum-norm"):
        close(agg_loss(x, m, mode), fn(x, m, mode), mode)
    close(agg_loss(x, m, "seq-mean-token-sum-norm", horizon=7.0),
          fn(x, m, "seq-mean-token-sum-norm", loss_scale_factor=7), "norm with a horizon")


@pytest.mark.verl
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)])
def test_policy_loss_matches_verl(mode, clip):
    fn = _peer(CORE, "compute_policy_loss")
    scores, index, mask, lp, old, _ = make_case(4)
    m = mask.double()
    adv, _ = grpo_advantages(scores, index, m)
    adv = adv * 3  # push some ratios into the dual clip too
    lo, hi = clip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl marks compute_policy_loss deprecated
        want, clipfrac, ppo_kl, clipfrac_lower = fn(old, lp, adv, m, cliprange=0.2,
                                                    cliprange_low=lo, cliprange_high=hi,
                                                    clip_ratio_c=3.0, loss_agg_mode=mode)
    got, stats = clipped_policy_loss(lp, old, adv, m, clip_ratio_low=lo, clip_ratio_high=hi,
                                     clip_ratio_c=3.0, loss_agg_mode=mode)
    close(got, want, f"loss {mode} {clip}")
    close(stats["clip_frac"], clipfrac, "clip_frac")
    close(stats["approx_kl"], ppo_kl, "approx_kl")
    close(stats["clip_frac_lower"], clipfrac_lower, "clip_frac_lower")
    assert 0 < float(clipfrac) < 1  # the clip is exercised


@pytest.mark.verl
@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3+",
                                  "low_var_kl+", "k1+"])
def test_kl_penalty_matches_verl(name):
    fn = _peer(CORE, "kl_penalty")
    _, _, _, lp, _, ref = make_case(5)
    ref = ref.clone()
    ref[0, :4] = lp[0, :4] + torch.tensor([3.0, 25.0, -25.0, 0.1], dtype=torch.float64)  # clamps
    ours_name = "low_var_kl+" if name == "k3+" else name  # verl's k3 is its clamped k3
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    want = fn(a, ref, name)
    got = kl_penalty(b, ref, ours_name)
    close(got, want.detach(), name)
    w = torch.randn_like(lp)
    (want * w).sum().backward()
    (got * w).sum().backward()
    close(b.grad, a.grad, f"{name} gradient")


# --------------------------------------------------------------------------------------------
# TRL's own trainer methods, on real trainers
# --------------------------------------------------------------------------------------------

G = 4  # num_generations
PROMPTS = ["the cat sings", "hello there", "what is it?"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    pytest.importorskip("trl")
    from rlhf_fusion.testing.trl import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-algos"), seed=0)


def trl_trainer(algo: str, model_dir: str, tmp_path, **overrides):
    trl = pytest.importorskip("trl")
    from rlhf_fusion.testing.trl import tiny_prompt_dataset, tiny_tokenizer, vowel_reward

    cls, cfg_cls = ((trl.GRPOTrainer, trl.GRPOConfig) if algo == "grpo"
                    else (trl.RLOOTrainer, trl.RLOOConfig))
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=G,
              num_generations=G, max_completion_length=8, max_steps=1, bf16=False,
              use_cpu=True, report_to=[], seed=0, save_strategy="no", disable_tqdm=True,
              beta=0.0)
    kw.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model_dir, reward_funcs=[vowel_reward, vowel_reward],
                      args=cfg_cls(**kw), train_dataset=tiny_prompt_dataset(None, 8),
                      processing_class=tiny_tokenizer())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train otherwise
    return trainer


def fixed_rewards(seed: int) -> torch.Tensor:
    """``[B, 2]`` float64 rewards of two reward functions; the second group's are tied."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(len(PROMPTS) * G, 2, generator=gen, dtype=torch.float64)
    r[G: 2 * G] = torch.tensor([0.5, -1.0], dtype=torch.float64)
    return r


def trl_advantages(trainer, rewards: torch.Tensor, monkeypatch) -> torch.Tensor:
    """``[B]`` advantages from the trainer's own ``_generate_and_score_completions`` on fresh
    completions, with ``_calculate_rewards`` returning ``rewards``."""
    monkeypatch.setattr(trainer, "_calculate_rewards", lambda *a, **k: rewards.clone())
    out = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    assert out["advantages"].dtype == torch.float64  # the comparison runs in float64
    return out["advantages"]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_advantages_match_trl(scale_rewards, tiny_dir, tmp_path, monkeypatch):
    trainer = trl_trainer("grpo", tiny_dir, tmp_path, scale_rewards=scale_rewards,
                          reward_weights=[1.0, 0.5])
    rewards = fixed_rewards(0)
    want = trl_advantages(trainer, rewards, monkeypatch)
    scores = rewards @ torch.tensor([1.0, 0.5], dtype=torch.float64)
    index = torch.arange(scores.numel()) // G
    got, _ = grpo_advantages(scores, index, torch.ones(scores.numel(), 1),
                             scale_rewards=scale_rewards, epsilon=1e-4)
    close(got[:, 0], want, f"grpo scale_rewards={scale_rewards}")
    assert want.abs().max() > 0.1


def test_rloo_advantages_match_trl(tiny_dir, tmp_path, monkeypatch):
    trainer = trl_trainer("rloo", tiny_dir, tmp_path, normalize_advantages=False)
    rewards = fixed_rewards(1)
    want = trl_advantages(trainer, rewards, monkeypatch)
    scores = rewards.sum(-1)
    # ours takes any group order: shuffle, then put back
    perm = torch.randperm(scores.numel(), generator=torch.Generator().manual_seed(0))
    index = torch.arange(scores.numel()) // G
    got_perm, _ = rloo_advantages(scores[perm], index[perm], torch.ones(scores.numel(), 1))
    got = torch.empty_like(scores)
    got[perm] = got_perm[:, 0]
    close(got, want, "rloo")
    assert want.abs().max() > 0.1


def test_rloo_kl_in_reward_matches_trl(tiny_dir, tmp_path, monkeypatch):
    """``RLOOTrainer`` with ``beta``: the sequence's summed k1 comes off the reward before the
    leave-one-out baseline. The policy's and the Ref's per-token logprobs are fixed by replacing
    ``_get_per_token_logps_and_entropies`` on the instance."""
    from rlhf_fusion.algorithms import sequence_kl_penalized_scores

    beta = 0.3
    trainer = trl_trainer("rloo", tiny_dir, tmp_path, normalize_advantages=False, beta=beta)
    seen: dict[str, torch.Tensor] = {}

    def fixed_logps(model, input_ids, attention_mask, logits_to_keep, *a, **k):
        who = "ref" if model is trainer.ref_model else "policy"
        gen = torch.Generator().manual_seed(11 if who == "ref" else 12)
        lp = -torch.rand(input_ids.size(0), logits_to_keep, generator=gen, dtype=torch.float64)
        seen[who] = lp
        return lp, None, None

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", fixed_logps)
    rewards = fixed_rewards(2)
    monkeypatch.setattr(trainer, "_calculate_rewards", lambda *a, **k: rewards.clone())
    out = trainer._generate_and_score_completions(
        [{"prompt": p} for p in PROMPTS for _ in range(G)])
    mask = out["completion_mask"]
    assert set(seen) == {"ref", "policy"} and mask.sum() > mask.size(0)
    scores = sequence_kl_penalized_scores(rewards.sum(-1), seen["policy"], seen["ref"], mask, beta)
    got, _ = rloo_advantages(scores, torch.arange(scores.numel()) // G, torch.ones(len(scores), 1))
    close(got[:, 0], out["advantages"], "rloo with the KL in the reward")
    # the KL moved the advantages: without it they differ
    plain, _ = rloo_advantages(rewards.sum(-1), torch.arange(scores.numel()) // G,
                               torch.ones(len(scores), 1))
    assert (plain - got).abs().max() > 1e-3


def test_rloo_sequence_loss_matches_trl(tiny_dir, tmp_path, monkeypatch):
    """``RLOOTrainer._compute_loss`` clips the *sequence* ratio ``exp(sum lp - sum old lp)`` and
    averages over sequences: :func:`clipped_policy_loss` on ``[B, 1]`` sequence sums with
    ``token-mean`` is the same loss (value and gradient)."""
    trainer = trl_trainer("rloo", tiny_dir, tmp_path, epsilon=0.2, epsilon_high=0.28)
    gen = torch.Generator().manual_seed(9)
    b, r = len(PROMPTS) * G, 5
    mask = (torch.arange(r)[None, :] < torch.randint(1, r + 1, (b,), generator=gen)[:, None])
    mask = mask.long()
    lp = -torch.rand(b, r, generator=gen, dtype=torch.float64)
    old_seq = (lp * mask).sum(1) + torch.randn(b, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    inputs = {"prompt_ids": torch.ones(b, 2, dtype=torch.long),
              "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.full((b, r), 3, dtype=torch.long),
              "completion_mask": mask, "old_logps": old_seq, "advantages": adv}
    leaf_trl = lp.clone().requires_grad_(True)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *a, **k: (leaf_trl, torch.zeros_like(lp), None))
    want = trainer._compute_loss(trainer.model, inputs)
    want.backward()
    leaf = lp.clone().requires_grad_(True)
    seq = (leaf * mask).sum(1, keepdim=True)
    ones = torch.ones(b, 1)
    got, stats = clipped_policy_loss(seq, old_seq[:, None], adv[:, None], ones,
                                     clip_ratio_low=0.2, clip_ratio_high=0.28)
    got.backward()
    close(got.detach(), want.detach(), "rloo sequence loss")
    close(leaf.grad, leaf_trl.grad, "rloo sequence loss gradient")
    assert 0 < float(stats["clip_frac"]) < 1


@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_matches_trl(loss_type, correction, tiny_dir, tmp_path, monkeypatch):
    """TRL's ``_compute_loss`` with ``beta`` 0.04 (its k3 KL term, with and without
    ``use_bias_correction_kl``), ``epsilon`` 0.2 and ``epsilon_high`` 0.28, against
    :func:`clipped_policy_loss` with ``loss_agg_mode=TRL_LOSS_TYPES[loss_type]``: value and
    gradient."""
    max_len = 8
    trainer = trl_trainer("grpo", tiny_dir, tmp_path, loss_type=loss_type, beta=0.04,
                          epsilon=0.2, epsilon_high=0.28, max_completion_length=max_len,
                          use_bias_correction_kl=correction)
    gen = torch.Generator().manual_seed(7)
    b, r = len(PROMPTS) * G, 6  # r < max_completion_length: dr_grpo's horizon is the config's
    lens = torch.randint(1, r + 1, (b,), generator=gen)
    mask = (torch.arange(r)[None, :] < lens[:, None]).long()
    lp = -torch.rand(b, r, generator=gen, dtype=torch.float64) * 3
    old = lp + torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.3
    ref = lp + torch.randn(b, r, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    num_items = mask.sum() * 3 // 2  # a generation batch larger than this micro-batch
    inputs = {
        "prompt_ids": torch.ones(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.full((b, r), 3, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": num_items,
    }
    leaf_trl = lp.clone().requires_grad_(True)
    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies",
                        lambda *a, **k: (leaf_trl, torch.zeros_like(lp), None))
    want = trainer._compute_loss(trainer.model, inputs)
    want.backward()

    leaf = lp.clone().requires_grad_(True)
    got, stats = clipped_policy_loss(
        leaf, old, adv[:, None].expand(b, r), mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
        loss_agg_mode=TRL_LOSS_TYPES[loss_type], ref_logprobs=ref, kl_loss_coef=0.04,
        kl_loss_type="k3", kl_ratio_correction=correction, horizon=max_len,
        num_tokens=num_items if loss_type == "dapo" else None)
    got.backward()
    close(got.detach(), want.detach(), f"loss {loss_type}")
    close(leaf.grad, leaf_trl.grad, f"gradient {loss_type}")
    assert 0 < float(stats["clip_frac"]) < 1  # both clip bounds are in play
    assert leaf.grad.abs().max() > 1e-3
