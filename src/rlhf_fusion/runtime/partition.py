"""Pipeline-stage partitioning of Hugging Face decoder models.

A stage keeps a contiguous range of decoder layers; the first stage also keeps the token (and,
for GPT-2, position) embeddings, the last the final norm and the LM head (Actor) or value head
(Critic). Partitioning is done *in place*: submodules that live on other stages are replaced by
parameter-less :class:`Dropped` placeholders, so the parameters a rank keeps are still reached
under their original names (``model.layers.3.mlp.up_proj.weight``) and the LightningModule's
state dict, optimizers and checkpoints speak the same names as the unpipelined model.

Supported families: the Llama layout (``embed_tokens``/``layers``/``norm``/``rotary_emb``:
Llama, Qwen2, Mistral, ...) and GPT-2 (``wte``/``wpe``/``h``/``ln_f``). The stage forward calls
the same submodules, with the same arguments, as the model's own ``forward`` (transformers 5),
so stage outputs chained together equal the full model's output bit for bit.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from .errors import PartitionError

ROLES = ("actor", "critic")


class CriticModel(nn.Module):
    """A value model: a decoder backbone (``LlamaModel``, ``GPT2Model``, ...) and a linear head.

    ``forward`` returns one value per position, shape ``[batch, seq]`` (use
    :func:`rlhf_fusion.runtime.ppo.values_from_head` to align them with actions).
    """

    def __init__(self, backbone: nn.Module, hidden_size: int | None = None, *, bias: bool = False):
        super().__init__()
        self.backbone = backbone
        size = hidden_size if hidden_size is not None else backbone.config.hidden_size
        self.value_head = nn.Linear(size, 1, bias=bias)

    @property
    def config(self):  # noqa: ANN201 - the backbone's transformers config
        return self.backbone.config

    @classmethod
    def from_config(cls, config, **kwargs) -> CriticModel:  # noqa: ANN001
        from transformers import AutoModel

        return cls(AutoModel.from_config(config, **kwargs))

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs) -> CriticModel:
        """A backbone from the Hub or a local directory, with a freshly initialised value head."""
        from transformers import AutoModel

        return cls(AutoModel.from_pretrained(name_or_path, **kwargs))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        **kwargs,
    ) -> Tensor:
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **kwargs,
        )
        return self.value_head(out.last_hidden_state).squeeze(-1)


class Dropped(nn.Module):
    """Placeholder for a submodule that lives on another pipeline stage (holds no parameters)."""

    def __init__(self, what: str, stage: int):
        super().__init__()
        self.what = what
        self.stage = stage

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise RuntimeError(
            f"{self.what} is not on pipeline stage {self.stage}: this model was partitioned by "
            "rlhf_fusion; run it through its PipelineStage or train it without the pipeline"
        )

    def extra_repr(self) -> str:
        return f"{self.what}, dropped on stage {self.stage}"


@dataclass(frozen=True)
class _Layout:
    family: str  # "llama" | "gpt2"
    base_attr: str  # attribute of the wrapper holding the decoder ("model", "transformer", ...)
    head_attr: str  # "lm_head" | "value_head" | "score"


def _layout(model: nn.Module, role: str) -> _Layout:
    if role not in ROLES:
        raise PartitionError(f"role: must be one of {ROLES}, got {role!r}")
    if role == "critic":
        # Our CriticModel, or a transformers *ForSequenceClassification (TRL's value models):
        # a decoder plus a linear head applied to every position's final hidden state.
        hf_base = next((a for a in ("model", "transformer") if hasattr(model, a)), "")
        if hasattr(model, "backbone") and hasattr(model, "value_head"):
            base_attr, head_attr = "backbone", "value_head"
        elif hf_base and hasattr(model, "score"):
            base_attr, head_attr = hf_base, "score"
        else:
            raise PartitionError(
                f"critic: {type(model).__name__} is not supported; use "
                "rlhf_fusion.runtime.CriticModel (a decoder backbone plus value_head), e.g. "
                "CriticModel.from_config(LlamaConfig(...)), or a *ForSequenceClassification "
                "with num_labels=1"
            )
    else:
        base_attr = next((a for a in ("model", "transformer") if hasattr(model, a)), "")
        if not base_attr or not hasattr(model, "lm_head"):
            raise PartitionError(
                f"actor: {type(model).__name__} is not supported; expected a *ForCausalLM / "
                "GPT2LMHeadModel with .model or .transformer and .lm_head"
            )
        head_attr = "lm_head"
    base = getattr(model, base_attr)
    if all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        family = "llama"
    elif all(hasattr(base, a) for a in ("wte", "wpe", "h", "ln_f")):
        family = "gpt2"
    else:
        raise PartitionError(
            f"{role}: decoder {type(base).__name__} has neither the Llama layout "
            "(embed_tokens, layers, norm, rotary_emb) nor the GPT-2 layout (wte, wpe, h, ln_f); "
            "supported: Llama, Qwen2, Mistral and GPT-2 families"
        )
    return _Layout(family, base_attr, head_attr)


def _layers(base: nn.Module, family: str) -> nn.ModuleList:
    return base.layers if family == "llama" else base.h


def num_layers(model: nn.Module, role: str) -> int:
    """Number of decoder layers of an Actor (``role="actor"``) or Critic model."""
    lay = _layout(model, role)
    return len(_layers(getattr(model, lay.base_attr), lay.family))


def split_layers(total: int, num_stages: int, layers: Sequence[int] | None = None) -> list[range]:
    """Layer ranges per stage: ``layers`` gives the count per stage, else an even split.

    With an even split the remainder goes to the earliest stages, because the last stage also
    carries the LM/value head.
    """
    if num_stages < 1:
        raise PartitionError(f"pipeline_stages: must be >= 1, got {num_stages}")
    if layers is None:
        if total < num_stages:
            raise PartitionError(
                f"pipeline_stages: {num_stages} stages need at least {num_stages} decoder layers, "
                f"the model has {total}; use fewer stages or a deeper model"
            )
        base, extra = divmod(total, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        counts = [int(c) for c in layers]
        if len(counts) != num_stages:
            raise PartitionError(
                f"layers: {len(counts)} entries {counts} but the model has {num_stages} pipeline "
                "stages; give one layer count per stage"
            )
        if any(c < 0 for c in counts) or sum(counts) != total:
            raise PartitionError(
                f"layers: {counts} must be non-negative and sum to the model's {total} decoder "
                "layers"
            )
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


@dataclass
class PipelineStage:
    """One stage of a partitioned Actor or Critic. ``module`` is the pruned model itself."""

    module: nn.Module
    role: str
    stage: int
    num_stages: int
    layers: range
    family: str
    base_attr: str
    head_attr: str
    # True when the input embedding and the LM head share one weight but sit on different
    # stages: the first and last stage each hold it and their gradients must be summed.
    tied: bool = False
    _layer_types: tuple[str, ...] | None = field(default=None, repr=False)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def base(self) -> nn.Module:
        return getattr(self.module, self.base_attr)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def tied_weight(self) -> nn.Parameter | None:
        """The embedding/LM-head weight shared with another stage, if this stage holds it."""
        if not self.tied:
            return None
        if self.is_first:
            emb = self.base.embed_tokens if self.family == "llama" else self.base.wte
            return emb.weight
        if self.is_last:
            return getattr(self.module, self.head_attr).weight
        return None

    # -- forward ------------------------------------------------------------------------------
    def __call__(self, hidden: Tensor | None, mb: Mapping[str, Tensor]) -> Tensor:
        return self.forward(hidden, mb)

    def forward(self, hidden: Tensor | None, mb: Mapping[str, Tensor]) -> Tensor:
        """Run this stage on one micro-batch.

        ``hidden`` is the previous stage's output (``None`` on the first stage, which reads
        ``mb["input_ids"]``). Returns hidden states, or on the last stage the logits (Actor) or
        per-position values (Critic).
        """
        layers = self._layers_llama if self.family == "llama" else self._layers_gpt2
        hidden = layers(hidden, mb)
        if self.is_last:
            norm = self.base.norm if self.family == "llama" else self.base.ln_f
            return self._head(norm(hidden))
        return hidden

    def _head(self, hidden: Tensor) -> Tensor:
        head = getattr(self.module, self.head_attr)
        out = head(hidden)
        return out.squeeze(-1) if self.role == "critic" else out

    def _mask_args(self, hidden: Tensor, attention_mask: Tensor, position_ids: Tensor
                   ) -> dict[str, object]:
        """Arguments of ``transformers``' mask builders, as the model's own forward passes them
        (``inputs_embeds`` only lends shape and dtype)."""
        return {
            "config": self.base.config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            _mask_cache_arg(): None,
            "position_ids": position_ids,
        }

    def _layers_llama(self, hidden: Tensor | None, mb: Mapping[str, Tensor]) -> Tensor:
        """Embeddings (first stage) and this stage's decoder layers of a Llama-like model."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        base = self.base
        pos = mb["position_ids"]
        if self.is_first:
            hidden = base.embed_tokens(mb["input_ids"])
        assert hidden is not None
        kwargs = self._mask_args(hidden, mb["attention_mask"], pos)
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if getattr(base, "has_sliding_layers", False):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        layer_types = getattr(base.config, "layer_types", None)
        position_embeddings = base.rotary_emb(hidden, position_ids=pos)
        for i in self.layers:
            mask = masks[layer_types[i]] if layer_types else masks["full_attention"]
            hidden = base.layers[i](
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=pos,
                use_cache=False,   # no cache argument: its default (None) under either name
            )
        return hidden

    def _layers_gpt2(self, hidden: Tensor | None, mb: Mapping[str, Tensor]) -> Tensor:
        """Embeddings (first stage) and this stage's blocks of a GPT-2-like model."""
        from transformers.masking_utils import create_causal_mask

        base = self.base
        pos = mb["position_ids"]
        if self.is_first:
            embeds = base.wte(mb["input_ids"])
            hidden = base.drop(embeds + base.wpe(pos))
        assert hidden is not None
        attn = mb["attention_mask"]
        mask = create_causal_mask(**self._mask_args(hidden, attn.view(attn.shape[0], -1), pos))
        for i in self.layers:
            # positional: the cache argument is named differently across transformers versions
            hidden = base.h[i](hidden, None, mask, None, encoder_attention_mask=None,
                               use_cache=False, position_ids=pos)
        return hidden


@functools.cache
def _mask_cache_arg() -> str:
    """The name of the mask builders' (required) cache argument: ``cache`` since
    transformers 5.2x, ``past_key_values`` before (the old name warns, and goes in 5.40)."""
    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters \
        else "past_key_values"


def partition_(
    model: nn.Module,
    role: str,
    stage: int,
    num_stages: int,
    layers: Sequence[int] | None = None,
) -> PipelineStage:
    """Prune ``model`` in place down to pipeline stage ``stage`` of ``num_stages``.

    ``role`` is ``"actor"`` (a causal LM) or ``"critic"`` (:class:`CriticModel` or a
    ``*ForSequenceClassification`` with one label); ``layers``
    optionally gives the number of decoder layers per stage. Returns the stage runner.
    """
    lay = _layout(model, role)
    if not 0 <= stage < num_stages:
        raise PartitionError(f"stage: {stage} is outside 0..{num_stages - 1}")
    base = getattr(model, lay.base_attr)
    blocks = _layers(base, lay.family)
    ranges = split_layers(len(blocks), num_stages, layers)
    mine = ranges[stage]
    first, last = stage == 0, stage == num_stages - 1
    head = getattr(model, lay.head_attr)
    emb = base.embed_tokens if lay.family == "llama" else base.wte
    tied = role == "actor" and num_stages > 1 and head.weight is emb.weight
    for i in range(len(blocks)):
        if i not in mine:
            blocks[i] = Dropped(f"{role} decoder layer {i}", stage)
    if not first:
        if lay.family == "llama":
            base.embed_tokens = Dropped(f"{role} token embedding", stage)
        else:
            base.wte = Dropped(f"{role} token embedding", stage)
            base.wpe = Dropped(f"{role} position embedding", stage)
    if not last:
        if lay.family == "llama":
            base.norm = Dropped(f"{role} final norm", stage)
        else:
            base.ln_f = Dropped(f"{role} final norm", stage)
        setattr(model, lay.head_attr, Dropped(f"{role} {lay.head_attr}", stage))
    return PipelineStage(
        module=model,
        role=role,
        stage=stage,
        num_stages=num_stages,
        layers=mine,
        family=lay.family,
        base_attr=lay.base_attr,
        head_attr=lay.head_attr,
        tied=tied,
    )
