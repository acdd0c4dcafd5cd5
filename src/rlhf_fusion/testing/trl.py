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


# R_t planner inputs that decide deterministically (2 instances, 16 samples): equal lengths
# leave nothing to migrate (R_t = 0), a tail of 4 long samples makes migration pay (R_t >= 1).
# Decode steps of 2 ms plus 0.1 ms per running sample, scoring at 0.1 ms per token.
RT_SCRIPT_STEPS = [(b, 0.002 + 0.0001 * b) for b in (1, 2, 4, 8, 16)] * 3
RT_SCRIPT_LENGTHS = {"flat": [12] * 16, "tail": [2] * 12 + [16] * 4}


def script_planner(planner: Any, kind: str) -> None:
    """Replace what ``planner`` (an RtPlanner) has observed by the scripted rollout ``kind``
    (``"flat"`` or ``"tail"``); its hysteresis state (the current R_t) is kept."""
    from types import SimpleNamespace

    planner.dist = None
    planner.by_batch.clear()
    planner.scoring.clear()
    planner.rollout_s = None   # no sweep budget: the script sweeps at every batch
    planner.observe(RT_SCRIPT_LENGTHS[kind], SimpleNamespace(steps=RT_SCRIPT_STEPS),
                    [(8, 1000, 0.1)] * 4, prompt_len=10)


def grpo_rt_script_worker(rank: int, world: int, model_dir: str, out_dir: str,
                          script: list[str], algo: str = "grpo") -> dict[str, Any]:
    """One rank of a 2-process FusedGRPOTrainer (``algo="rloo"``: FusedRLOOTrainer) with
    ``rt="auto"`` whose planner sees the
    scripted rollouts ``script`` (one entry per generation batch; ``[]``: no migration at all,
    ``migrate=False``). Every batch really runs through the trainer's migrating rollout at the
    R_t the planner chose, then ``trainer.train()`` runs one optimizer step whose rollout
    the planner, fed equal lengths, runs at R_t = 0. Returns the R_t history, each batch's
    completions and advantages, and the train step's logged loss."""
    import os
    import warnings

    from trl import GRPOConfig, RLOOConfig

    from ..integrations.trl.fusion import FusionConfig
    from ..integrations.trl.grpo import FusedGRPOTrainer
    from ..integrations.trl.migration import RtChooser
    from ..integrations.trl.rloo import FusedRLOOTrainer
    from ..rollout.rt_control import RtPlanner

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    config_cls, trainer_cls = ((GRPOConfig, FusedGRPOTrainer) if algo == "grpo"
                               else (RLOOConfig, FusedRLOOTrainer))
    args = config_cls(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=16, max_steps=1, beta=0.04, bf16=False,
                      use_cpu=True, report_to=[], seed=0, save_strategy="no",
                      disable_tqdm=True, logging_steps=1)
    fusion = FusionConfig(migrate=bool(script), rt="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model=model_dir, reward_funcs=[vowel_reward], args=args,
                              train_dataset=tiny_prompt_dataset(None, 8),
                              processing_class=tiny_tokenizer(), fusion=fusion)
    trainer.model.train()
    chooser = trainer._rt_chooser = RtChooser("auto", fusion.max_batch_size, world)
    chooser.planner = RtPlanner(8 * world, world, bs_max=fusion.max_batch_size)
    real_rt = chooser.rt
    steps = script or ["-"] * 4
    kinds = iter(steps)

    history: list[int] = []

    def scripted_rt(batch: int) -> int:
        if chooser.planner.batch != batch:  # train()'s generation batch is another size
            chooser.planner = RtPlanner(batch, world, bs_max=fusion.max_batch_size)
        script_planner(chooser.planner, next(kinds))
        history.append(real_rt(batch))
        return history[-1]

    chooser.rt = scripted_rt  # type: ignore[method-assign]
    prompts = _PROMPTS[2 * rank: 2 * rank + 2]
    batches = []
    for _ in steps:
        out = trainer._generate_and_score_completions(
            [{"prompt": p} for p in prompts for _ in range(4)])
        batches.append({"completion_ids": out["completion_ids"].tolist(),
                        "advantages": out["advantages"].tolist(),
                        "moved": getattr(trainer, "fusion_last_rollout", {}).get("moved", [])})
    # Then one real optimizer step (trainer.train) whose rollout the planner, seeing equal
    # lengths, runs at R_t = 0.
    kinds = iter(["flat"] * 8)
    trainer.train()
    loss = [x["loss"] for x in trainer.state.log_history if "loss" in x]
    return {"rt": history, "batches": batches,
            "loss": loss, "global_step": trainer.state.global_step}


def sharded_copy_worker(rank: int, world: int, model_dir: str, kind: str) -> dict[str, Any]:
    """One rank: shard the model at ``model_dir`` (``kind``: ``"zero3"`` through
    ``deepspeed.initialize`` on DeepSpeed's CPU accelerator, ``"fsdp2"`` through torch's
    ``fully_shard``), build the generation copy from the gathered weights, take one optimizer
    step, refresh the copy. Returns how far the copy's logits are from the unsharded model's
    (before) and the sharded model's own forward (after the step), and what was sharded."""
    import copy
    import os

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ..integrations.trl.compat import generation_copy
    from ..integrations.trl.sharded import full_state_dict, plain_copy, sharding

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    whole = copy.deepcopy(model).eval()
    ids = torch.tensor([[2, 5, 9, 14, 3, 7, 11, 4]] * 2)
    if kind == "zero3":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        import sys

        import deepspeed

        # Plain gloo collectives: DeepSpeed's CPU shared-memory op is a C++ JIT build (minutes).
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                    "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True})
        net = engine.module
        shards = [int(p.ds_tensor.numel()) for p in net.parameters()]

        def step() -> None:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        shards = [int(p.to_local().numel()) for p in net.parameters() if isinstance(p, DTensor)]
        opt = torch.optim.SGD(net.parameters(), lr=0.5)

        def step() -> None:
            net(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    full = sum(p.numel() for p in whole.parameters())
    state = full_state_dict(net)
    clone = generation_copy(plain_copy(net, state))
    with torch.no_grad():
        before = (clone(ids).logits - whole(ids).logits).abs().max().item()
    step()
    clone.load_state_dict(full_state_dict(net))
    net.eval()
    with torch.no_grad():
        after = (clone(ids).logits - net(input_ids=ids).logits).abs().max().item()
        moved = (clone(ids).logits - whole(ids).logits).abs().max().item()
    dist.barrier()
    return {"sharding": sharding(net), "local_numel": sum(shards), "full_numel": full,
            "before": before, "after": after, "moved": moved,
            "copy_sharded": sharding(clone), "copy_type": type(clone).__name__}


def fsdp2_grpo_worker(rank: int, world: int, model_dir: str, out_dir: str,
                      steps: int, algo: str = "grpo") -> dict[str, Any]:
    """One rank of a 2-process FusedGRPOTrainer (``algo="rloo"``: FusedRLOOTrainer; every
    plugin on) whose policy accelerate
    prepares with FSDP2 on the CPU (gloo), ``steps`` optimizer steps.

    accelerate 1.15 enables FSDP only from a multi-accelerator distributed type
    (``AcceleratorState.__init__``: the ``DistributedType.FSDP`` promotion sits under
    ``MULTI_GPU``/``MULTI_NPU``/..., never ``MULTI_CPU``), so a CPU run is plain DDP whatever
    its config says. Here the shared accelerator state is switched to FSDP with an FSDP2
    plugin after the trainer is built and before ``train()`` prepares the model, so
    accelerate's own ``fsdp2_prepare_model`` (``fully_shard`` per decoder layer, then the
    root) shards the policy over the gloo group. Every rollout records: whether the policy's
    parameters are DTensors and how much of them this rank holds; how far the generation
    copy's weights are from the gathered full weights; how far each generated token's
    logprob is from the sharded policy's teacher-forced one; a checksum of the copy (it must
    change after every optimizer step); the sample ids returned."""
    import os
    import warnings

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from trl import GRPOConfig, RLOOConfig

    from ..integrations.trl.fusion import FusionConfig
    from ..integrations.trl.grpo import FusedGRPOTrainer
    from ..integrations.trl.rloo import FusedRLOOTrainer
    from ..integrations.trl.sharded import full_state_dict, sharding

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    config_cls, trainer_cls = ((GRPOConfig, FusedGRPOTrainer) if algo == "grpo"
                               else (RLOOConfig, FusedRLOOTrainer))
    args = config_cls(output_dir=out_dir, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=12, max_steps=steps, beta=0.04, bf16=False,
                      learning_rate=1e-2, use_cpu=True, report_to=[], seed=0,
                      save_strategy="no", disable_tqdm=True, logging_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_cls(model=model_dir, reward_funcs=[vowel_reward], args=args,
                              train_dataset=tiny_prompt_dataset(None, 16),
                              processing_class=tiny_tokenizer(), fusion=FusionConfig(rt="auto"))
    state = trainer.accelerator.state
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    layer_cls = type(trainer.model.model.layers[0]).__name__
    # Both shared states, as AcceleratorState.__init__ does when it promotes to FSDP: every
    # later AcceleratorState() copies PartialState's fields over its own.
    PartialState().distributed_type = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[layer_cls], reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT")
    trainer.is_fsdp_enabled = True

    records: list[dict[str, Any]] = []
    real = trainer._fused_rollout

    def checked(prompt_ids: list[list[int]], batch: Any) -> Any:
        results = real(prompt_ids, batch)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        # FSDP2 leaves the root's parameters (norm, embeddings) unsharded after a forward when
        # it expects the backward next; reshard (public, the next forward gathers again) so
        # the check sees the sharded resting state.
        for m in policy.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        params = list(policy.parameters())
        copy = trainer._fusion_backend.model
        full = full_state_dict(policy)  # collective: both ranks, same order
        mine = copy.state_dict()
        copy_diff = max((mine[k].double() - v.double()).abs().max().item()
                        for k, v in full.items())
        lp_diff = 0.0
        with torch.no_grad():
            for r in results:  # one forward per sample: the same count on every rank
                ids = torch.tensor([list(r.prompt_ids) + list(r.token_ids)])
                logits = policy(input_ids=ids).logits[0, len(r.prompt_ids) - 1: -1].double()
                lp = torch.log_softmax(logits, -1).gather(
                    1, torch.tensor(r.token_ids)[:, None])[:, 0]
                lp_diff = max(lp_diff, (lp - torch.tensor(r.logprobs)).abs().max().item())
        records.append({
            "dtensor": all(isinstance(p, DTensor) for p in params),
            "policy_sharded": sharding(policy), "copy_sharded": sharding(copy),
            "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                               for p in params),
            "full_numel": sum(p.numel() for p in params),  # a DTensor's is the global one
            "copy_diff": copy_diff, "lp_diff": lp_diff,
            "copy_sum": float(sum(v.double().sum() for v in mine.values())),
            "ids": [r.sample_id for r in results], "prompts": len(prompt_ids),
            "is_fsdp2": bool(trainer.accelerator.is_fsdp2),
            "wrapped": type(trainer.model_wrapped).__name__})
        return results

    trainer._fused_rollout = checked  # type: ignore[method-assign]
    trainer.train()
    return {"records": records, "global_step": trainer.state.global_step,
            "is_fsdp2": bool(trainer.accelerator.is_fsdp2)}
