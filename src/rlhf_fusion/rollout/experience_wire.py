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

import numpy as np
import torch

from .inference import Experience
from .types import SampleResult

_RESULT_HEAD = 7       # sample_id, prompt len, token len, finish reason, instance, migrated, kinds
_EXPERIENCE_HEAD = 5   # sample_id, prompt len, response len, finish reason, kinds
# A backend may hand on its spec's prompt as a list: the containers come back as they went.
_KIND = {tuple: 0, list: 1}   # each container's type as one bit of a head's kinds


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


def pack_batch(results: Sequence[SampleResult], exps: Sequence[Experience] | None
               ) -> PackedBatch:
    """``results`` and ``exps`` (or ``None``) as columns, for a pickle that is cheap both ways."""
    try:
        packed = _pack(results, exps)
    except (TypeError, ValueError, OverflowError):   # an id or a float numpy will not take
        packed = None
    if packed is not None:
        return packed
    return PackedBatch(0, 0, (), np.zeros(0, np.int64), np.zeros(0), None,
                       raw=(list(results), None if exps is None else list(exps)))


def _pack(results: Sequence[SampleResult], exps: Sequence[Experience] | None
          ) -> PackedBatch | None:
    """The columns in one pass over the batch; None when a field does not fit them."""
    code: dict[str, int] = {}
    ints: list[int] = []
    floats: list[float] = []
    kind = _KIND.get
    for s in results:
        if type(s) is not SampleResult:
            return None
        a, b, c = kind(type(s.prompt_ids)), kind(type(s.token_ids)), kind(type(s.logprobs))
        if a is None or b is None or c is None:
            return None
        r = code.setdefault(s.finish_reason, len(code))
        ints += (s.sample_id, len(s.prompt_ids), len(s.token_ids), r, s.instance,
                 int(s.migrated), a | b << 1 | c << 2)
        ints += s.prompt_ids
        ints += s.token_ids
        floats += s.logprobs
    tensors: list[torch.Tensor] = []
    f64, tensor = torch.float64, torch.Tensor
    for e in exps or ():
        if type(e) is not Experience or type(e.reward) is not float:
            return None
        a, b = kind(type(e.prompt_ids)), kind(type(e.response_ids))
        if a is None or b is None:
            return None
        g = (len(e.response_ids),)
        for t in (e.logprobs, e.ref_logprobs, e.values):
            # Per tensor what ``cat`` would silently change (its type, dtype, shape); the
            # device and autograd, which ``cat`` carries over, are checked once on the result.
            if type(t) is not tensor or t.dtype is not f64 or t.shape != g:
                return None
            tensors.append(t)
        r = code.setdefault(e.finish_reason, len(code))
        ints += (e.sample_id, len(e.prompt_ids), g[0], r, a | b << 1)
        ints += e.prompt_ids
        ints += e.response_ids
        floats.append(e.reward)
    column = None
    if exps is not None:
        column = torch.cat(tensors) if tensors else torch.zeros(0, dtype=f64)
        if column.device.type != "cpu" or column.requires_grad:
            return None
    return PackedBatch(
        len(results), -1 if exps is None else len(exps), tuple(code),
        np.array(ints, dtype=np.int64), np.array(floats, dtype=np.float64),
        None if column is None else column.numpy())


def unpack_batch(p: PackedBatch) -> tuple[list[SampleResult], list[Experience] | None]:
    """The objects :func:`pack_batch` was given, equal field for field."""
    if p.raw is not None:
        return p.raw
    iv: list[int] = p.ints.tolist()
    fv: list[float] = p.floats.tolist()
    reasons = p.reasons
    i = j = 0
    results: list[SampleResult] = []
    new = object.__new__
    for _ in range(p.n_results):
        sid, a, b, r, inst, mig, kinds = iv[i: i + _RESULT_HEAD]
        i += _RESULT_HEAD
        prompt, tokens, logprobs = iv[i: i + a], iv[i + a: i + a + b], fv[j: j + b]
        # A frozen dataclass's __init__ sets each field through object.__setattr__: filling
        # __dict__ at once is what unpickling does too, at a third of the cost.
        s = new(SampleResult)
        s.__dict__.update(sample_id=sid,
                          prompt_ids=prompt if kinds & 1 else tuple(prompt),
                          token_ids=tokens if kinds & 2 else tuple(tokens),
                          logprobs=logprobs if kinds & 4 else tuple(logprobs),
                          finish_reason=reasons[r], instance=inst, migrated=bool(mig))
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
        prompt, response = iv[i: i + a], iv[i + a: i + a + b]
        heads.append((sid, prompt if kinds & 1 else tuple(prompt),
                      response if kinds & 2 else tuple(response), reasons[r], fv[j]))
        sizes += (b, b, b)
        i += a + b
        j += 1
    if i != len(iv) or j != len(fv) or sum(sizes) != (0 if p.tensors is None
                                                       else p.tensors.size):
        raise ValueError("malformed experience batch: payload lengths do not match its heads")
    assert p.tensors is not None
    # One buffer per message (the receiver's own, from the pickle), split into views.
    parts = torch.from_numpy(p.tensors).split(sizes)
    exps = []
    for k, (sid, prompt, resp, reason, reward) in enumerate(heads):
        lp, ref, values = parts[3 * k: 3 * k + 3]
        e = new(Experience)
        e.__dict__.update(sample_id=sid, prompt_ids=prompt, response_ids=resp,
                          finish_reason=reason, logprobs=lp, ref_logprobs=ref, values=values,
                          reward=reward)
        exps.append(e)
    return results, exps
