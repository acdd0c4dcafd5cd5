"""Flat tensor encoding of tickets and results for point-to-point messages.

A message is a header ``[kind, n_items, n_ints, n_floats]`` (int64) followed by one int64 and
one float64 payload. float64 holds every KV dtype we use (fp64/fp32/bf16/fp16) exactly, so a
KV transfer is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .paged import KVHandle
from .types import MIGRATION_MODES, MigrationTicket, SampleSpec

HEADER_LEN = 4


def header(kind: int, n_items: int, ints: torch.Tensor | None, floats: torch.Tensor | None
           ) -> torch.Tensor:
    return torch.tensor([kind, n_items, 0 if ints is None else ints.numel(),
                         0 if floats is None else floats.numel()], dtype=torch.int64)


def pack_tickets(tickets: Sequence[MigrationTicket]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tickets as one int64 and one float64 tensor. The floats hold every ticket's
    temperature and logprobs first, then every ticket's KV: one tensor built from a list and
    one concatenation, where a tensor per ticket cost more than the KV's copy."""
    ints: list[int] = []
    scalars: list[float] = []
    kvs: list[torch.Tensor] = []
    for t in tickets:
        s = t.spec
        kv = s.kv if isinstance(s.kv, KVHandle) else None
        shape = list(kv.data.shape) if kv is not None else [0, 0, 0, 0, 0]
        ints += [s.sample_id, s.seed, s.max_new_tokens, len(s.prompt_ids), len(s.generated_ids),
                 len(s.stop_token_ids), MIGRATION_MODES.index(t.mode), t.source, *shape,
                 *s.prompt_ids, *s.generated_ids, *s.stop_token_ids]
        scalars.append(s.temperature)
        scalars += s.logprobs
        if kv is not None:
            kvs.append(kv.data.reshape(-1).to(torch.float64))
    flt = torch.cat([torch.tensor(scalars, dtype=torch.float64), *kvs])
    return torch.tensor(ints, dtype=torch.int64), flt


def unpack_tickets(n: int, ints: torch.Tensor, floats: torch.Tensor,
                   kv_dtype: torch.dtype = torch.float64) -> list[MigrationTicket]:
    """The tickets :func:`pack_tickets` packed. Their KV are views of ``floats`` (copies where
    ``kv_dtype`` is not float64): the caller hands ``floats`` over and does not write it."""
    iv = ints.tolist()
    i = 0
    rows = []
    n_scalars = 0
    for _ in range(n):
        if i + 13 > len(iv):
            raise ValueError("malformed ticket message: fewer ints than its tickets need")
        p, g, ns = iv[i + 3: i + 6]
        rows.append((i, p, g, ns))
        i += 13 + p + g + ns
        n_scalars += 1 + g
    if i != len(iv) or n_scalars > floats.numel():
        raise ValueError("malformed ticket message: payload lengths do not match the header")
    sv = floats[:n_scalars].tolist()
    f = 0
    at = n_scalars
    out = []
    for i, p, g, ns in rows:
        sid, seed, max_new, _, _, _, mode, source = iv[i: i + 8]
        shape = iv[i + 8: i + 13]
        j = i + 13
        kv = None
        if shape[2] > 0:
            numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
            if at + numel > floats.numel():
                raise ValueError("malformed ticket message: fewer floats than its KV needs")
            kv = KVHandle(floats[at: at + numel].view(shape).to(kv_dtype))
            at += numel
        # The sender's checked spec, field by field (tolist gives ints and floats).
        spec = SampleSpec._unchecked(
            sample_id=sid, prompt_ids=tuple(iv[j: j + p]), max_new_tokens=max_new, seed=seed,
            temperature=sv[f], stop_token_ids=tuple(iv[j + p + g: j + p + g + ns]),
            generated_ids=tuple(iv[j + p: j + p + g]), logprobs=tuple(sv[f + 1: f + 1 + g]),
            kv=kv)
        f += 1 + g
        out.append(MigrationTicket(spec=spec, mode=MIGRATION_MODES[mode], source=source))
    if at != floats.numel():
        raise ValueError("malformed ticket message: payload lengths do not match the header")
    return out
