"""One GRPO step of the loop's pure functions equals one ``GRPOTrainer`` step of TRL.

The same tiny Qwen2 (built from a config, nothing downloaded), the same prompt and completion
tokens and the same rewards: TRL's ``GRPOTrainer.train()`` runs one optimizer step, with the
completions fixed by replacing the model's ``generate`` (it returns the prompts followed by a
fixed table of completions: different lengths, EOS, padding) and the rewards fixed by replacing
``_calculate_rewards`` on the instance. Our side takes the tokens TRL generated from and
applies what the loop's training step applies: :func:`~rlhf_fusion.algorithms.grpo_advantages`
on the rewards, :func:`~rlhf_fusion.runtime.ppo.logprobs_from_logits` on the Actor's logits,
:func:`~rlhf_fusion.algorithms.clipped_policy_loss` with
``loss_agg_mode=TRL_LOSS_TYPES[loss_type]`` (and TRL's ``beta`` as the k3 KL loss), then the
optimizer TRL builds from the same arguments (AdamW, gradient clipping to ``max_grad_norm``,
constant learning rate). The resulting parameters are compared tensor by tensor.

The loss TRL logs equals ours within 1e-6. The only difference is the order of float32
operations (TRL's ``selective_log_softmax`` and its loss in float32; the loop's
``log_softmax``/``gather`` and its loss in float64): the clipped gradients the optimizer steps
on (recorded from TRL's optimizer) agree within ``GRAD_RTOL`` of the largest component
(measured 2e-7), and one AdamW step turns that into parameter differences within
``STEP_ATOL`` = ``lr * 2e-4`` (measured 9.9e-7 at lr 1e-2): the first AdamW step moves a
parameter by ``lr * g / (|g| + eps)``, so a rounding-level change in a gradient component
near ``eps`` moves its update by a fraction of ``lr``. The optimizer is the loop's (AdamW,
``eps`` 1e-5, constant learning rate, gradients clipped to norm 1.0, no weight decay); TRL's
defaults differ (``adam_epsilon`` 1e-8, a linear learning-rate decay) and are set to match.
Every parameter is checked, and the step must move the parameters by far more than that
bound (it moves them by up to ``lr``). With ``beta`` the Ref is TRL's own (built from the same path) and equals the
policy at the first step, so the k3 term is zero there: its value and gradient away from
zero are compared in ``tests/test_algorithms.py::test_grpo_loss_matches_trl``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("trl")

from rlhf_fusion.algorithms import TRL_LOSS_TYPES, clipped_policy_loss, grpo_advantages  # noqa: E402
from rlhf_fusion.runtime.ppo import logprobs_from_logits  # noqa: E402

G = 4                 # num_generations
P = 2                 # prompts per step
L = 6                 # max_completion_length
LR = 1e-2
ADAM_EPS = 1e-5       # the loop's AdamW (PPOWorker and the critic-free worker build it so);
                      # TRL's default adam_epsilon is 1e-8: set to match
GRAD_RTOL = 1e-6      # of the largest gradient component: float32 rounding (measured: 2e-7)
STEP_ATOL = LR * 2e-4  # measured: 9.9e-7 = 1e-4 lr
PROMPTS = ["the cat sings", "hello there"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from rlhf_fusion.testing.trl import tiny_family_model_dir

    return tiny_family_model_dir(tmp_path_factory.mktemp("tiny-qwen2-step"), "qwen2", seed=3)


def completion_table(tok) -> torch.Tensor:
    """``[P*G, L]`` completions: lengths 1..L, EOS-terminated or truncated, pad after EOS."""
    gen = torch.Generator().manual_seed(5)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ids = torch.randint(2, len(tok), (P * G, L), generator=gen)
    lengths = [1, 3, L, 2, 4, L, 5, 2]   # L: truncated (no EOS); else EOS at length - 1
    for i, n in enumerate(lengths):
        if n < L:
            ids[i, n - 1] = eos
            ids[i, n:] = pad
    return ids


def fixed_rewards() -> torch.Tensor:
    """``[P*G, 1]``: varied within each group, so every group has a GRPO signal."""
    gen = torch.Generator().manual_seed(8)
    return torch.randn(P * G, 1, generator=gen, dtype=torch.float64)


def trl_step(model_dir: str, tmp_path, monkeypatch, **overrides):
    """One ``GRPOTrainer`` step; returns the trainer, the prompt tokens/mask it generated from,
    the completions and the initial parameters."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_fusion.testing.trl import byte_bpe_tokenizer

    tok = byte_bpe_tokenizer()
    table = completion_table(tok)
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=P * G,
              num_generations=G, max_completion_length=L, max_steps=1, learning_rate=LR,
              lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
              max_grad_norm=1.0, optim="adamw_torch", adam_epsilon=ADAM_EPS, bf16=False,
              use_cpu=True, report_to=[], seed=0, save_strategy="no", disable_tqdm=True,
              logging_steps=1, beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=1.0,
              scale_rewards="group")
    kw.update(overrides)
    data = Dataset.from_dict({"prompt": PROMPTS})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model_dir, reward_funcs=[lambda completions, **k: [0.0] *
                                                             len(completions)],
                              args=GRPOConfig(**kw), train_dataset=data, processing_class=tok)
    seen: dict[str, torch.Tensor] = {}

    def generate(input_ids, attention_mask=None, **_):
        assert input_ids.shape[0] == P * G
        seen["prompt_ids"], seen["prompt_mask"] = input_ids.clone(), attention_mask.clone()
        return torch.cat([input_ids, table.to(input_ids.device)], dim=1)

    monkeypatch.setattr(trainer.model, "generate", generate)
    rewards = fixed_rewards()
    monkeypatch.setattr(trainer, "_calculate_rewards", lambda *a, **k: rewards.clone())
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    make_optimizer = trainer.create_optimizer

    def create_optimizer(*a, **k):
        # the gradients the optimizer steps on (after clipping), before it zeroes them
        opt = make_optimizer(*a, **k)
        step = opt.step

        def recording_step(*sa, **sk):
            seen["grads"] = {n: q.grad.detach().clone() for n, q in
                             trainer.model.named_parameters() if q.grad is not None}
            return step(*sa, **sk)

        opt.step = recording_step
        return opt

    monkeypatch.setattr(trainer, "create_optimizer", create_optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert "prompt_ids" in seen, "TRL did not generate through model.generate"
    return trainer, seen, table, rewards, before


def our_step(model_dir: str, seen, table, rewards, *, loss_type: str, beta: float):
    """The loop's pure functions on the same tokens and rewards; returns the new parameters."""
    from transformers import AutoModelForCausalLM

    from rlhf_fusion.testing.trl import byte_bpe_tokenizer

    tok = byte_bpe_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    is_eos = table == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(table),), L))
    mask = (torch.arange(L)[None, :] <= first[:, None]).long()
    input_ids = torch.cat([seen["prompt_ids"], table], dim=1)
    attention = torch.cat([seen["prompt_mask"], mask], dim=1)
    index = torch.arange(P * G) // G
    adv, _ = grpo_advantages(rewards[:, 0], index, mask, scale_rewards="group", epsilon=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.0)
    lp = logprobs_from_logits(model(input_ids=input_ids, attention_mask=attention).logits,
                              input_ids)[:, -L:].to(torch.float64)
    with torch.no_grad():
        ref_lp = logprobs_from_logits(ref(input_ids=input_ids, attention_mask=attention).logits,
                                      input_ids)[:, -L:].to(torch.float64)
    loss, _ = clipped_policy_loss(
        lp, lp.detach(), adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
        loss_agg_mode=TRL_LOSS_TYPES[loss_type], ref_logprobs=ref_lp, kl_loss_coef=beta,
        kl_loss_type="k3", kl_ratio_correction=beta != 0, horizon=L,
        num_tokens=float(mask.sum()) if loss_type == "dapo" else None)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}, grads, float(loss.detach())


@pytest.mark.parametrize(("loss_type", "beta"), [("grpo", 0.0), ("bnpo", 0.0),
                                                  ("dr_grpo", 0.0), ("dapo", 0.04)])
def test_one_grpo_step_equals_trl(loss_type, beta, qwen_dir, tmp_path, monkeypatch):
    trainer, seen, table, rewards, before = trl_step(
        qwen_dir, tmp_path, monkeypatch, loss_type=loss_type, beta=beta,
        use_bias_correction_kl=beta != 0)
    ours, our_grads, our_loss = our_step(qwen_dir, seen, table, rewards, loss_type=loss_type,
                                         beta=beta)
    theirs = {k: v.detach() for k, v in trainer.model.named_parameters()}
    assert set(ours) == set(theirs) == set(seen["grads"]) == set(our_grads)
    # the clipped gradients TRL's optimizer stepped on: equal up to float32 rounding
    g_max = max(float(g.abs().max()) for g in seen["grads"].values())
    for k, want in seen["grads"].items():
        torch.testing.assert_close(our_grads[k], want, rtol=0, atol=GRAD_RTOL * g_max,
                                   msg=lambda m, k=k: f"{loss_type}: gradient of {k}: {m}")
    moved = 0.0
    for k, want in theirs.items():
        torch.testing.assert_close(ours[k], want, rtol=0, atol=STEP_ATOL,
                                   msg=lambda m, k=k: f"{loss_type}: parameter {k}: {m}")
        moved = max(moved, float((want - before[k]).abs().max()))
    assert moved > 100 * STEP_ATOL, "the step moved nothing: the comparison would prove nothing"
    # TRL's logged loss is the same number
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged and abs(logged[0] - our_loss) < 1e-6, (logged, our_loss)
