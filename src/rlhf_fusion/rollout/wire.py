"""Flat tensor encoding of tickets and results for point-to-point messages.

A message is a header ``[kind, n_items, n_ints, n_floats]`` (int64) followed by one int64 and
one float64 payload. float64 holds every KV dtype we use (fp64/fp32/bf16/fp16) exactly, so a
KV transfer is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .paged import KVHandle, joined_kv
from .types import MIGRATION_MODES, MigrationTicket, SampleSpec

HEADER_LEN = 4


def header(kind: int, n_items: int, ints: torch.Tensor | None,
           floats: torch.Tensor | Sequence[torch.Tensor] | None) -> torch.Tensor:
    """``floats``: the payload, or its parts (:func:`pack_ticket_parts`)."""
    n_flt = (0 if floats is None else floats.numel() if isinstance(floats, torch.Tensor)
             else sum(t.numel() for t in floats))
    return torch.tensor([kind, n_items, 0 if ints is None else ints.numel(), n_flt],
                        dtype=torch.int64)


def pack_tickets(tickets: Sequence[MigrationTicket]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tickets as one int64 and one float64 tensor (:func:`pack_ticket_parts`, joined)."""
    ints, parts = pack_ticket_parts(tickets)
    return ints, (parts[0] if len(parts) == 1 else torch.cat(parts))


def pack_ticket_parts(tickets: Sequence[MigrationTicket]
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The tickets as one int64 tensor and the float64 payload in parts, flat, to be written
    one after the other: every ticket's temperature and logprobs, then the KV of every ticket
    that has one as one block ``(layers, 2, tokens, kv_heads, head_dim)``, the tickets'
    tokens one after the other along dim 2. That block is what ``PagedKVPool.export``
    gathers for them, so a message written in parts (a file) copies no KV on the way
    (per ticket, a copy out of the gather and one into the message had cost more than the
    gather itself)."""
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
            kvs.append(kv.data)
    parts = [torch.from_numpy(np.array(scalars, dtype=np.float64))]
    if kvs:
        layout = {(x.shape[0], x.shape[1], *x.shape[3:]) for x in kvs}
        if len(layout) != 1 or kvs[0].dim() != 5:
            raise ValueError(f"tickets hold KV of different layouts {sorted(layout)}: one message "
                             "carries the samples of one model")
        block = joined_kv(kvs)
        if block is None:
            block = torch.cat(kvs, dim=2)
        parts.append(block.to(torch.float64).contiguous().reshape(-1))
    return torch.from_numpy(np.array(ints, dtype=np.int64)), parts


def unpack_tickets(n: int, ints: torch.Tensor, floats: torch.Tensor,
                   kv_dtype: torch.dtype = torch.float64) -> list[MigrationTicket]:
    """The tickets :func:`pack_tickets` packed. Their KV are views of ``floats`` (of one
    copy, where ``kv_dtype`` is not float64), one slice of the block each: the caller hands
    ``floats`` over and does not write it."""
    iv = ints.tolist()
    i = 0
    rows = []
    n_scalars = 0
    n_kv = 0
    layout: set[tuple[int, ...]] = set()
    for _ in range(n):
        if i + 13 > len(iv):
            raise ValueError("malformed ticket message: fewer ints than its tickets need")
        p, g, ns = iv[i + 3: i + 6]
        shape = iv[i + 8: i + 13]
        if shape[2] > 0:
            n_kv += shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
            layout.add((shape[0], shape[1], shape[3], shape[4]))
        rows.append((i, p, g, ns))
        i += 13 + p + g + ns
        n_scalars += 1 + g
    if i != len(iv) or n_scalars > floats.numel():
        raise ValueError("malformed ticket message: payload lengths do not match the header")
    if n_scalars + n_kv > floats.numel():
        raise ValueError("malformed ticket message: fewer floats than its KV needs")
    if len(layout) > 1:
        raise ValueError(f"malformed ticket message: its tickets' KV has {len(layout)} layouts "
                         f"{sorted(layout)}; one message carries the samples of one model")
    if n_scalars + n_kv != floats.numel():
        raise ValueError("malformed ticket message: payload lengths do not match the header")
    block = None
    if layout:
        (a, b, h, d), = layout
        block = floats[n_scalars:].view(a, b, n_kv // (a * b * h * d), h, d).to(kv_dtype)
    sv = floats[:n_scalars].tolist()
    f = 0
    at = 0
    out = []
    for i, p, g, ns in rows:
        sid, seed, max_new, _, _, _, mode, source = iv[i: i + 8]
        tokens = iv[i + 10]
        j = i + 13
        kv = None
        if tokens > 0:
            assert block is not None
            kv = KVHandle(block[:, :, at: at + tokens])
            at += tokens
        # The sender's checked spec, field by field (tolist gives ints and floats).
        spec = SampleSpec._unchecked(
            sample_id=sid, prompt_ids=tuple(iv[j: j + p]), max_new_tokens=max_new, seed=seed,
            temperature=sv[f], stop_token_ids=tuple(iv[j + p + g: j + p + g + ns]),
            generated_ids=tuple(iv[j + p: j + p + g]), logprobs=tuple(sv[f + 1: f + 1 + g]),
            kv=kv)
        f += 1 + g
        out.append(MigrationTicket(spec=spec, mode=MIGRATION_MODES[mode], source=source))
    return out
