"""The four models of PPO, the tokenizer and the reward, from Hub ids, local dirs or configs.

Every rank builds the same weights from the same source (seeded initialisation for configs,
the same files for pretrained models), so no broadcast is needed before the first iteration.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..runtime.partition import CriticModel
from .arithmetic import correct
from .errors import LoopConfigError
from .reward_functions import is_function_spec, resolve_reward_spec
from .tokenizers import ArithmeticTokenizer, CharTokenizer

if TYPE_CHECKING:
    from .config import ModelsConfig, ModelSource, RLHFConfig

MODEL_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")

RewardFn = Callable[[str, str], float]
"""A rule-based reward, as TRL's reward functions: ``f(prompt_text, response_text) -> score``."""


#: ``models.tokenizer`` names built here (nothing downloaded): the demo's tokenizers.
BUILTIN_TOKENIZERS: dict[str, Callable[[], Any]] = {"chars": CharTokenizer,
                                                     "arithmetic": ArithmeticTokenizer}


class HFTokenizer:
    """Adapter over a ``transformers`` tokenizer (chat template when it has one)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.vocab_size = len(tok)

    def encode(self, text: str) -> list[int]:
        if getattr(self.tok, "chat_template", None):
            return list(self.tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True))
        return list(self.tok(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(cfg: ModelsConfig) -> Any:
    name = cfg.tokenizer or (cfg.actor if isinstance(cfg.actor, str) else None)
    if name is None:
        return CharTokenizer()
    if name in BUILTIN_TOKENIZERS:
        return BUILTIN_TOKENIZERS[name]()
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(name))


def tiny_config(
    kind: str = "llama",
    *,
    vocab_size: int = 128,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_positions: int = 4096,
    tie: bool | None = None,
) -> Any:
    """A small ``transformers`` config of a supported family (never downloaded), dropout off.

    ``tie`` sets ``tie_word_embeddings`` (None: the family's default; GPT-2 ties).
    """
    import transformers

    inter = intermediate_size or 2 * hidden_size
    extra = {} if tie is None else {"tie_word_embeddings": bool(tie)}
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=hidden_size, n_layer=layers, n_head=heads,
            n_inner=inter, n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, **extra)
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}
    if kind not in classes:
        raise LoopConfigError(f"model family {kind!r}: supported {', '.join(MODEL_FAMILIES)}")
    return classes[kind](
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, attention_dropout=0.0, **extra)


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` under ``torch.manual_seed(seed)``, leaving the global RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_causal_lm(config: Any, seed: int = 0) -> nn.Module:
    """A randomly initialised causal LM (Actor or Ref), in eval mode."""
    from transformers import AutoModelForCausalLM

    return seeded(seed, lambda: AutoModelForCausalLM.from_config(config)).eval()


def build_value_model(config: Any, seed: int = 0) -> CriticModel:
    """A randomly initialised value model (Critic or Reward: backbone + scalar head), eval mode."""
    return seeded(seed, lambda: CriticModel.from_config(config)).eval()


# The keys a model source config may use, and tiny_config's names for them.
_SOURCE_KEYS = {"family": "kind", "hidden": "hidden_size", "layers": "layers", "heads": "heads",
                "kv_heads": "kv_heads", "vocab_size": "vocab_size", "tie": "tie",
                "intermediate_size": "intermediate_size", "max_positions": "max_positions"}


def _config_of(src: Mapping[str, Any], vocab_size: int, name: str = "model config"
               ) -> tuple[Any, int]:
    check_source_keys(name, src)
    kw = dict(src)
    seed = int(kw.pop("seed", 0))
    args = {"vocab_size": vocab_size, "max_positions": 2048,
            **{_SOURCE_KEYS[k]: v for k, v in kw.items()}}
    return tiny_config(**args), seed


def check_source_keys(name: str, src: Mapping[str, Any]) -> None:
    """A tiny config's keys and values, each named (``models.actor.layers``) with the fix."""
    known = sorted([*_SOURCE_KEYS, "seed"])
    unknown = sorted(set(src) - set(known))
    if unknown:
        raise LoopConfigError(f"{name}: unknown keys {unknown}; known: {known}")
    fam = src.get("family", "llama")
    if fam not in MODEL_FAMILIES:
        raise LoopConfigError(f"{name}.family: unknown model family {fam!r}; supported: "
                              f"{', '.join(MODEL_FAMILIES)}")
    for key in ("hidden", "layers", "heads", "kv_heads", "vocab_size", "intermediate_size",
                "max_positions"):
        v = src.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise LoopConfigError(f"{name}.{key}: must be an integer >= 1, got {v!r}")
    seed = src.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LoopConfigError(f"{name}.seed: must be an integer >= 0, got {seed!r}")
    tie = src.get("tie")
    if tie is not None and not isinstance(tie, bool):
        raise LoopConfigError(f"{name}.tie: must be true or false, got {tie!r}")
    hidden, heads = src.get("hidden", 64), src.get("heads", 4)
    kv = src.get("kv_heads", 2)
    if hidden % heads:
        raise LoopConfigError(f"{name}.heads: hidden {hidden} is not a multiple of heads "
                              f"{heads}; use a divisor of {hidden}")
    if fam != "gpt2" and heads % kv:
        raise LoopConfigError(f"{name}.kv_heads: heads {heads} is not a multiple of kv_heads "
                              f"{kv}; use a divisor of {heads}")


# A Hub id: ``name`` or ``org/name`` (letters, digits, ``-_.``; huggingface_hub's rule).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")

LOCAL_FOLDER_FIX = ("make one with save_pretrained (docs/loop.md, 'A local model folder') or "
                    "give a Hub id such as Qwen/Qwen2.5-0.5B-Instruct")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")


def source_config(name: str, src: ModelSource, vocab_size: int | None, *,
                  weights: bool = True) -> Any:
    """The ``transformers`` config of a model source, or :class:`LoopConfigError` naming the
    field: a local folder that is missing or holds no ``config.json``, a Hub id that cannot be
    read, a tiny config with bad keys; (``weights``) a folder without weight files. Nothing
    but the config is read."""
    from transformers import AutoConfig

    if isinstance(src, Mapping):
        return _config_of(src, vocab_size or 128, name)[0]
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoopConfigError(f"{name}: {src} is a file; give the model's folder (the one "
                                  "holding config.json)")
        if not (path / "config.json").is_file():
            raise LoopConfigError(f"{name}: {src} holds no config.json; {LOCAL_FOLDER_FIX}")
        if weights and not any(any(path.glob(w)) for w in _WEIGHT_FILES):
            raise LoopConfigError(f"{name}: {src} holds no weights ({', '.join(_WEIGHT_FILES)}); "
                                  f"{LOCAL_FOLDER_FIX}")
        try:
            return AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise LoopConfigError(f"{name}: {src}/config.json cannot be read: "
                                  f"{_first_line(exc)}") from None
    if not _HUB_ID.match(src) or src.startswith((".", "~")):
        raise LoopConfigError(f"{name}: {src}: no such directory; {LOCAL_FOLDER_FIX}")
    try:
        return AutoConfig.from_pretrained(src, local_files_only=True)   # in the Hub cache
    except (OSError, ValueError):
        pass
    unreachable = _hub_unreachable()
    if unreachable:
        raise LoopConfigError(
            f"{name}: {src}: no such directory, and not in the Hub cache while the Hub cannot "
            f"be reached ({unreachable}); give an existing local folder (docs/loop.md, 'A local "
            "model folder'), or run where the Hub is reachable once")
    try:
        return AutoConfig.from_pretrained(src)
    except (OSError, ValueError) as exc:
        raise LoopConfigError(
            f"{name}: {src}: no such directory, and the Hub model cannot be read "
            f"({_first_line(exc)}); give an existing local folder, or check the Hub id and the "
            "network (offline: docs/loop.md, 'A local model folder')") from None


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be asked (offline mode, a host that does not resolve), else None:
    asking anyway costs half a minute of retries before the same answer."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return f"{host} does not resolve: {exc.strerror or exc}"
    return None


@dataclass(frozen=True)
class ModelShapes:
    """What the run's model sources are, read before any process starts: each built
    source's transformers config and decoder layer count, by field (``models.actor``, ...)."""

    configs: Mapping[str, Any]
    layers: Mapping[str, int]


def check_sources(cfg: RLHFConfig) -> ModelShapes:
    """Every model source of ``cfg`` read and built on the meta device, before any process
    starts: unknown keys, missing folders, unknown reward rules, a decoder the pipeline
    cannot split. Returns their configs and layer counts (the placement's checks against
    them: :func:`rlhf_fusion.loop.resolve.resolve_run`)."""
    from transformers import AutoModelForCausalLM

    from ..runtime.partition import num_layers

    m = cfg.models
    reward_rule = callable(m.reward) or is_function_spec(m.reward) or (
        isinstance(m.reward, str) and m.reward in BUILTIN_REWARDS)
    if (isinstance(m.reward, str) and not reward_rule and "/" not in m.reward
            and not Path(m.reward).expanduser().exists()):
        raise LoopConfigError(
            f"models.reward: {m.reward!r} is not a built-in rule ({', '.join(BUILTIN_REWARDS)}) "
            "nor a local folder; give one of those rules, a reward model (a Hub id org/name or "
            "a local folder), or (in Python) a function f(prompt, response) -> float")
    sources = {"models.actor": m.actor, "models.critic": m.critic, "models.ref": m.ref,
               "models.reward": None if reward_rule else m.reward}
    if m.tokenizer is not None and not Path(m.tokenizer).expanduser().exists() and (
            not _HUB_ID.match(m.tokenizer) or m.tokenizer.startswith((".", "~"))):
        raise LoopConfigError(f"models.tokenizer: {m.tokenizer}: no such directory; give a "
                              "local tokenizer folder or a Hub id (or leave it unset: the "
                              "actor's)")
    if isinstance(m.actor, str):
        source_config("models.actor", m.actor, None)   # its folder before its tokenizer
    try:
        vocab = int(load_tokenizer(m).vocab_size)
    except (OSError, ValueError) as exc:
        field = "models.tokenizer" if m.tokenizer is not None else "models.actor"
        raise LoopConfigError(f"{field}: its tokenizer cannot be loaded: "
                              f"{_first_line(exc)}") from None
    layers: dict[str, int] = {}
    configs: dict[str, Any] = {}
    for name, src in sources.items():
        if src is None:
            continue
        config = configs[name] = source_config(name, src, vocab)
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except Exception as exc:  # noqa: BLE001 - any build failure is this source's fault
            raise LoopConfigError(f"{name}: transformers cannot build it: "
                                  f"{_first_line(exc)}") from None
        try:
            layers[name] = num_layers(model, "actor")
        except ValueError as exc:
            raise LoopConfigError(f"{name}: {exc}") from None
    return ModelShapes(configs, layers)


def causal_lm(src: ModelSource, vocab_size: int, seed: int = 0) -> nn.Module:
    """An Actor/Ref: ``AutoModelForCausalLM`` from a Hub id, a local dir or a tiny config."""
    from transformers import AutoModelForCausalLM

    if isinstance(src, Mapping):
        config, s = _config_of(src, vocab_size)
        return build_causal_lm(config, seed + s)
    return AutoModelForCausalLM.from_pretrained(src, **_float32())


def value_model(src: ModelSource, vocab_size: int, seed: int = 0) -> CriticModel:
    """A Critic/Reward: the source's decoder backbone and a freshly seeded value head."""
    if isinstance(src, Mapping):
        config, s = _config_of(src, vocab_size)
        return build_value_model(config, seed + s)
    backbone = load_backbone(src)
    return seeded(seed, lambda: CriticModel(backbone))


# The heads a causal LM or a reward model checkpoint holds beside its decoder backbone.
_HEAD_KEYS = (r"^lm_head\.", r"^score\.")


def load_backbone(src: str) -> nn.Module:
    """The decoder backbone (``AutoModel``) of a checkpoint, in float32.

    A causal LM's checkpoint also holds ``lm_head.weight`` (a reward model's, ``score``), which
    the backbone has no place for: transformers would print a LOAD REPORT marking it
    UNEXPECTED on every rank. Leaving the head out is what is meant here, so those keys are
    declared expected for this load (any other mismatch is still reported)."""
    from transformers import AutoConfig, AutoModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cls = MODEL_MAPPING[type(AutoConfig.from_pretrained(src))]
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected", _UNSET)
    cls._keys_to_ignore_on_load_unexpected = [*(getattr(cls, "_keys_to_ignore_on_load_unexpected",
                                                        None) or []), *_HEAD_KEYS]
    try:
        return AutoModel.from_pretrained(src, **_float32())
    finally:
        if before is _UNSET:
            del cls._keys_to_ignore_on_load_unexpected
        else:
            cls._keys_to_ignore_on_load_unexpected = before


_UNSET = object()


def _float32() -> dict[str, Any]:
    """float32 weights, under the keyword this transformers takes (``dtype`` since 4.56;
    ``torch_dtype`` before, deprecated after)."""
    import transformers
    from packaging.version import Version

    new = Version(transformers.__version__) >= Version("4.56")
    return {"dtype" if new else "torch_dtype": torch.float32}


def model_configs(cfg: ModelsConfig) -> dict[str, Any]:
    """Per model (actor, critic, ref, reward): its source's ``transformers`` config, ``None``
    for a rule reward (no network). Nothing is loaded but the configs (and the tokenizer,
    whose vocabulary the tiny configs take)."""
    from transformers import AutoConfig

    vocab = int(load_tokenizer(cfg).vocab_size)

    def config(src: ModelSource) -> Any:
        return (_config_of(src, vocab)[0] if isinstance(src, Mapping)
                else AutoConfig.from_pretrained(src))

    out = {"actor": config(cfg.actor)}
    out["ref"] = out["actor"] if cfg.ref is None else config(cfg.ref)
    out["critic"] = config(cfg.critic) if cfg.critic is not None else out["actor"]
    rule = callable(cfg.reward) or is_function_spec(cfg.reward) or (
        isinstance(cfg.reward, str) and cfg.reward in BUILTIN_REWARDS)
    out["reward"] = None if rule else config(cfg.reward)
    return out


def model_shapes(configs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per model role of ``configs`` (:func:`model_configs`): the shape the placement planner
    needs (``params``, ``layers``, ``hidden``, ``vocab``, ``heads``, ``kv_heads``);
    parameters are counted on the meta device, so nothing is allocated."""
    from transformers import AutoModelForCausalLM

    def shape(config: Any) -> dict[str, Any]:
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        get = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(getattr(get, "num_attention_heads", 0) or getattr(get, "n_head", 0))
        return {"params": float(n), "layers": int(get.num_hidden_layers),
                "hidden": int(get.hidden_size), "vocab": int(get.vocab_size), "heads": heads,
                "kv_heads": int(getattr(get, "num_key_value_heads", heads) or heads)}

    # A rule costs next to nothing: the smallest model the planner takes stands in for it.
    rule = {"params": 1e3, "layers": 1, "hidden": 8, "heads": 1,
            "vocab": int(configs["actor"].vocab_size)}
    return {role: rule if conf is None else shape(conf) for role, conf in configs.items()}


def vowel_fraction(prompt: str, response: str, *, window: int = 8) -> float:
    """The demo's rule-based reward: the fraction of vowels among the response's first
    ``window`` characters (missing characters count as consonants). Only the opening is
    scored, so PPO learns what to write first and the length is left to sampling."""
    return sum(c in "aeiou" for c in response[:window]) / window


BUILTIN_REWARDS: dict[str, RewardFn] = {"vowels": vowel_fraction, "arithmetic": correct}


@dataclass
class Models:
    """Actor and Critic (trained), Ref (frozen), and the Reward (model or function); no
    Critic (``None``) for a critic-free algorithm."""

    actor: nn.Module
    critic: CriticModel | None
    ref: nn.Module
    reward: nn.Module | RewardFn
    tokenizer: Any


def build_models(cfg: ModelsConfig, *, critic: bool = True) -> Models:
    """The run's models; ``critic=False`` (a critic-free algorithm) builds no Critic."""
    tokenizer = load_tokenizer(cfg)
    vocab = int(tokenizer.vocab_size)
    actor = causal_lm(cfg.actor, vocab, cfg.seed)
    ref = copy.deepcopy(actor) if cfg.ref is None else causal_lm(cfg.ref, vocab, cfg.seed)
    value = (value_model(cfg.critic if cfg.critic is not None else cfg.actor, vocab,
                         cfg.seed + 1) if critic else None)
    reward: nn.Module | RewardFn
    if callable(cfg.reward):
        reward = cfg.reward
    elif is_function_spec(cfg.reward):
        reward = resolve_reward_spec(cfg.reward)   # type: ignore[arg-type]
    elif isinstance(cfg.reward, str) and cfg.reward in BUILTIN_REWARDS:
        reward = BUILTIN_REWARDS[cfg.reward]
    else:
        reward = value_model(cfg.reward, vocab, cfg.seed + 2)
    for m in (ref, reward):
        if isinstance(m, nn.Module):
            m.requires_grad_(False).eval()
    return Models(actor.train(), value.train() if value is not None else None, ref, reward,
                  tokenizer)
