"""Tiny assets for a verl 0.9.1 job on CPU: a Llama (head_dim 64, which vLLM's CPU attention
accepts) with a character tokenizer and a chat template, and gsm8k-shaped parquet files."""

from __future__ import annotations

import sys
from pathlib import Path


def save_model(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 .,:?!'-#"
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                   bos_token="<s>")
    # verl's RLHFDataset applies the chat template to the prompt's messages
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}:{% endif %}")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
        tie_word_embeddings=False)).save_pretrained(path)


def save_data(path: Path, n: int) -> None:
    import pandas as pd

    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"what is {a} plus {b}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": i},
        })
    pd.DataFrame(rows).to_parquet(path)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    save_model(out / "model")
    save_data(out / "train.parquet", 16)
    save_data(out / "val.parquet", 4)
    print(out)
