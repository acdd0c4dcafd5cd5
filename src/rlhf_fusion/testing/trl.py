"""Tiny, locally built models, tokenizers and prompt datasets for TRL trainer tests.

Nothing is downloaded: the tokenizer is a character-level ``tokenizers`` WordLevel model and
the models are built from configs with a fixed seed, so two calls give bit-identical weights
(what "fused equals stock" tests compare). Reward functions follow TRL's
``f(prompts, completions, **kwargs) -> list[float]`` convention.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHARS",
    "byte_bpe_tokenizer",
    "tiny_family_model_dir",
    "tiny_causal_lm",
    "tiny_model_dir",
    "tiny_prompt_dataset",
    "tiny_tokenizer",
    "vowel_reward",
    "length_reward",
]

CHARS = "abcdefghijklmnopqrstuvwxyz .,:?!'-"
_PROMPTS = ("the cat sings", "a dog runs", "hello there", "go on, tell", "what is it?",
            "one two", "blue sky", "say more")


def tiny_tokenizer() -> Any:
    """A character tokenizer: ``<pad>`` = 0, ``</s>`` = 1 (eos), then :data:`CHARS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def tiny_causal_lm(vocab_size: int, seed: int = 0, *, eos_bias: float = 0.0, eos_id: int = 1,
                   max_positions: int = 256, hidden_size: int = 32, layers: int = 2) -> Any:
    """A Llama (default 2 layers, hidden 32) built with ``torch.manual_seed(seed)``, float32.

    ``eos_bias`` > 0 turns it into a near-unigram model whose per-step EOS probability is about
    ``e^b / (e^b + V - 1)``: a large constant feature in every embedding dominates the
    residual stream, only the EOS row of the LM head reads it, and the other rows are shrunk.
    Sampled lengths are then geometric (p99 about 6.6x the median), the long tail a benchmark
    of streaming needs, and the model stays an ordinary ``LlamaForCausalLM``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, tie_word_embeddings=False,
                      eos_token_id=eos_id, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if eos_bias:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 10.0
            head = model.lm_head.weight
            head[:, 0] = 0.0
            head[eos_id] = 0.0
            # After the final RMSNorm the constant feature is about sqrt(hidden).
            head[eos_id, 0] = eos_bias / cfg.hidden_size ** 0.5
    return model


def tiny_model_dir(path: str | Path, seed: int = 0, *, eos_bias: float = 0.0,
                   hidden_size: int = 32, layers: int = 2, max_positions: int = 256) -> str:
    """Save :func:`tiny_tokenizer` and :func:`tiny_causal_lm` as a Hub-style directory.

    TRL builds its reference model from the policy's path when ``beta != 0``, so tests that
    use a KL term pass this directory as ``model``. Returns the path as a string.
    """
    tok = tiny_tokenizer()
    tok.save_pretrained(str(path))
    tiny_causal_lm(len(tok), seed, eos_bias=eos_bias, hidden_size=hidden_size, layers=layers,
                   max_positions=max_positions).save_pretrained(str(path))
    return str(path)


def byte_bpe_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer (GPT-2's scheme) trained here on the prompts and a little
    text: ``<pad>`` = 0, ``</s>`` = 1 (eos), the 256 byte symbols, then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [*_PROMPTS, "the quick brown fox jumps over the lazy dog", "tell me more, please!",
              "once upon a time there was a tiny model", "what is the answer? it is one."] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def tiny_family_model_dir(path: str | Path, family: str, seed: int = 0,
                          hidden_size: int = 32, layers: int = 2) -> str:
    """Save :func:`byte_bpe_tokenizer` and a tiny ``family`` model (``"gpt2"``: GPT-2's
    defaults, tied embeddings and dropout 0.1; ``"qwen2"``: tied embeddings, grouped KV heads,
    as Qwen2.5-0.5B) as a Hub-style directory; returns the path as a string."""
    import transformers

    tok = byte_bpe_tokenizer()
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.eos_token_id)
    if family == "gpt2":
        cfg: Any = transformers.GPT2Config(n_embd=hidden_size, n_layer=layers, n_head=4,
                                           n_positions=256, **ids)
        cls: Any = transformers.GPT2LMHeadModel
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                       num_hidden_layers=layers, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=256,
                                       tie_word_embeddings=True, **ids)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"family={family!r}: use 'gpt2' or 'qwen2'")
    torch.manual_seed(seed)
    tok.save_pretrained(str(path))
    cls(cfg).save_pretrained(str(path))
    return str(path)


def tiny_prompt_dataset(tok: Any, n: int) -> Any:
    """A ``datasets.Dataset`` with ``n`` short plain-text prompts (column ``prompt``)."""
    from datasets import Dataset

    del tok  # prompts are plain text; the tokenizer is the trainer's business
    return Dataset.from_dict({"prompt": [_PROMPTS[i % len(_PROMPTS)] for i in range(n)]})


def vowel_reward(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any
                 ) -> list[float]:
    """Fraction of vowels among the first 8 characters of each completion."""
    return [sum(ch in "aeiou" for ch in c[:8]) / 8.0 for c in completions]


def length_reward(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any
                  ) -> list[float]:
    """Prefers completions of about 6 characters."""
    return [1.0 - min(abs(len(c) - 6), 6) / 6.0 for c in completions]


def grpo_rank_worker(rank: int, world: int, model_dir: str, out_dir: str,
                     fusion_kwargs: dict[str, Any]) -> dict[str, Any]:
    """One rank of a multi-process FusedGRPOTrainer run (``rlhf_fusion.launch.run_ranks``
    starts the gloo group; accelerate attaches to it): this rank's completions and advantages
    for one generation batch."""
    import os
    import warnings

    from trl import GRPOConfig

    from ..integrations.trl.fusion import FusionConfig
    from ..integrations.trl.grpo import FusedGRPOTrainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=16, max_steps=1, beta=0.04, bf16=False,
                      use_cpu=True, report_to=[], seed=0, save_strategy="no",
                      disable_tqdm=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = FusedGRPOTrainer(model=model_dir, reward_funcs=[vowel_reward], args=args,
                                   train_dataset=tiny_prompt_dataset(None, 8),
                                   processing_class=tiny_tokenizer(),
                                   fusion=FusionConfig(**fusion_kwargs))
    trainer.model.train()
    prompts = _PROMPTS[2 * rank: 2 * rank + 2]
    out = trainer._generate_and_score_completions(
        [{"prompt": p} for p in prompts for _ in range(4)])
    return {"completion_ids": out["completion_ids"].tolist(),
            "completion_mask": out["completion_mask"].tolist(),
            "advantages": out["advantages"].tolist(),
            "ref": out["ref_per_token_logps"].tolist(),
            "num_processes": trainer.accelerator.num_processes,
            "moved": getattr(trainer, "fusion_last_rollout", {}).get("moved", [])}
