"""Generation through rlhf-fusion's backend with sample-level streaming, for TRL's GRPO and RLOO.

:class:`FusedRolloutMixin` goes in front of ``GRPOTrainer``/``RLOOTrainer`` and overrides four
seams; TRL's own ``_generate_and_score_completions`` still runs the whole step:

- ``_generate_single_turn``: completions come from a :class:`ReferenceBackend` (continuous
  batching over a paged KV cache) holding a copy of the policy, refreshed every call. While the
  long tail decodes, each finished sample is scored in micro-batches between decode steps: the
  Ref logprobs, the policy's "old" logprobs where TRL needs them, and the reward functions.
- ``_get_per_token_logps_and_entropies`` and ``_calculate_rewards``: when TRL asks for exactly
  the batch that was streamed (same completion tokens), they return the streamed numbers
  instead of recomputing them. Other logprob passes (the training loss among them) run
  padding-free with ``fusion.padding_free`` where the model and inputs allow it
  (see :meth:`FusedRolloutMixin._padding_free_logps`); anything else goes to TRL unchanged.
  With PEFT, TRL's Ref is the policy object with its adapters disabled, so which pass a
  request is comes from the adapter state, not from which model object is passed.

With several accelerate processes and ``fusion.migrate``, the rollout runs through
:func:`rlhf_fusion.rollout.distributed.run_rollout`, which moves the long tail to fewer
processes and lets the freed ones score (see :class:`StreamScorer`).

Padded completion positions: the streamed tensors hold real values on each completion's own
tokens; positions past a completion's end (which TRL masks) hold :data:`REF_PAD_LOGP` (Ref) or
0 (old), chosen so that TRL's ``exp(ref - logp)`` and ``exp(logp - old)`` stay finite there.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from ...rollout.sampling import derive_seed
from ...rollout.types import SampleResult, SampleSpec
from .compat import check_trl_seams, logps_options, uses_fused_lm_head
from .fusion import FusionConfig, FusionConfigError, generation_backend, vllm_fallback
from .packing import Packed, attention_mask_for, completion_targets, pack
from .scoring import StreamBatch, StreamScorer, stock_module
from .sharded import full_state_dict, plain_copy, sharding

__all__ = ["FUSION_STATE_NAME", "REF_PAD_LOGP", "FusedRolloutMixin"]

FUSION_STATE_NAME = "rlhf_fusion_state.json"
"""The fused trainer's own state in a checkpoint folder, next to TRL's: the generation round,
which seeds the sampling of the next rollout (so a resumed run draws what an uninterrupted one
would have drawn)."""

REF_PAD_LOGP = -1.0e4
"""Ref logprob at padded completion positions: ``exp(ref - logp)`` underflows to 0 there."""


def _trl_function(stock: type, name: str) -> Any:
    """TRL's ``name`` as the trainer module uses it, else from ``trl.trainer.utils`` (TRL 1.14's
    trainers import ``selective_log_softmax_and_entropy`` instead of ``entropy_from_logits``)."""
    fn = getattr(stock_module(stock), name, None)
    if fn is None:
        from trl.trainer import utils

        fn = getattr(utils, name)
    return fn


class FusedRolloutMixin:
    """The seams shared by ``FusedGRPOTrainer`` and ``FusedRLOOTrainer`` (see the module doc).

    Subclasses set ``_stock`` (the TRL class), ``_seams`` (for :func:`check_trl_seams`),
    ``_returns_logprobs`` (GRPO's ``_generate_single_turn`` returns ``(ids, logprobs)``,
    RLOO's only ids) and ``_needs_old_logps``.
    """

    _stock: type
    _seams: Any
    _returns_logprobs: bool

    #: Score finished samples while the rest decode (False: generate everything first, then
    #: score; the same numbers, what tests compare streaming against).
    score_while_decoding: bool = True
    #: Most samples per scoring pass while decoding (at most TRL's per-device batch; None: the
    #: per-device batch). Finished samples wait until they fill a pass: this many, or
    #: ``stream_min_tokens`` padded tokens (see
    #: :func:`~rlhf_fusion.integrations.trl.scoring.pass_is_full`), so early finishers are
    #: scored at about their own width and short completions do not pay a pass's fixed cost
    #: every few samples. Where samples are scored in fixed chunks (after generation without
    #: streaming; the chunks processes freed by migration take from the shared stream), a
    #: chunk holds this many, 8 when None.
    stream_micro_batch: int | None = None
    stream_min_tokens: int = 1024
    #: Model types (``config.model_type``) whose transformers forward is known to honour a
    #: custom 4D mask and explicit ``position_ids`` as the padded forward uses them; other
    #: models take TRL's padded forward under ``fusion.padding_free``.
    padding_free_model_types: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3"})

    def __init__(self, *args: Any, fusion: FusionConfig | None = None, **kwargs: Any) -> None:
        check_trl_seams(self._stock, self._seams)
        self.fusion = fusion if fusion is not None else FusionConfig()
        super().__init__(*args, **kwargs)
        self._fusion_backend: Any = None  # ReferenceBackend or VLLMBackend
        self._fusion_round = 0
        self._fusion_batch: StreamBatch | None = None
        t: Any = self
        if getattr(t, "use_vllm", False):
            self.fusion, notice = vllm_fallback(self.fusion, type(self).__name__,
                                                str(getattr(t, "vllm_mode", "")))
            if notice is not None:
                warnings.warn(notice, UserWarning, stacklevel=2)
        if self.fusion.stream:
            self._check_streamable()

    # -- checkpoints ----------------------------------------------------------------------------
    # What a resumed run needs besides TRL's checkpoint: the generation round (the sampling seed
    # of each rollout derives from it; TRL's own generation draws from the torch RNG, which the
    # Trainer saves). The rest is rebuilt: the generation copy at the first rollout, from the
    # weights the Trainer loaded (and refreshed before every rollout anyway); the R_t planner
    # from fresh timings (R_t decides which process decodes a sample, never what it decodes).
    @override
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)  # type: ignore[misc]
        t: Any = self
        if self.fusion.stream and t.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(t._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}")
            with open(os.path.join(folder, FUSION_STATE_NAME), "w") as f:
                json.dump({"generation_round": self._fusion_round}, f)

    @override
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Where TRL loads its own extra checkpoint state too: called once on every resume.
        super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        if checkpoint is None or not self.fusion.stream:
            return
        path = os.path.join(checkpoint, FUSION_STATE_NAME)
        if not os.path.isfile(path):
            warnings.warn(
                f"{type(self).__name__}: {checkpoint} has no {FUSION_STATE_NAME} (a checkpoint "
                "written by the stock trainer or by FusionConfig.off()): sampling restarts at "
                "round 0, so the resumed run trains on other samples than an uninterrupted one would",
                stacklevel=2)
            return
        with open(path) as f:
            self._fusion_round = int(json.load(f)["generation_round"])

    # -- configuration checks -----------------------------------------------------------------
    def _check_streamable(self) -> None:
        t: Any = self
        bad = []
        if getattr(t, "use_transformers_continuous_batching", False):
            bad.append("transformers continuous batching is on")
        if getattr(t, "top_p", 1.0) not in (None, 1.0):
            bad.append(f"top_p={t.top_p}")
        if getattr(t, "top_k", None) not in (None, 0):
            bad.append(f"top_k={t.top_k}")
        if getattr(t, "min_p", None) not in (None, 0.0):
            bad.append(f"min_p={t.min_p}")
        if getattr(t, "repetition_penalty", 1.0) not in (None, 1.0):
            bad.append(f"repetition_penalty={t.repetition_penalty}")
        if getattr(t.args, "generation_kwargs", None):
            bad.append(f"generation_kwargs={t.args.generation_kwargs}")
        if bad:
            raise FusionConfigError(
                f"{type(self).__name__}: fusion.stream samples with temperature only, from "
                f"rlhf-fusion's generation backend, but {'; '.join(bad)}. Use the default "
                "sampling settings, or pass fusion=FusionConfig(stream=False, migrate=False) "
                "to generate the stock way.")

    def _streamable_batch(self, inputs: Sequence[dict[str, Any]]) -> bool:
        """Batches whose reward inputs streaming reproduces: plain prompts, no tools,
        environments, custom rollouts or images (those take TRL's scoring after generation)."""
        t: Any = self
        return bool(inputs) and "prompt" in inputs[0] and not (
            getattr(t, "tools", None) or getattr(t, "environment_factories", None) is not None
            or getattr(t, "rollout_func", None) is not None
            or "image" in inputs[0] or "images" in inputs[0])

    # -- seams ----------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not self.fusion.stream or not self._streamable_batch(inputs):
            return super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        self._fusion_batch = StreamBatch(inputs=list(inputs))
        try:
            return super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        finally:
            self._fusion_batch = None

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: Any,
                              multimodal_fields: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.fusion.stream or images is not None or multimodal_fields:
            return super()._generate_single_turn(  # type: ignore[misc]
                prompt_ids, images, multimodal_fields, *args, **kwargs)
        batch = self._fusion_batch
        if batch is not None and (batch.done or len(batch.inputs) != len(prompt_ids)):
            batch = None  # a second turn (tool loop) or a foreign call: generate, don't score
        results = self._fused_rollout(prompt_ids, batch)
        completion_ids = [list(r.token_ids) for r in results]
        return (completion_ids, None) if self._returns_logprobs else completion_ids

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any,
                           completion_ids_list: Any) -> torch.Tensor:
        batch = self._fusion_batch
        rows = batch.rows("rewards") if batch is not None and batch.done else []
        if (rows and all(r is not None for r in rows) and completions == batch.completions
                and [list(r.token_ids) for r in batch.results] == list(completion_ids_list)):
            t: Any = self
            local = torch.stack(rows).to(t.accelerator.device)  # type: ignore[arg-type]
            return stock_module(self._stock).gather(local)
        return super()._calculate_rewards(  # type: ignore[misc]
            inputs, prompts, completions, completion_ids_list)

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor,
                                           attention_mask: torch.Tensor, logits_to_keep: int,
                                           *args: Any, **kwargs: Any) -> Any:
        cached = self._streamed_logps(model, input_ids, logits_to_keep, args, kwargs)
        if cached is not None:
            return cached, None, None
        if self.fusion.padding_free:
            packed = self._padding_free_logps(model, input_ids, attention_mask, logits_to_keep,
                                              args, kwargs)
            if packed is not None:
                return packed
        return super()._get_per_token_logps_and_entropies(  # type: ignore[misc]
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    # -- the rollout ----------------------------------------------------------------------------
    def _generation_backend(self) -> Any:
        """A copy of the policy in the backend, with this step's weights pushed into it."""
        t: Any = self
        policy = self._unwrapped(t.model)
        # Under ZeRO-3 / FSDP2 the weights are gathered whole (collective, every process) and
        # the copy is built from them; refreshed this way before every rollout.
        state = full_state_dict(policy)
        if self._fusion_backend is None:
            source = plain_copy(policy, state) if sharding(policy) else policy
            self._fusion_backend = generation_backend(
                source, self.fusion, seed=int(t.args.seed),
                instance_id=t.accelerator.process_index, device=t.accelerator.device)
        self._fusion_backend.update_weights(state)
        return self._fusion_backend

    def _unwrapped(self, model: Any) -> Any:
        """``accelerator.unwrap_model(model)``, remembered per wrapper object: accelerate's looks
        deepspeed up in the installed packages' metadata on every call (``is_deepspeed_available``,
        about 1 ms of CPU where deepspeed is installed), and a rollout asks three times."""
        cache: dict[int, tuple[Any, Any]] = self.__dict__.setdefault("_fusion_unwrapped", {})
        hit = cache.get(id(model))
        if hit is not None and hit[0] is model:
            return hit[1]
        t: Any = self
        net = t.accelerator.unwrap_model(model)
        cache[id(model)] = (model, net)
        return net

    def _sharded(self) -> bool:
        """Whether the policy is sharded (ZeRO-3 / FSDP2): each of its forwards is then a
        collective, so every process must score the same number of micro-batches, in step."""
        t: Any = self
        return sharding(self._unwrapped(t.model)) is not None

    def _sample_specs(self, prompt_ids: Sequence[Sequence[int]], offset: int) -> list[SampleSpec]:
        t: Any = self
        # Deterministic per run and per generation round; sample ids are global, so no two
        # samples of a round (on any process) share their sampling noise.
        seed = derive_seed(int(t.args.seed), self._fusion_round, 0)
        stop = tuple(getattr(t, "eos_token_ids", None) or [t._tokenizer.eos_token_id])
        return [SampleSpec(sample_id=offset + i, prompt_ids=tuple(p),
                           max_new_tokens=int(t.max_completion_length), seed=seed,
                           temperature=float(t.temperature), stop_token_ids=stop)
                for i, p in enumerate(prompt_ids)]

    def _fused_rollout(self, prompt_ids: list[list[int]], batch: StreamBatch | None
                       ) -> list[SampleResult]:
        t: Any = self
        n = len(prompt_ids)
        world, rank = t.accelerator.num_processes, t.accelerator.process_index
        offset = rank * n
        backend = self._generation_backend()
        if batch is not None:
            batch.offset = offset
        if world > 1 and self.fusion.migrate:
            from .migration import migrated_rollout

            results = migrated_rollout(self, backend, prompt_ids, batch)
        else:
            specs = self._sample_specs(prompt_ids, offset)
            scorer = StreamScorer(self, batch, specs) if batch is not None else None
            backend.submit(specs)
            done: list[SampleResult] = []
            pending: list[SampleResult] = []
            stream = scorer is not None and self.score_while_decoding and not self._sharded()
            while backend.unfinished():
                finished = backend.step()
                done.extend(finished)
                pending.extend(finished)
                if stream and scorer.ready(pending):  # type: ignore[union-attr]
                    scorer.score(pending, rows=scorer.max_rows)  # type: ignore[union-attr]
                    pending = []
            if scorer is not None:
                scorer.score(pending, rows=scorer.max_rows if stream else None)
            results = sorted(done, key=lambda r: r.sample_id)
        self._fusion_round += 1
        if [r.sample_id for r in results] != list(range(offset, offset + n)):
            raise RuntimeError(
                f"{type(self).__name__}: the rollout returned samples "
                f"{[r.sample_id for r in results][:8]}..., expected ids {offset}..{offset + n - 1}"
                " exactly once; this is a bug in rlhf-fusion, please report it")
        if batch is not None:
            batch.results = results
            batch.completions = [self._decode_completion(batch, r) for r in results]
            batch.done = True
        return results

    # -- padding-free forward -----------------------------------------------------------------
    def _padding_free_mode(self, model: Any, width: int) -> tuple[str, str, torch.dtype] | None:
        """``(style, attn_implementation, dtype)`` when a packed forward of ``model`` gives what
        TRL's padded one gives, else None (TRL's own forward then runs).

        ``style`` is ``"fused_head"`` where TRL scores through its fused LM head (TRL 1.16)
        and ``"logits"`` where it takes the model's logits (TRL 1.12).
        """
        net = self._unwrapped(model)
        peft = getattr(net, "active_peft_config", None)
        if peft is not None:
            if getattr(peft, "is_prompt_learning", False):
                return None  # virtual tokens go in front of the 2D mask TRL passes
            net = net.get_base_model()
        config = getattr(net, "config", None)
        if config is None or getattr(config, "is_encoder_decoder", False):
            return None
        if config.get_text_config() is not config:
            return None  # multimodal wrappers have their own position schemes (e.g. M-RoPE)
        if getattr(config, "model_type", None) not in self.padding_free_model_types:
            return None
        attn = getattr(config, "_attn_implementation", None)
        if attn not in ("sdpa", "eager"):
            return None  # flash/flex attention take no dense 4D mask
        window = getattr(config, "sliding_window", None)
        if window is not None and width > window:
            return None  # a 4D mask replaces the sliding-window mask
        dtype = getattr(net, "dtype", torch.float32)
        if uses_fused_lm_head(self._stock):
            if not _has_fused_head(net.forward):
                return None
            return "fused_head", attn, dtype
        return "logits", attn, dtype

    def _padding_free_logps(self, model: Any, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor, logits_to_keep: int,
                            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """TRL's ``(logps [B, K], entropies [B, K] | None, None)`` from forwards over the
        packed batch (:mod:`.packing`), or None where that is not supported.

        Values are TRL's on every completion token the mask keeps; masked completion positions
        hold 0 (TRL 1.16 gives 0 there too; TRL 1.12's values there are multiplied by the mask
        everywhere they are used). At most ``batch_size`` bins per forward, each as wide as
        TRL's rows, and with logits no more logits than TRL's chunk would hold; with several
        processes, exactly as many forwards as TRL's (the count must agree across processes),
        each of at most ``batch_size`` bins.
        """
        call = dict(zip(logps_options(self._stock), args))
        call.update(kwargs)
        batch_size = call.pop("batch_size", None)
        compute_entropy = bool(call.pop("compute_entropy", False))
        if any(v is not None and v is not False for v in call.values()):
            return None  # images, MoE aux loss, ...: TRL's padded forward
        rows, width = input_ids.shape
        k = int(logits_to_keep)
        if not 0 < k < width or attention_mask.shape != input_ids.shape:
            return None
        mode = self._padding_free_mode(model, width)
        if mode is None:
            return None
        style, attn, dtype = mode
        packed = pack(input_ids, attention_mask)
        if packed.rows >= rows or completion_targets(packed, width - k) is None:
            return None  # nothing saved, or a token TRL predicts from a padding position
        per = int(batch_size or rows)
        t: Any = self
        if t.accelerator.num_processes > 1:
            # Every process must run as many forwards as the others: a DDP forward broadcasts
            # buffers (and ZeRO-3/FSDP ones gather weights), so one extra forward on one
            # process deadlocks the next collective. TRL runs ceil(rows / batch_size) forwards
            # and every process holds the same number of rows: run that many (the bins split
            # evenly over them), or TRL's own forward where there are fewer bins than that.
            forwards = -(-rows // per)
            if packed.rows < forwards:
                return None
            cuts = [i * packed.rows // forwards for i in range(forwards + 1)]
        else:
            if style == "logits":  # TRL's chunk holds [per, K + 1, V] logits; ours [bins, T, V]
                per = max(1, min(per, per * (k + 1) // width))
            cuts = [*range(0, packed.rows, per), packed.rows]
        outs, logps, ents = [], [], []
        for start, stop in zip(cuts, cuts[1:]):
            part = packed.select(slice(start, stop))
            lp, ent, out = self._packed_forward(model, part, width - k, style,
                                                attention_mask_for(part.attention_mask, attn,
                                                                   dtype), compute_entropy)
            if lp is None:
                return None
            outs.append(out)
            logps.append(lp)
            ents.append(ent)
        index = (torch.cat(outs),)
        lp_all = torch.cat(logps)
        logps_out = lp_all.new_zeros(rows * k).index_put(index, lp_all).view(rows, k)
        ent_out = None
        if compute_entropy:
            ent_all = torch.cat(ents)  # type: ignore[arg-type]
            ent_out = ent_all.new_zeros(rows * k).index_put(index, ent_all).view(rows, k)
        return logps_out, ent_out, None

    def _packed_forward(self, model: Any, part: Packed, first: int, style: str,
                        mask: torch.Tensor, compute_entropy: bool
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """One forward over some bins: ``(logps [M], entropies [M] | None, output index [M])``
        for the bins' completion tokens; logps None if TRL's fused head gave no entropy."""
        t: Any = self
        tg = completion_targets(part, first)
        assert tg is not None  # checked on the whole packed batch; bins never split a sequence
        ids = part.input_ids.reshape(-1)
        inputs = {"input_ids": part.input_ids, "attention_mask": mask,
                  "position_ids": part.position_ids}
        if style == "fused_head":
            labels = torch.full_like(ids, -100)
            labels[tg.token] = ids[tg.token]
            with t.accelerator.autocast():
                out = model(**inputs, labels=labels.view_as(part.input_ids), fused_lm_head=True)
            # The head scores label j from hidden j - 1 and returns [R, C - 1]: shift it back.
            lp = torch.nn.functional.pad(out.log_probs, (1, 0)).reshape(-1)[tg.token]
            if not compute_entropy:
                return lp, None, tg.out
            if out.entropy is None:
                return None, None, tg.out
            ent = torch.nn.functional.pad(out.entropy, (1, 0)).reshape(-1)[tg.token]
            return lp, ent, tg.out
        out = model(**inputs, use_cache=False)
        logits = out.logits.reshape(-1, out.logits.size(-1))[tg.pred] / t.temperature  # [M, V]
        lp = _trl_function(self._stock, "selective_log_softmax")(logits[None],
                                                                  ids[tg.token][None])[0]
        ent = None
        if compute_entropy:
            # As TRL: entropies carry grad only when the entropy bonus is a loss term.
            with torch.set_grad_enabled(torch.is_grad_enabled()
                                        and bool(getattr(t, "_entropy_bonus_enabled", False))):
                ent = _trl_function(self._stock, "entropy_from_logits")(logits)
        return lp, ent, tg.out

    # -- scoring --------------------------------------------------------------------------------
    def _decode_completion(self, batch: StreamBatch, r: SampleResult) -> Any:
        """The completion as TRL's ``_generate`` decodes it (plain text or one assistant turn);
        decoded once per sample (the scorer's reward pass and the batch's list share it)."""
        from trl.data_utils import is_conversational

        done = batch.decoded.get(r.sample_id)
        if done is not None and done[0] == r.token_ids:
            text = done[1]
        else:
            t: Any = self
            text = t.processing_class.batch_decode([list(r.token_ids)],
                                                   skip_special_tokens=True)[0]
            batch.decoded[r.sample_id] = (r.token_ids, text)
        prompt = batch.inputs[r.sample_id - batch.offset]["prompt"]
        if is_conversational({"prompt": prompt}):
            return [{"role": "assistant", "content": text}]
        return text

    def _needs_old_logps(self) -> bool:
        """Whether TRL computes the policy's logprobs of the batch at generation time."""
        return False

    def _ref_pass(self) -> tuple[Any, Any] | None:
        """``(model, context)`` TRL's Ref logprob pass runs: ``ref_model``, or with PEFT the
        policy with its adapters disabled (or its ``"ref"`` adapter active), as TRL's
        ``_generate_and_score_completions`` does; None without a KL term."""
        t: Any = self
        if t.beta == 0.0:
            return None
        if t.ref_model is not None:
            return t.ref_model, contextlib.nullcontext()
        net = self._unwrapped(t.model)
        if _peft_ref_active(net) is None:
            return None  # neither a Ref model nor PEFT: TRL computes no Ref pass either
        use_adapter = getattr(stock_module(self._stock), "use_adapter", None)
        if use_adapter is None:  # pragma: no cover - imported by every supported TRL
            from trl.trainer.utils import use_adapter
        name = "ref" if "ref" in net.peft_config else None
        return t.model, use_adapter(net, adapter_name=name)

    def _logps_role(self, model: Any) -> str | None:
        """Which streamed pass a logprob request is: ``"ref"``, ``"old"`` or None (neither).

        With PEFT the Ref pass is the policy object itself with its adapters disabled, so
        object identity alone cannot tell the Ref pass from the policy's; the adapter state
        does."""
        t: Any = self
        if model is None:
            return None
        if model is t.ref_model:
            return "ref"
        if model is not t.model:
            return None
        ref_active = _peft_ref_active(self._unwrapped(model))
        return "ref" if ref_active else "old"

    def _streamed_logps(self, model: Any, input_ids: torch.Tensor, logits_to_keep: int,
                        args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        batch = self._fusion_batch
        if batch is None or not batch.done or torch.is_grad_enabled():
            return None
        if kwargs.get("compute_entropy") or kwargs.get("compute_aux_loss") or len(args) > 1:
            return None
        if any(k in kwargs and kwargs[k] is not None for k in ("pixel_values", "token_type_ids",
                                                               "mm_token_type_ids")):
            return None
        role = self._logps_role(model)
        if role is None:
            return None
        rows = batch.rows(role)
        if not rows or any(r is None for r in rows) or input_ids.size(0) != len(rows):
            return None
        fill = REF_PAD_LOGP if role == "ref" else 0.0
        out = torch.full((len(rows), logits_to_keep), fill, dtype=rows[0].dtype)  # type: ignore[union-attr]
        expect = torch.full((len(rows), logits_to_keep), -1, dtype=torch.long)
        for i, (row, res) in enumerate(zip(rows, batch.results)):
            k = len(res.token_ids)
            if k > logits_to_keep:
                return None
            out[i, :k] = row  # type: ignore[index]
            expect[i, :k] = torch.tensor(res.token_ids)
        got = input_ids[:, -logits_to_keep:].cpu()
        have = expect >= 0
        if not torch.equal(got[have], expect[have]):
            return None  # not the streamed batch (shuffled, filtered, ...): let TRL compute it
        return out.to(input_ids.device)


def _peft_ref_active(net: Any) -> bool | None:
    """Whether a PEFT model runs as TRL's Ref (adapters disabled, or the ``"ref"`` adapter
    active); None for a model without PEFT."""
    config = getattr(net, "peft_config", None)
    if not isinstance(config, dict) or not hasattr(net, "active_adapters"):
        return None
    disabled = getattr(net, "_adapters_disabled", None)
    if disabled is None:  # PEFT without the model-level flag: ask the adapter layers
        disabled = any(getattr(m, "_disable_adapters", False) for m in net.modules())
    if disabled:
        return True
    return "ref" in config and "ref" in list(net.active_adapters)


def _has_fused_head(forward: Any) -> bool:
    """Whether ``forward`` (or a function it wraps) is TRL's ``add_fused_lm_head`` forward."""
    fn = forward
    for _ in range(8):  # wrappers made with functools.wraps, as TRL's own
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None and "fused_lm_head" in code.co_varnames:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False
