"""``FusedPPOTrainer``: a drop-in for trl 1.12's ``PPOTrainer`` with rlhf-fusion's plugins.

Change one import::

    from rlhf_fusion.integrations.trl import FusedPPOTrainer as PPOTrainer, PPOConfig

and pass ``fusion=FusionConfig(...)`` to pick plugins (all on by default). The constructor,
``PPOConfig``, logged metric names and checkpoints are TRL's; ``FusionConfig.off()`` runs the
stock algorithm step for step. One iteration, top to bottom (:meth:`FusedPPOTrainer.train`):

1. rollout: ``padded_rollout`` (stock) or ``streamed_rollout`` (continuous batching, each
   finished sample scored while the rest decode, long-tail migration across processes);
2. experience: masks, KL-penalised rewards, GAE (reverse loop or the kernel), whitening;
3. PPO epochs x mini-batches x micro-batches (trimmed to their own longest response when
   ``trim_padding``), one optimizer step per mini-batch via gradient accumulation;
4. metrics (TRL's names plus ``time/*``, ``samples_per_s`` and response-length percentiles).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerState

from .experience import (
    PolicyTerms,
    PPOExperience,
    ValueTerms,
    make_experience,
    policy_stats,
    policy_terms,
    value_terms,
)
from .fusion import FusionConfig, FusionConfigError, generation_backend
from .ppo_config import PPOConfig
from .rollout import (
    PPORollout,
    RowScorer,
    assemble,
    left_pad,
    lm_forward,
    padded_rollout,
    sample_specs,
)
from .sharded import full_state_dict, peft_plain_copy, plain_copy, sharding

try:
    from trl.trainer.base_trainer import _BaseTrainer
except ImportError as e:  # pragma: no cover - the [trl] extra is missing
    raise ImportError(
        "rlhf_fusion.integrations.trl needs TRL 1.12-1.16: pip install 'rlhf-fusion[trl]'"
    ) from e

__all__ = ["AdapterFreeRef", "FusedPPOTrainer", "PolicyAndValueWrapper"]


class PolicyAndValueWrapper(nn.Module):
    """Actor and Critic as one module (TRL's layout: ``policy.*`` and ``value_model.*``
    parameter names, so checkpoints load in either trainer)."""

    def __init__(self, policy: nn.Module, value_model: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.value_model = value_model
        self.critic_backbone = getattr(value_model, value_model.base_model_prefix)
        self.is_gradient_checkpointing = getattr(policy, "is_gradient_checkpointing", False)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.policy.gradient_checkpointing_enable(**kwargs)
        self.is_gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.policy.gradient_checkpointing_disable()
        self.is_gradient_checkpointing = False

    def forward(self, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        output = self.critic_backbone(**kwargs)
        return self.policy(**kwargs), self.value_model.score(output.hidden_states[-1])


def _with_adapter(policy: nn.Module, peft_config: Any, args: PPOConfig) -> nn.Module:
    """``policy`` wrapped in a new PEFT adapter, checked as trl 1.12's ``PPOTrainer`` does."""
    try:
        from peft import PeftConfig, PeftModel, get_peft_model
    except ImportError as e:
        raise ImportError("You passed `peft_config` but the `peft` library is not installed: "
                          "pip install peft") from e
    if not isinstance(peft_config, PeftConfig):
        raise TypeError("`peft_config` must be a `peft.PeftConfig` instance (e.g. "
                        f"`peft.LoraConfig`), got {type(peft_config).__name__}.")
    if isinstance(policy, PeftModel):
        raise ValueError("You passed a `PeftModel` together with a `peft_config`: merge and "
                         "unload the existing adapter first, then pass the base model with the "
                         "new `peft_config`.")
    policy = get_peft_model(policy, peft_config)
    if args.bf16 and getattr(policy, "is_loaded_in_4bit", False):
        from trl.experimental.utils import peft_module_casting_to_bf16

        peft_module_casting_to_bf16(policy)
    return policy


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class AdapterFreeRef:
    """TRL's Ref under PEFT without a ``ref_model``: the live policy run with its adapter
    disabled (or with ``ref_adapter_name`` active), as trl 1.12's ``null_ref_context``. Called
    like a model; every call sees the policy's current base weights."""

    def __init__(self, policy: nn.Module, ref_adapter: str | None,
                 model_adapter: str | None) -> None:
        self.policy = policy
        self.ref_adapter = ref_adapter
        self.model_adapter = model_adapter

    def __call__(self, **kwargs: Any) -> Any:
        if not self.ref_adapter:
            with self.policy.disable_adapter():
                return self.policy(**kwargs)
        self.policy.set_adapter(self.ref_adapter)
        try:
            return self.policy(**kwargs)
        finally:
            self.policy.set_adapter(self.model_adapter or "default")

    def parameters(self) -> Any:
        return self.policy.parameters()


def _exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}, inexact division: {a} / {b} = {a / b}")
    return a // b


class FusedPPOTrainer(_BaseTrainer):
    """trl 1.12's ``PPOTrainer`` contract on rlhf-fusion's loop (see the module docstring)."""

    _tag_names = ["trl", "ppo", "rlhf-fusion"]
    _name = "PPO"

    def __init__(
        self,
        args: PPOConfig,
        processing_class: Any,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module,
        train_dataset: Any,
        value_model: nn.Module,
        data_collator: Any = None,
        eval_dataset: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        callbacks: list[Any] | None = None,
        peft_config: Any = None,
        *,
        fusion: FusionConfig | None = None,
    ) -> None:
        from accelerate import Accelerator
        from torch.utils.data import DataLoader
        from transformers import DataCollatorWithPadding
        from transformers.integrations import get_reporting_integration_callbacks
        from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
        from transformers.trainer_callback import (
            CallbackHandler,
            ExportableState,
            PrinterCallback,
            TrainerControl,
        )
        from trl.experimental.utils import create_reference_model
        from trl.trainer.utils import disable_dropout_in_model

        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object; pass a copy, "
                             "or None for a frozen copy of `model`")
        self.fusion = fusion if fusion is not None else FusionConfig()
        if peft_config is not None and self.fusion.pipeline_stages > 1:
            raise FusionConfigError(
                "FusionConfig(pipeline_stages>1) cuts the policy into stages and cannot cut a "
                "PEFT model: pass peft_config with pipeline_stages=1, or merge the adapter first")
        self.args = args
        self.processing_class = processing_class
        self.policy_model = model
        if data_collator is None:
            data_collator = DataCollatorWithPadding(processing_class)
        if args.stop_token and args.stop_token_id:
            raise ValueError("You cannot set both `stop_token` and `stop_token_id`.")
        if args.stop_token and args.stop_token != "eos":
            raise ValueError(f"Unknown `stop_token` {args.stop_token}. Allowed values are: "
                             "`'eos'` and `None` (no stop token).")
        self.stop_token_id = (processing_class.eos_token_id if args.stop_token == "eos"
                              else args.stop_token_id)
        self.policy_model.generation_config.eos_token_id = self.stop_token_id
        if args.kl_estimator not in {"k1", "k3"}:
            raise ValueError("kl_estimator must be either 'k1' or 'k3'")

        if peft_config is not None:
            self.policy_model = _with_adapter(self.policy_model, peft_config, args)
        self.is_peft_model = _is_peft(self.policy_model)
        self.model_adapter_name = args.model_adapter_name
        self.ref_adapter_name = args.ref_adapter_name
        # As TRL: under PEFT without a ref_model the Ref is the policy with its adapter off.
        self.ref_model = (ref_model if ref_model else None if self.is_peft_model
                          else create_reference_model(self.policy_model))
        self.reward_model = reward_model
        self.train_dataset = train_dataset
        self.train_dataset_len = len(train_dataset)
        self.value_model = value_model
        self.data_collator = data_collator
        self.eval_dataset = eval_dataset
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = None

        if args.total_episodes is None:
            args.total_episodes = int(args.num_train_epochs * self.train_dataset_len)
        accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
        self.accelerator = accelerator
        args.world_size = accelerator.num_processes
        args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
        args.micro_batch_size = int(args.per_device_train_batch_size * args.world_size)
        args.batch_size = int(args.local_batch_size * args.world_size)
        args.mini_batch_size = _exact_div(args.batch_size, args.num_mini_batches,
                                          "`batch_size` must be a multiple of `num_mini_batches`")
        args.local_mini_batch_size = _exact_div(
            args.local_batch_size, args.num_mini_batches,
            "`local_batch_size` must be a multiple of `num_mini_batches`")
        if args.whiten_rewards and args.local_mini_batch_size < 8:
            raise ValueError(f"Per-rank minibatch size {args.local_mini_batch_size} is "
                             "insufficient for whitening")
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
        self.local_seed = args.seed + accelerator.process_index * 100003
        if args.num_sample_generations > 0:
            self.sample_generations_freq = max(1, args.num_total_batches
                                               // args.num_sample_generations)
        self.local_dataloader_batch_size = args.local_batch_size

        for module in (self.policy_model, self.ref_model, self.value_model, self.reward_model):
            if module is not None:
                disable_dropout_in_model(module)
        self.model = PolicyAndValueWrapper(self.policy_model, self.value_model)
        self.model.config = self.policy_model.config
        self._pipeline: Any = None
        self._micro_steps = 0
        if self.fusion.pipeline_stages > 1 and getattr(accelerator.state, "deepspeed_plugin",
                                                       None) is not None:
            raise FusionConfigError(
                "FusionConfig(pipeline_stages>1) trains its own stages and cannot run inside "
                "DeepSpeed: use pipeline_stages=1 under a DeepSpeed config")
        if self.fusion.pipeline_stages > 1:
            from .pipeline import PipelinedPPO

            # Cuts the Actor and the Critic in place (the wrapper then holds this rank's
            # stages), so the optimizer below gets exactly this rank's parameters.
            self._pipeline = PipelinedPPO(
                self.policy_model, self.value_model, args=args,
                stages=self.fusion.pipeline_stages, world=accelerator.num_processes,
                rank=accelerator.process_index, device=accelerator.device,
                solver=self.fusion.solver, time_limit=self.fusion.solver_time_limit)
        self.create_optimizer_and_scheduler(num_training_steps=args.num_total_batches)

        default_callbacks = DEFAULT_CALLBACKS + get_reporting_integration_callbacks(args.report_to)
        self.callbacks = default_callbacks if callbacks is None else default_callbacks + callbacks
        self.callback_handler = CallbackHandler(self.callbacks, self.model, processing_class,
                                                self.optimizer, self.lr_scheduler)
        self.add_callback(PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK)
        self.control = TrainerControl()
        self.state = OnlineTrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=[cb for cb in self.callback_handler.callbacks + [self.control]
                                if isinstance(cb, ExportableState)])
        self.current_flos = 0
        self.hp_search_backend = None
        self.is_deepspeed_enabled = getattr(accelerator.state, "deepspeed_plugin", None) is not None
        self.is_fsdp_enabled = getattr(accelerator.state, "fsdp_plugin", None) is not None
        self.hub_model_id = None
        if args.push_to_hub:
            self.init_hf_repo()
        if args.should_save:
            os.makedirs(args.output_dir, exist_ok=True)
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

        self.dataloader = DataLoader(self.train_dataset, batch_size=args.local_batch_size,
                                     shuffle=True, collate_fn=data_collator, drop_last=True)
        # The same seeding protocol as TRL: the shuffle order is shared, then each process
        # reseeds for its own sampling.
        torch.manual_seed(args.seed)
        if self._pipeline is None:
            self.model, self.optimizer, self.dataloader = accelerator.prepare(
                self.model, self.optimizer, self.dataloader)
        else:  # the pipeline syncs its own gradients: no DDP wrapper
            self.dataloader = accelerator.prepare(self.dataloader)
        torch.manual_seed(self.local_seed)
        self.eval_dataloader = None
        if eval_dataset is not None:
            self.eval_dataloader = accelerator.prepare(DataLoader(
                eval_dataset, batch_size=args.per_device_eval_batch_size,
                collate_fn=data_collator, drop_last=True))
        # Ref and Reward as TRL places them: DeepSpeed inference engines (sharded too under
        # ZeRO-3, stage 0 otherwise), else moved to the device.
        if self.is_deepspeed_enabled:
            from trl.models.utils import prepare_deepspeed

            self.reward_model = prepare_deepspeed(self.reward_model, accelerator)
            if self.ref_model is not None:
                self.ref_model = prepare_deepspeed(self.ref_model, accelerator)
        else:
            if self.ref_model is not None:
                self.ref_model = self.ref_model.to(accelerator.device)
            self.reward_model = self.reward_model.to(accelerator.device)
        self._backend: Any = None
        self._rt_chooser: Any = None
        self._sync_s = 0.0

    # -- TRL plumbing ---------------------------------------------------------------------------
    def get_train_dataloader(self) -> Any:
        return self.dataloader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return self.eval_dataloader

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # Only the policy is saved for inference, as TRL does (whole, also when pipelined).
        if self.is_deepspeed_enabled:
            return self._save_deepspeed(output_dir)
        if not self.args.should_save and not self.is_fsdp_enabled:
            return  # whole weights on the writer: nothing to gather (FSDP gathers, collectively)
        backup = self.model
        if self._pipeline is not None:
            self.model = self._pipeline.whole["actor"]
        elif hasattr(self.accelerator.unwrap_model(self.model), "policy"):
            # Under DDP self.model is the wrapper's wrapper (trl 1.12 saves all of it there).
            self.model = self.accelerator.unwrap_model(self.model).policy
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.model = backup

    def _save_deepspeed(self, output_dir: str | None) -> None:
        """The policy's weights, gathered whole under ZeRO-3 (every process calls this).
        trl 1.12's own ``save_model`` fails under DeepSpeed with transformers 5 (it hands
        Trainer the policy as ``self.deepspeed``, whose config has no ``get``)."""
        state = self.accelerator.get_state_dict(self.model)  # None off rank 0 under ZeRO-3
        if not self.args.should_save:
            return
        policy_state = {k[len("policy."):]: v for k, v in state.items()
                        if k.startswith("policy.")}
        backup = self.model
        self.model = self.accelerator.unwrap_model(self.model).policy
        try:
            self._save(output_dir, state_dict=policy_state)
        finally:
            self.model = backup

    # -- one PPO iteration ----------------------------------------------------------------------
    def train(self) -> None:  # type: ignore[override]
        args = self.args
        accelerator = self.accelerator
        device = accelerator.device
        self._generation_kwargs = {"max_new_tokens": args.response_length,
                                   "temperature": args.temperature + 1e-7, "top_k": 0.0,
                                   "top_p": 1.0, "do_sample": True}
        stats_shape = (args.num_ppo_epochs, args.num_mini_batches,
                       args.gradient_accumulation_steps)
        self._stats = {k: torch.zeros(stats_shape, device=device) for k in (
            "approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")}
        self.model.train()
        self.state.global_step = 0
        self.state.episode = 0
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / self.train_dataset_len
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(self.state, name, math.ceil(self.state.max_steps * value)
                        if value < 1 else value)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if self.is_deepspeed_enabled:  # what Trainer's checkpointing reads, as TRL sets it
            self.deepspeed = self.model
            self.model_wrapped = self.model

        def batches() -> Any:
            while True:
                yield from self.dataloader

        batch_iter = iter(batches())
        start = time.time()
        for update in range(1, args.num_total_batches + 1):
            self.state.episode += args.batch_size
            queries = next(batch_iter)["input_ids"].to(device)
            t0 = time.perf_counter()
            rollout = self._rollout(queries, update)
            exp = self._experience(rollout)
            t1 = time.perf_counter()
            self._ppo_epochs(rollout, exp)
            t2 = time.perf_counter()
            self._log_iteration(rollout, exp, start, timings={
                "time/generation": rollout.gen_s, "time/inference": rollout.inf_s,
                "time/experience": t1 - t0 - rollout.gen_s - rollout.inf_s,
                "time/training": t2 - t1 - self._sync_s, "time/iteration": t2 - t0,
                **({"time/weight_sync_training": self._sync_s} if self._pipeline else {})})
            self.lr_scheduler.step()
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_save:
                self._save_checkpoint(self.model, trial=None)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint(self.model, trial=None)
            self.control = self.callback_handler.on_save(args, self.state, self.control)

    # 1. rollout ---------------------------------------------------------------------------------
    def _rollout(self, queries: torch.Tensor, update: int) -> PPORollout:
        from transformers import GenerationConfig
        from trl.models.utils import unwrap_model_for_generation

        args = self.args
        pad_id = self.processing_class.pad_token_id
        unwrapped = self._whole_models()
        if not self.fusion.stream and self._pipeline is not None:
            return padded_rollout(
                policy=unwrapped.policy, ref=self._ref(unwrapped), critic=unwrapped.value_model,
                reward=self.reward_model, queries=queries,
                generation_config=GenerationConfig(**self._generation_kwargs),
                chunk=args.local_rollout_forward_batch_size, pad_id=pad_id,
                stop_id=self.stop_token_id, temperature=args.temperature)
        if not self.fusion.stream:
            with unwrap_model_for_generation(
                    self.model, self.accelerator,
                    gather_deepspeed3_params=args.ds3_gather_for_generation,
                    generation_kwargs=self._generation_kwargs) as gen_model:
                return padded_rollout(
                    policy=gen_model.policy, ref=self._ref(unwrapped),
                    critic=unwrapped.value_model, reward=self.reward_model,
                    queries=queries, generation_config=GenerationConfig(**self._generation_kwargs),
                    chunk=args.local_rollout_forward_batch_size, pad_id=pad_id,
                    stop_id=self.stop_token_id, temperature=args.temperature)
        return self._streamed_rollout(queries, update, unwrapped)

    def _whole_models(self) -> Any:
        """Whole Actor and Critic (``.policy``, ``.value_model``) for generation and scoring:
        the training copies, or the pipeline's reallocated whole copies."""
        if self._pipeline is None:
            return self.accelerator.unwrap_model(self.model)
        from types import SimpleNamespace

        return SimpleNamespace(policy=self._pipeline.whole["actor"],
                               value_model=self._pipeline.whole["critic"])

    def _ref(self, unwrapped: Any) -> Any:
        """The Ref pass's model: ``ref_model``, or under PEFT the adapter-free policy."""
        if self.ref_model is not None:
            return self.ref_model
        return AdapterFreeRef(unwrapped.policy, self.ref_adapter_name, self.model_adapter_name)

    def _sharded(self) -> bool:
        """Whether the Actor/Critic are sharded (ZeRO-3): every forward of theirs (and of the
        Ref and Reward, sharded alike) is then a collective, so every process must run the
        same forwards in step."""
        return sharding(self.accelerator.unwrap_model(self.model)) is not None

    def _generation_backend(self, policy: nn.Module) -> Any:
        """The generation instance of this process, built once; the training copy's weights
        are pushed into it before every rollout, so it follows every optimizer step. Under
        ZeRO-3 the weights are gathered whole first (collective) and the copy is built from
        them (a copy of the partitioned module would hold empty parameters)."""
        with torch.no_grad():
            state = full_state_dict(policy)
            if self._backend is None:
                source = policy
                if sharding(policy):
                    # A fresh model's initialisation draws from torch's generator: keep the
                    # training's random stream where it was.
                    with torch.random.fork_rng(devices=[]):
                        source = (peft_plain_copy(policy, state) if _is_peft(policy)
                                  else plain_copy(policy, state))
                self._backend = generation_backend(
                    source, self.fusion, seed=self.args.seed,
                    instance_id=self.accelerator.process_index, device=self.accelerator.device)
            self._backend.update_weights(state)
        return self._backend

    @torch.no_grad()
    def _streamed_rollout(self, queries: torch.Tensor, update: int, unwrapped: Any
                          ) -> PPORollout:
        args = self.args
        pad_id = self.processing_class.pad_token_id
        fill_id = self.policy_model.generation_config.pad_token_id
        fill_id = pad_id if fill_id is None else fill_id
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        queries = left_pad(queries, pad_id)
        t0 = time.perf_counter()
        backend = self._generation_backend(unwrapped.policy)
        t_sync = time.perf_counter() - t0
        b = queries.shape[0]
        # Sample i of process r is global sample i * world + r: run_rollout's shard of r.
        my_ids = [i * world + rank for i in range(b)]
        stop = () if self.stop_token_id is None else (int(self.stop_token_id),)
        gen = dict(pad_id=pad_id, max_new_tokens=args.response_length,
                   temperature=args.temperature, stop_ids=stop)
        if world > 1:
            rows = [None] * world
            dist.all_gather_object(rows, queries.cpu())
            specs, query_rows = [], {}
            for r, q in enumerate(rows):
                ids = [i * world + r for i in range(q.shape[0])]
                specs += sample_specs(q, ids=ids, seed=self._sampling_seed(r, update), **gen)
                query_rows.update({sid: q[j] for j, sid in enumerate(ids)})
        else:
            specs = sample_specs(queries, ids=my_ids, seed=self._sampling_seed(rank, update),
                                 **gen)
            query_rows = {sid: queries[j].cpu() for j, sid in enumerate(my_ids)}
        scorer = RowScorer(ref=self._ref(unwrapped), critic=unwrapped.value_model,
                           reward=self.reward_model, query_rows=query_rows, pad_id=pad_id,
                           fill_id=fill_id, stop_id=self.stop_token_id,
                           temperature=args.temperature,
                           micro_batch=max(1, min(8, args.local_rollout_forward_batch_size)),
                           max_rows=args.local_rollout_forward_batch_size)
        stats: dict[str, Any] = {"time/weight_sync": t_sync}
        sharded = self._sharded()
        if world > 1 and self.fusion.migrate:
            scored = self._migrating_rollout(backend, scorer, specs, stats, sharded)
        else:
            scored = self._local_stream(backend, scorer, specs if world == 1 else
                                        [s for s in specs if s.sample_id in set(my_ids)],
                                        stream=not sharded)
        mine = {s.sample_id: s for s in scored}
        ordered = [mine[i] for i in my_ids]
        qr, lp, ref, val, scores = assemble(queries, ordered, fill_id=fill_id, pad_id=pad_id,
                                            chunk=args.local_rollout_forward_batch_size)
        dev = queries.device
        total = time.perf_counter() - t0
        return PPORollout(qr.to(dev), lp.to(dev), ref.to(dev), val.to(dev), scores.to(dev),
                          queries.shape[1], gen_s=total - scorer.seconds, inf_s=scorer.seconds,
                          stats=stats)

    def _sampling_seed(self, process: int, update: int) -> int:
        """The sampling key of ``process``'s samples in iteration ``update``: from that
        process's TRL seed (``seed + 100003 * process``), so it does not depend on where the
        samples end up decoding."""
        return (self.args.seed + process * 100003) * 1_000_003 + update

    def _local_stream(self, backend: Any, scorer: RowScorer, specs: list[Any],
                      stream: bool = True) -> list[Any]:
        """Decode, and score each micro-batch of finished samples between decode steps (or,
        ``stream=False``, all of them after decoding: the same micro-batches on every process
        when the scoring forwards are collectives)."""
        backend.submit(specs)
        done: list[Any] = []
        scored: list[Any] = []
        while backend.unfinished():
            done.extend(backend.step())
            if stream and scorer.ready(done):
                scored.extend(scorer.score(done, rows=scorer.max_rows))
                done = []
        scored.extend(scorer.score(done, rows=scorer.max_rows))
        return scored

    def _migrating_rollout(self, backend: Any, scorer: RowScorer, specs: list[Any],
                           stats: dict[str, Any], sharded: bool = False) -> list[Any]:
        from .migration import RtChooser, migrating_rollout

        if self._rt_chooser is None:
            self._rt_chooser = RtChooser(self.fusion.rt, self.fusion.max_batch_size,
                                         self.accelerator.num_processes)
        # Sharded scoring forwards are collectives: no migration (R_t = 0), so every process
        # scores its own samples after generation, the same micro-batches in step.
        out, rt = migrating_rollout(self._rt_chooser, backend, scorer, specs, self.fusion,
                                    rt=0 if sharded else None)
        stats["fusion/rt"] = rt
        stats["fusion/migrated"] = len(out.assignment.moved_ids) if out.assignment else 0
        return list(out.experiences or [])

    # 2. experience ------------------------------------------------------------------------------
    def _experience(self, rollout: PPORollout) -> PPOExperience:
        a = self.args
        return make_experience(
            responses=rollout.responses, logprobs=rollout.logprobs,
            ref_logprobs=rollout.ref_logprobs, values=rollout.values, scores=rollout.scores,
            pad_id=self.processing_class.pad_token_id,
            eos_id=self.processing_class.eos_token_id, stop_id=self.stop_token_id,
            kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
            missing_eos_penalty=a.missing_eos_penalty, whiten_rewards=a.whiten_rewards,
            gamma=a.gamma, lam=a.lam, use_kernel=self.fusion.gae)

    # 3. PPO epochs ------------------------------------------------------------------------------
    def _ppo_epochs(self, rollout: PPORollout, exp: PPOExperience) -> None:
        if self._pipeline is not None:
            return self._pipelined_epochs(rollout, exp)
        a = self.args
        ctx = rollout.context_length
        full_r = exp.responses.shape[1]
        for epoch in range(a.num_ppo_epochs):
            order = np.random.permutation(a.local_batch_size)
            for mb_idx, mb_start in enumerate(range(0, a.local_batch_size,
                                                    a.local_mini_batch_size)):
                mini = order[mb_start: mb_start + a.local_mini_batch_size]
                for ga_idx, micro_start in enumerate(range(0, a.local_mini_batch_size,
                                                           a.per_device_train_batch_size)):
                    with self.accelerator.accumulate(self.model):
                        inds = mini[micro_start: micro_start + a.per_device_train_batch_size]
                        # Columns past every sample's Critic position are masked everywhere
                        # in the loss: cutting them changes no loss term.
                        r = (min(full_r, int(exp.sequence_lengths[inds].max()) + 2)
                             if self.fusion.trim_padding else full_r)
                        logits, vpred = self._forward(
                            rollout.query_responses[inds, : ctx + r], ctx,
                            ctx + exp.sequence_lengths[inds] + 1)
                        pol = policy_terms(
                            logits=logits[:, ctx - 1: -1],
                            responses=exp.responses[inds, :r],
                            old_logprobs=exp.logprobs[inds, :r],
                            advantages=exp.advantages[inds, :r],
                            padding_mask=exp.padding_mask[inds, :r],
                            temperature=a.temperature, cliprange=a.cliprange)
                        val = value_terms(
                            vpred=vpred[:, ctx - 1: -1],
                            old_values=exp.values[inds, :r], returns=exp.returns[inds, :r],
                            padding_mask_p1=exp.padding_mask_p1[inds, :r],
                            cliprange_value=a.cliprange_value)
                        self.accelerator.backward(pol.pg_loss + a.vf_coef * val.vf_loss)
                        self.optimizer.step()
                        self.optimizer.zero_grad()
                        with torch.no_grad():
                            # Trimmed columns hold diff 0 and ratio 1 exactly: rescale the
                            # means to the full width so the logged values match stock TRL.
                            self._record(epoch, mb_idx, ga_idx, pol, val, r / full_r)

    def _forward(self, query_responses: torch.Tensor, context_length: int,
                 critic_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Actor logits ``[b, T, V]`` and Critic values ``[b, T]`` of right-padded rows:
        padded as TRL runs them, or padding-free (``fusion.padding_free``): the rows' real
        tokens bin-packed into fewer rows under a block-diagonal causal mask, their positions
        unchanged, the outputs scattered back (zeros at padding).

        Two pad columns carry loss terms in TRL's padded forward: ``context_length - 1``
        (it predicts the first response token; a pad when queries are right-padded) and
        ``critic_end`` ``[b]`` (the Critic is trained one position past each response). There a
        pad reads the earlier real tokens, not itself, and nothing reads it; the packed
        forward keeps such slots with exactly that mask.
        """
        pad_id = self.processing_class.pad_token_id
        impl = self._packable_attention()
        if not self.fusion.padding_free or impl is None:
            output, values = lm_forward(self.model, query_responses, pad_id)
            return output.logits, values.squeeze(-1)
        from .packing import attention_mask_for, pack, unpack

        b, t = query_responses.shape
        mask = query_responses != pad_id
        rows = torch.arange(b, device=mask.device)
        shadow = torch.zeros_like(mask)
        shadow[:, context_length - 1] = True
        has_end = critic_end < t
        shadow[rows[has_end], critic_end[has_end]] = True
        shadow &= ~mask
        packed = pack(torch.masked_fill(query_responses, ~mask, 0), mask | shadow)
        positions = (mask.cumsum(1) - mask.long()).reshape(-1)
        packed_pos = torch.zeros_like(packed.position_ids).view(-1)
        packed_pos[packed.dst] = positions[packed.src]
        slot_of = torch.full((b * t,), -1, dtype=torch.long, device=mask.device)
        slot_of[packed.src] = packed.dst
        slots = slot_of[shadow.reshape(-1).nonzero(as_tuple=True)[0]]
        attn = packed.attention_mask.clone()
        r, c = slots // packed.capacity, slots % packed.capacity
        attn[r, 0, :, c] = False  # nothing reads a pad slot ...
        attn[r, 0, c, c] = False  # ... and it does not read itself
        dtype = next(self.policy_model.parameters()).dtype
        output, values = self.model(
            input_ids=packed.input_ids, position_ids=packed_pos.view_as(packed.position_ids),
            attention_mask=attention_mask_for(attn, impl, dtype),
            return_dict=True, output_hidden_states=True)
        return unpack(output.logits, packed), unpack(values.squeeze(-1), packed)

    def _packable_attention(self) -> str | None:
        """The attention both models use when it takes a dense 4D mask and has no sliding
        window (what a packed forward needs), else None (the padded forward is used)."""
        impls = set()
        for m in (self.policy_model, self.value_model):
            cfg = m.config
            if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
                return None
            impls.add(getattr(cfg, "_attn_implementation", None))
        impl = impls.pop() if len(impls) == 1 else None
        return impl if impl in ("sdpa", "eager") else None

    def _pipelined_epochs(self, rollout: PPORollout, exp: PPOExperience) -> None:
        """The same epochs, mini-batches and micro-batches on the fused pipeline: each
        replica runs its processes' micro-batches; the optimizer steps every
        ``gradient_accumulation_steps`` micro-batches, as accelerate's accumulation does."""
        from .pipeline import ProcessBatch

        a, pipe = self.args, self._pipeline
        pad_id = self.processing_class.pad_token_id
        batches = pipe.gather(ProcessBatch.of(rollout, exp))
        mine = batches[pipe.replica * pipe.stages: (pipe.replica + 1) * pipe.stages]
        for epoch in range(a.num_ppo_epochs):
            order = np.random.permutation(a.local_batch_size)
            for mb_idx, mb_start in enumerate(range(0, a.local_batch_size,
                                                    a.local_mini_batch_size)):
                mini = order[mb_start: mb_start + a.local_mini_batch_size]
                starts = range(0, a.local_mini_batch_size, a.per_device_train_batch_size)
                mbs = [b.micro_batch(mini[s: s + a.per_device_train_batch_size], pad_id,
                                     self.fusion.trim_padding) for b in mine for s in starts]
                self._micro_steps += len(starts)
                step = self._micro_steps % a.gradient_accumulation_steps == 0
                stats = pipe.step(mbs, self.optimizer if step else None,
                                  loss_denominator=float(a.gradient_accumulation_steps
                                                         * pipe.world))
                # Summed over the world's micro-batches, each over the denominator: back to
                # the mean over micro-batches.
                to_mean = a.gradient_accumulation_steps / len(starts)
                for role in ("actor", "critic"):
                    for k, v in stats.get(role, {}).items():
                        if k in self._stats:
                            self._stats[k][epoch, mb_idx, : len(starts)] = v * to_mean
        t0 = time.perf_counter()
        pipe.sync_whole_copies()
        self._sync_s = time.perf_counter() - t0

    def _record(self, epoch: int, mini: int, micro: int, pol: PolicyTerms, val: ValueTerms,
                scale: float) -> None:
        at = (epoch, mini, micro)
        stats = {**policy_stats(pol, scale), "vf_loss": val.vf_loss,
                 "vf_clipfrac": val.vf_clipfrac}
        for k, v in stats.items():
            self._stats[k][at] = v

    # 4. metrics ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _log_iteration(self, rollout: PPORollout, exp: PPOExperience, start: float,
                       timings: dict[str, float]) -> None:
        gather = self.accelerator.gather_for_metrics
        st = self._stats
        mean_kl = exp.kl.sum(1).mean()
        mean_entropy = ((-exp.logprobs) * (~exp.padding_mask).float()).sum(1).mean()
        mean_non_score = exp.non_score_reward.sum(1).mean()
        rlhf_reward = mean_non_score + exp.scores.mean()
        lengths = (exp.sequence_lengths + 1).float()
        all_lengths = gather(lengths)
        q = torch.quantile(all_lengths, torch.tensor([0.5, 0.9, 0.99], device=lengths.device))
        metrics: dict[str, float] = {
            "eps": int(self.state.episode / (time.time() - start)),
            "objective/kl": gather(mean_kl).mean().item(),
            "objective/entropy": gather(mean_entropy).mean().item(),
            "objective/non_score_reward": gather(mean_non_score).mean().item(),
            "objective/rlhf_reward": gather(rlhf_reward).mean().item(),
            "objective/scores": gather(exp.scores.mean()).mean().item(),
            "policy/approxkl_avg": gather(st["approxkl"]).mean().item(),
            "policy/clipfrac_avg": gather(st["pg_clipfrac"]).mean().item(),
            "loss/policy_avg": gather(st["pg_loss"]).mean().item(),
            "loss/value_avg": gather(st["vf_loss"]).mean().item(),
            "val/clipfrac_avg": gather(st["vf_clipfrac"]).mean().item(),
            "policy/entropy_avg": gather(st["entropy"]).mean().item(),
            "val/ratio": gather(st["ratio"]).mean().item(),
            "val/ratio_var": gather(st["ratio"]).var().item(),
            "val/num_eos_tokens": (exp.responses
                                   == self.processing_class.eos_token_id).sum().item(),
            "lr": self.lr_scheduler.get_last_lr()[0],
            "episode": self.state.episode,
            "response_length/mean": all_lengths.mean().item(),
            "response_length/p50": q[0].item(),
            "response_length/p90": q[1].item(),
            "response_length/p99": q[2].item(),
            "samples_per_s": self.args.batch_size / max(timings["time/iteration"], 1e-9),
            **timings, **rollout.stats,
        }
        self.state.epoch = self.state.episode / self.train_dataset_len
        self.state.global_step += 1
        self.log(metrics)


@dataclass
class OnlineTrainerState(TrainerState):
    """TRL's trainer state for online trainers: a ``TrainerState`` with an episode counter."""

    episode: int = 0

