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
    ints: list[int] = []
    floats: list[torch.Tensor] = []
    for t in tickets:
        s = t.spec
        kv = s.kv if isinstance(s.kv, KVHandle) else None
        shape = list(kv.data.shape) if kv is not None else [0, 0, 0, 0, 0]
        ints += [s.sample_id, s.seed, s.max_new_tokens, len(s.prompt_ids), len(s.generated_ids),
                 len(s.stop_token_ids), MIGRATION_MODES.index(t.mode), t.source, *shape,
                 *s.prompt_ids, *s.generated_ids, *s.stop_token_ids]
        floats.append(torch.tensor([s.temperature, *s.logprobs], dtype=torch.float64))
        if kv is not None:
            floats.append(kv.data.reshape(-1).to(torch.float64))
    flt = torch.cat(floats) if floats else torch.zeros(0, dtype=torch.float64)
    return torch.tensor(ints, dtype=torch.int64), flt


def unpack_tickets(n: int, ints: torch.Tensor, floats: torch.Tensor,
                   kv_dtype: torch.dtype = torch.float64) -> list[MigrationTicket]:
    iv = ints.tolist()
    i = f = 0
    out = []
    for _ in range(n):
        sid, seed, max_new, p, g, ns, mode, source = iv[i: i + 8]
        shape = iv[i + 8: i + 13]
        i += 13
        prompt = iv[i: i + p]
        gen = iv[i + p: i + p + g]
        stop = iv[i + p + g: i + p + g + ns]
        i += p + g + ns
        temp = float(floats[f])
        lps = floats[f + 1: f + 1 + g].tolist()
        f += 1 + g
        kv = None
        if shape[2] > 0:
            numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
            kv = KVHandle(floats[f: f + numel].reshape(shape).to(kv_dtype).clone())
            f += numel
        spec = SampleSpec(sample_id=sid, prompt_ids=prompt, max_new_tokens=max_new, seed=seed,
                          temperature=temp, stop_token_ids=stop, generated_ids=gen,
                          logprobs=lps, kv=kv)
        out.append(MigrationTicket(spec=spec, mode=MIGRATION_MODES[mode], source=source))
    if i != len(iv) or f != floats.numel():
        raise ValueError("malformed ticket message: payload lengths do not match the header")
    return out
