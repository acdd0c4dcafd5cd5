"""The experience batch's all-gather form: columns, not objects.

Every rollout ends with each rank's results and experiences reaching every rank, in both the
fused and the serial mode. Pickled as objects, 64 samples cost 2.5 ms to dump and 1.4 ms to
load per rank on the 2-core VM (every tensor goes through numpy, every dataclass through its
state): a fixed cost on every rollout's critical path (the last rank to finish dumps, its
peers wait, then load). As one int64 and two float64 arrays they cost about half
of it, a dump of 1.0-1.2 ms and a load of 0.8-1.1 ms
(``benchmarks/results/grpo_demo_compare_analysis.md``, session 49).

``pack_batch`` keeps the objects as they are when a field does not fit the columns (a tensor
that is not a 1-D float64 CPU tensor, a reward that is not a float, a subclass): the pickled
form still carries it exactly. Unpacked, every value is the one packed, bit for bit (float64
holds a Python float exactly), in the container it went in (a tuple or a list); an
experience's three tensors are views into the message's one buffer. The sending rank
keeps its own objects: it does not unpack its own message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .inference import Experience
from .types import SampleResult

_RESULT_HEAD = 7       # sample_id, prompt len, token len, finish reason, instance, migrated, kinds
_EXPERIENCE_HEAD = 5   # sample_id, prompt len, response len, finish reason, kinds
_TENSORS = ("logprobs", "ref_logprobs", "values")
# A backend may hand on its spec's prompt as a list: the containers come back as they went.
_SEQUENCES = (tuple, list)


def _kinds(*seqs: object) -> int | None:
    """Each container's type as two bits (0 tuple, 1 list); None for any other type."""
    out = 0
    for k, x in enumerate(seqs):
        t = type(x)
        if t not in _SEQUENCES:
            return None
        out |= _SEQUENCES.index(t) << k
    return out


def _as(kinds: int, k: int, items: list) -> tuple | list:
    return items if kinds >> k & 1 else tuple(items)


@dataclass(frozen=True)
class PackedBatch:
    """One rank's results and experiences as columns (``raw``: as objects, when they do not
    fit). ``n_experiences`` is -1 for no experiences (``None``: a rollout without scoring)."""

    n_results: int
    n_experiences: int
    reasons: tuple[str, ...]
    ints: np.ndarray             # per result, then per experience: the head, prompt, tokens
    floats: np.ndarray           # per result its logprobs, then per experience its reward
    tensors: np.ndarray | None   # per experience: logprobs, ref_logprobs, values
    raw: tuple[list[SampleResult], list[Experience] | None] | None = None


def _fits(results: Sequence[Any], exps: Sequence[Any] | None) -> bool:
    if any(type(s) is not SampleResult or _kinds(s.prompt_ids, s.token_ids, s.logprobs) is None
           for s in results):
        return False
    if exps is None:
        return True
    for e in exps:
        if (type(e) is not Experience or type(e.reward) is not float
                or _kinds(e.prompt_ids, e.response_ids) is None):
            return False
        for k in _TENSORS:
            t = getattr(e, k)
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.dim() == 1
                    and t.device.type == "cpu" and not t.requires_grad
                    and t.numel() == len(e.response_ids)):
                return False
    return True


def pack_batch(results: Sequence[SampleResult], exps: Sequence[Experience] | None
               ) -> PackedBatch:
    """``results`` and ``exps`` (or ``None``) as columns, for a pickle that is cheap both ways."""
    if _fits(results, exps):
        try:
            return _pack(results, exps)
        except (TypeError, ValueError, OverflowError):   # an id or a float numpy will not take
            pass
    return PackedBatch(0, 0, (), np.zeros(0, np.int64), np.zeros(0), None,
                       raw=(list(results), None if exps is None else list(exps)))


def _pack(results: Sequence[SampleResult], exps: Sequence[Experience] | None) -> PackedBatch:
    code: dict[str, int] = {}
    ints: list[int] = []
    floats: list[float] = []
    for s in results:
        r = code.setdefault(s.finish_reason, len(code))
        ints += (s.sample_id, len(s.prompt_ids), len(s.token_ids), r, s.instance,
                 int(s.migrated), _kinds(s.prompt_ids, s.token_ids, s.logprobs))
        ints += s.prompt_ids
        ints += s.token_ids
        floats += s.logprobs
    tensors: list[torch.Tensor] = []
    for e in exps or ():
        r = code.setdefault(e.finish_reason, len(code))
        ints += (e.sample_id, len(e.prompt_ids), len(e.response_ids), r,
                 _kinds(e.prompt_ids, e.response_ids))
        ints += e.prompt_ids
        ints += e.response_ids
        tensors += (e.logprobs, e.ref_logprobs, e.values)
        floats.append(e.reward)
    return PackedBatch(
        len(results), -1 if exps is None else len(exps), tuple(code),
        np.array(ints, dtype=np.int64), np.array(floats, dtype=np.float64),
        None if exps is None else (torch.cat(tensors).numpy() if tensors
                                   else np.zeros(0, np.float64)))


def unpack_batch(p: PackedBatch) -> tuple[list[SampleResult], list[Experience] | None]:
    """The objects :func:`pack_batch` was given, equal field for field."""
    if p.raw is not None:
        return p.raw
    iv: list[int] = p.ints.tolist()
    fv: list[float] = p.floats.tolist()
    i = j = 0
    results: list[SampleResult] = []
    new = object.__new__
    for _ in range(p.n_results):
        sid, a, b, r, inst, mig, kinds = iv[i: i + _RESULT_HEAD]
        i += _RESULT_HEAD
        # A frozen dataclass's __init__ sets each field through object.__setattr__: filling
        # __dict__ at once is what unpickling does too, at a third of the cost.
        s = new(SampleResult)
        s.__dict__.update(sample_id=sid, prompt_ids=_as(kinds, 0, iv[i: i + a]),
                          token_ids=_as(kinds, 1, iv[i + a: i + a + b]),
                          logprobs=_as(kinds, 2, fv[j: j + b]),
                          finish_reason=p.reasons[r], instance=inst, migrated=bool(mig))
        results.append(s)
        i += a + b
        j += b
    if p.n_experiences < 0:
        return results, None
    heads = []
    sizes: list[int] = []
    for _ in range(p.n_experiences):
        sid, a, b, r, kinds = iv[i: i + _EXPERIENCE_HEAD]
        i += _EXPERIENCE_HEAD
        heads.append((sid, _as(kinds, 0, iv[i: i + a]), _as(kinds, 1, iv[i + a: i + a + b]),
                      p.reasons[r], fv[j]))
        sizes += (b, b, b)
        i += a + b
        j += 1
    if i != len(iv) or j != len(fv) or sum(sizes) != (0 if p.tensors is None
                                                       else p.tensors.size):
        raise ValueError("malformed experience batch: payload lengths do not match its heads")
    assert p.tensors is not None
    # One buffer per message (the receiver's own, from the pickle), split into views.
    parts = torch.from_numpy(p.tensors).split(sizes)
    exps = [Experience(sid, prompt, resp, reason, parts[3 * k], parts[3 * k + 1],
                       parts[3 * k + 2], reward)
            for k, (sid, prompt, resp, reason, reward) in enumerate(heads)]
    return results, exps
