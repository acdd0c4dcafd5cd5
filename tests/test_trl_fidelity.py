"""FusedGRPOTrainer / FusedRLOOTrainer with plugins on sample from the policy and score the true
Ref, on tiny GPT-2 and Qwen2 models with a byte-level BPE tokenizer (unlike the Llama and
character tokenizer of test_trl_grpo.py).

- Generation: every generated token's logprob equals the policy's teacher-forced logprob of
  that token at the time it was generated (TRL 1.16 patches the policy's ``forward``; a copy
  that kept the patch sampled from the live model, context-free, up to 0.21 away).
- PEFT: TRL's Ref pass is the policy with its adapters disabled; what the fused trainer answers
  there equals that forward, and the logged KL is not zero.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings

import pytest

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from trl import GRPOConfig, RLOOConfig  # noqa: E402

from rlhf_fusion.integrations.trl.compat import generation_copy  # noqa: E402
from rlhf_fusion.integrations.trl.grpo import FusedGRPOTrainer  # noqa: E402
from rlhf_fusion.integrations.trl.rloo import FusedRLOOTrainer  # noqa: E402
from rlhf_fusion.testing.trl import (  # noqa: E402
    byte_bpe_tokenizer,
    length_reward,
    tiny_causal_lm,
    tiny_family_model_dir,
    tiny_prompt_dataset,
    vowel_reward,
)

ALGOS = {"grpo": (FusedGRPOTrainer, GRPOConfig), "rloo": (FusedRLOOTrainer, RLOOConfig)}
TEMPERATURE = 0.7
# Generation runs the copy in float32 with paged attention, one token at a time; the teacher-
# forced pass runs the whole sequence at once with TRL's attention: the same float32 arithmetic
# in another order (measured <= 2e-6 on every TRL in CI). The defect this guards against was
# 1e-1 (a context-free forward of the live model in train mode).
GEN_TOL = 1e-4
# The Ref logprobs are TRL's own forward of the adapter-disabled policy, on micro-batches
# instead of the full batch: row-wise identical arithmetic up to padding width.
REF_TOL = 1e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {f: tiny_family_model_dir(tmp_path_factory.mktemp(f), f, seed=3)
            for f in ("gpt2", "qwen2")}


def make(algo, model_dir, tmp_path, **overrides):
    cls, config_cls = ALGOS[algo]
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=6,
              num_generations=3, max_completion_length=12, max_steps=2, learning_rate=5e-2,
              beta=0.04, temperature=TEMPERATURE, bf16=False, use_cpu=True, report_to=[],
              logging_steps=1, seed=0, save_strategy="no", disable_tqdm=True)
    peft_config = overrides.pop("peft_config", None)
    kw.update(overrides)
    extra = {} if peft_config is None else {"peft_config": peft_config}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model_dir, reward_funcs=[vowel_reward, length_reward],
                      args=config_cls(**kw), train_dataset=tiny_prompt_dataset(None, 12),
                      processing_class=byte_bpe_tokenizer(), **extra)
    trainer.stream_micro_batch = 2  # several scoring micro-batches per generation batch
    trainer.model.train()
    return trainer


def token_logps(net, ids, mask, keep):
    """Per-token logprobs of the last ``keep`` tokens of ``ids`` at TRL's temperature, from the
    model's plain forward (TRL 1.16's patched forward without ``fused_lm_head`` is the
    original one)."""
    logits = net(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1].float()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return logp.gather(-1, ids[:, -keep:, None])[..., 0]


def test_generation_copy_drops_what_was_patched_onto_the_instance():
    """On every TRL, including those that patch nothing: a per-instance ``forward`` made the
    way TRL 1.16's ``add_fused_lm_head`` makes it (closing over the live bound forward)."""
    model = tiny_causal_lm(40)
    live_forward = model.forward
    calls = []

    def patched(self, *args, **kwargs):
        calls.append(self)
        return live_forward(*args, **kwargs)

    model.forward = types.MethodType(patched, model)
    clone = generation_copy(model)
    assert "forward" in vars(model) and "forward" not in vars(clone)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        calls.clear()
        got = clone(input_ids=ids).logits
    assert calls == []  # the copy never ran the live model
    assert torch.equal(got, want)
    live = {p.data_ptr() for p in model.parameters()}
    assert not live & {p.data_ptr() for p in clone.parameters()}


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_generation_logprobs_are_the_policys(algo, family, model_dirs, tmp_path, monkeypatch):
    trainer = make(algo, model_dirs[family], tmp_path)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    seen = []
    real = trainer._fused_rollout

    def record(prompt_ids, batch):
        results = real(prompt_ids, batch)
        # Teacher-forced now, before the optimizer moves the policy; eval mode: the policy's
        # distribution is the one without dropout (GPT-2 has dropout 0.1).
        was_training = policy.training
        policy.eval()
        with torch.no_grad():
            for r in results:
                ids = torch.tensor([list(r.prompt_ids) + list(r.token_ids)])
                want = token_logps(policy, ids, torch.ones_like(ids), len(r.token_ids))[0]
                seen.append((want - torch.tensor(r.logprobs)).abs().max().item())
        policy.train(was_training)
        return results

    monkeypatch.setattr(trainer, "_fused_rollout", record)
    trainer.train()  # two steps: the second generation runs on weights pushed after a step
    assert len(seen) == 2 * 6
    print(f"trl {trl.__version__} {algo} {family}: max |generation - teacher-forced| = "
          f"{max(seen):.3g}", file=sys.stderr)
    assert max(seen) < GEN_TOL


@contextlib.contextmanager
def ref_pass_flag(trainer, monkeypatch):
    """Sets ``flag["ref"]`` while TRL (or the fused trainer) runs a PEFT Ref pass, which both
    enter through the trainer module's ``use_adapter``."""
    module = sys.modules[trainer._stock.__module__]
    real = module.use_adapter
    flag = {"ref": False}

    @contextlib.contextmanager
    def spy(model, adapter_name):
        with real(model, adapter_name=adapter_name):
            flag["ref"] = True
            try:
                yield
            finally:
                flag["ref"] = False

    monkeypatch.setattr(module, "use_adapter", spy)
    yield flag


@pytest.mark.parametrize(("algo", "family", "iterations"),
                         [("grpo", "gpt2", 2), ("grpo", "qwen2", 1), ("rloo", "qwen2", 1),
                          ("rloo", "gpt2", 1)])
def test_peft_ref_is_the_adapter_free_forward(algo, family, iterations, model_dirs, tmp_path,
                                              monkeypatch):
    peft = pytest.importorskip("peft")
    # Random A and B (init_lora_weights=False): the adapter changes the policy from the start,
    # so Ref != policy and the KL is not zero from the first step.
    lora = peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear",
                           init_lora_weights=False, task_type="CAUSAL_LM")
    extra = {"num_iterations": iterations} if algo == "grpo" else {}
    # disable_dropout: the Ref pass runs the policy in train mode; GPT-2's dropout would make
    # two forwards differ.
    trainer = make(algo, model_dirs[family], tmp_path, peft_config=lora, disable_dropout=True,
                   **extra)
    assert trainer.ref_model is None  # TRL's PEFT Ref: the policy with adapters disabled
    if algo == "grpo":
        assert trainer._needs_old_logps() == (iterations > 1)
    net = trainer.accelerator.unwrap_model(trainer.model)
    answers = []
    real = trainer._get_per_token_logps_and_entropies
    with ref_pass_flag(trainer, monkeypatch) as flag:
        def record(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            out = real(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            answers.append((flag["ref"], input_ids, attention_mask, logits_to_keep, out[0]))
            return out

        monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", record)
        stock_calls = []
        stock = trainer._stock._get_per_token_logps_and_entropies

        def count(self, model, input_ids, *args, **kwargs):
            stock_calls.append((flag["ref"], input_ids.size(0)))
            return stock(self, model, input_ids, *args, **kwargs)

        monkeypatch.setattr(trainer._stock, "_get_per_token_logps_and_entropies", count)
        inputs = [{"prompt": p} for p in ("the cat sings", "hello there") for _ in range(3)]
        out = trainer._generate_and_score_completions(inputs)

    refs = [a for a in answers if a[0]]
    assert len(refs) == 1
    _, ids, mask, keep, got = refs[0]
    completion = mask[:, -keep:].bool()
    with torch.no_grad():
        with net.disable_adapter():
            want = token_logps(net, ids, mask, keep)
        policy = token_logps(net, ids, mask, keep)
    ref_diff = (got - want)[completion].abs().max().item()
    gap = (policy - want)[completion].abs().max().item()
    if algo == "grpo":
        assert torch.equal(out["ref_per_token_logps"], got)
        trainer.current_gradient_accumulation_steps = 1  # Trainer.train sets it otherwise
        trainer.compute_loss(trainer.model, out)
    kl = trainer._metrics["train"]["kl"][-1]
    print(f"trl {trl.__version__} {algo} {family} peft: max |Ref - adapter-free| = "
          f"{ref_diff:.3g}, max |policy - Ref| = {gap:.3g}, kl = {kl:.4g}", file=sys.stderr)
    assert ref_diff < REF_TOL
    assert gap > 1e-2  # the adapter matters, so answering the policy's logprobs would fail
    assert abs(kl) > 1e-4
    # Streamed: the Ref pass was scored in micro-batches while decoding, never on the batch.
    assert any(ref and rows <= 2 for ref, rows in stock_calls)
    assert not any(ref and rows == len(inputs) for ref, rows in stock_calls)
