"""Reference GenerationBackend on `transformers`: continuous batching over a paged KV cache.

State of an active sample with ``G >= 1`` generated tokens: its KV holds the context
``prompt + generated[:-1]`` (``P + G - 1`` entries) and ``generated[-1]`` is the pending input
of the next decode step. A KV export ships exactly that; a "tokens" continuation rebuilds it by
one prefill over ``prompt + generated[:-1]``.

Determinism: tokens come from ``keyed_sample`` (a pure function of logits and
(seed, sample, position)), and the model runs in float64 by default, so the logits of a sample
differ across batch compositions and prefill/decode splits only by float64 rounding (~1e-15),
far below the 1e-5 logprob tolerance and the gaps Gumbel-max ever has to resolve in practice.
In float32 (or on GPU) migration stays exactly-once but tokens may differ where two candidates
tie to float32 precision.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .paged import KVHandle, PagedContext, PagedKVPool, load_triton_decode, register_attention
from .sampling import keyed_sample
from .types import (
    BackendCapabilities,
    KVCapacityError,
    MigrationMode,
    MigrationTicket,
    RolloutConfigError,
    RolloutError,
    SampleProgress,
    SampleResult,
    SampleSpec,
    check_migration_mode,
)


@dataclass
class _Seq:
    spec: SampleSpec
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    kv_len: int = 0
    migrated: bool = False

    @property
    def sid(self) -> int:
        return self.spec.sample_id

    @property
    def reserved(self) -> int:
        return len(self.spec.prompt_ids) + self.spec.max_new_tokens


class ReferenceBackend:
    """Continuous batching over a decoder-only ``transformers`` model (Llama, Qwen2, ...).

    ``max_batch_size`` is BS_max: at most that many samples decode together; the rest wait in
    FIFO order (imported samples first). ``kv_capacity_tokens`` is C: admission reserves
    ``prompt + max_new_tokens`` KV entries per sample, so a running sample is never preempted.
    """

    capabilities = BackendCapabilities(
        kv_export=True, kv_import=True, streaming=True, exact_migration=True
    )

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        instance_id: int = 0,
        max_batch_size: int = 32,
        kv_capacity_tokens: int | None = None,
        block_size: int = 16,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
        use_triton: bool | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise RolloutConfigError("max_batch_size must be >= 1")
        cfg = model.config
        self.instance_id = instance_id
        self.max_batch_size = max_batch_size
        self.device = torch.device(device) if device is not None else next(
            model.parameters()).device
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.model.set_attn_implementation(register_attention())
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self._pool_args = dict(
            num_layers=int(cfg.num_hidden_layers), num_kv_heads=kv_heads, head_dim=head_dim,
            block_size=block_size, max_tokens=kv_capacity_tokens, dtype=dtype,
        )
        self.kv_bytes_per_token = 2 * int(cfg.num_hidden_layers) * kv_heads * head_dim * (
            torch.finfo(dtype).bits // 8)
        self.pool: PagedKVPool | None = PagedKVPool(**self._pool_args, device=self.device)
        want_triton = self.device.type == "cuda" if use_triton is None else use_triton
        self._triton = load_triton_decode(self.device) if want_triton else None
        self._queue: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._known: set[int] = set()
        self._sleeping = False
        self.steps = 0

    # -- submission ---------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int | None:
        return self._pool_args["max_tokens"]  # type: ignore[return-value]

    def _check_spec(self, spec: SampleSpec) -> None:
        if spec.sample_id in self._known:
            raise RolloutError(
                f"instance {self.instance_id}: sample {spec.sample_id} is already here; "
                "submit each sample once"
            )
        bad = [t for t in spec.prompt_ids + spec.generated_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RolloutConfigError(
                f"sample {spec.sample_id}: token ids {bad[:5]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        total = len(spec.prompt_ids) + spec.max_new_tokens
        if self.max_positions is not None and total > int(self.max_positions):
            raise RolloutConfigError(
                f"sample {spec.sample_id}: prompt + max_new_tokens = {total} exceeds the model's "
                f"max_position_embeddings={self.max_positions}; shorten the prompt or lower "
                "max_new_tokens"
            )
        cap = self.kv_capacity_tokens
        if cap is not None:
            need = math.ceil(total / self._pool_args["block_size"]) * self._pool_args[
                "block_size"]
            if need > cap:
                raise KVCapacityError(
                    f"sample {spec.sample_id}: its KV (prompt + max_new_tokens = {total} tokens) "
                    f"cannot fit in kv_capacity_tokens={cap} of instance {self.instance_id}; "
                    "raise kv_capacity_tokens or lower max_new_tokens"
                )

    def submit(self, specs: Sequence[SampleSpec]) -> None:
        self._require_awake("submit")
        for spec in specs:
            self._check_spec(spec)
        for spec in specs:
            self._known.add(spec.sample_id)
            self._queue.append(_Seq(spec=spec, generated=list(spec.generated_ids),
                                    logprobs=list(spec.logprobs)))

    def import_samples(self, tickets: Sequence[MigrationTicket]) -> None:
        self._require_awake("import_samples")
        for t in tickets:
            self._check_spec(t.spec)
            if t.spec.kv is not None and not isinstance(t.spec.kv, KVHandle):
                raise RolloutError(f"sample {t.sample_id}: KV handle of unknown type "
                                   f"{type(t.spec.kv).__name__}")
        seqs = [_Seq(spec=t.spec, generated=list(t.spec.generated_ids),
                     logprobs=list(t.spec.logprobs), migrated=True) for t in tickets]
        for s in seqs:
            self._known.add(s.sid)
        # Migrated samples are the long tail: they go ahead of samples that never started.
        self._queue.extendleft(reversed(seqs))

    # -- introspection ------------------------------------------------------------------------
    def unfinished(self) -> list[int]:
        return sorted([s.sid for s in self._active] + [s.sid for s in self._queue])

    def progress(self) -> list[SampleProgress]:
        seqs = sorted(list(self._active) + list(self._queue), key=lambda s: s.sid)
        return [SampleProgress(s.sid, len(s.spec.prompt_ids), len(s.generated),
                               s.spec.max_new_tokens) for s in seqs]

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- the engine loop ----------------------------------------------------------------------
    def step(self) -> list[SampleResult]:
        self._require_awake("step")
        finished: list[SampleResult] = []
        self._admit(finished)
        if self._active:
            self._decode(finished)
        self.steps += 1
        return finished

    def results(self) -> Iterator[SampleResult]:
        while self._active or self._queue:
            yield from self.step()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx: PagedContext
                 ) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device),
                             use_cache=False, paged_kv=ctx, logits_to_keep=1)
        return out.logits[:, -1, :]

    def _prefill(self, seqs: Sequence[_Seq], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """One forward over equally long token lists (one per sample); writes their KV and
        returns the last position's logits ``(len(seqs), V)``."""
        assert self.pool is not None
        n = len(tokens[0])
        slots = torch.stack([self.pool.slots(s.blocks, 0, n) for s in seqs])
        ctx = PagedContext(pool=self.pool, write_slots=slots, decode=False)
        logits = self._forward(torch.tensor([list(t) for t in tokens]),
                               torch.arange(n).expand(len(seqs), n), ctx)
        for s in seqs:
            s.kv_len = n
        return logits

    def _admit(self, finished: list[SampleResult]) -> None:
        assert self.pool is not None
        fresh: dict[int, list[_Seq]] = {}
        # Migrated KV arriving in this step, written to the pool at once (one scatter per layer).
        loads: list[tuple[list[int], KVHandle]] = []
        while self._queue and len(self._active) + sum(map(len, fresh.values())) \
                < self.max_batch_size:
            seq = self._queue[0]
            if not self.pool.can_allocate(seq.reserved):
                if not self._active and not fresh:
                    raise KVCapacityError(
                        f"instance {self.instance_id}: sample {seq.sid} needs {seq.reserved} KV "
                        f"tokens and the pool is empty but too small; raise kv_capacity_tokens"
                    )
                break  # wait for a running sample to retire and free its blocks
            self._queue.popleft()
            seq.blocks = self.pool.allocate(seq.reserved)
            spec = seq.spec
            if not seq.generated:
                # New samples are prefilled together, one forward per prompt length (GRPO's
                # groups share a prompt; a PPO batch has few distinct lengths).
                fresh.setdefault(len(spec.prompt_ids), []).append(seq)
                continue
            if isinstance(spec.kv, KVHandle):
                loads.append((seq.blocks, spec.kv))
                seq.kv_len = spec.kv.tokens
                seq.spec = spec.without_kv()
            else:
                # The recompute path: rebuild the KV of everything but the pending token.
                self._prefill([seq], [spec.prompt_ids + tuple(seq.generated[:-1])])
            self._active.append(seq)
            self._check_kv(seq)
        self.pool.load(loads)
        for group in fresh.values():
            logits = self._prefill_shared(group)
            self._active.extend(group)
            self._append_tokens(group, logits, finished)
            for seq in group:
                if seq.blocks:
                    self._check_kv(seq)

    def _prefill_shared(self, seqs: list[_Seq]) -> torch.Tensor:
        """:meth:`_prefill` of new samples whose prompts are equally long, each distinct prompt
        once: a GRPO group's ``n`` samples share their prompt, and the first one's KV is copied
        into the others' blocks (a copy costs far less than a forward). Returns the last
        position's logits per sample ``(len(seqs), V)``, the shared rows repeated."""
        assert self.pool is not None
        row: dict[tuple[int, ...], int] = {}
        first: list[_Seq] = []
        rows = []
        for s in seqs:
            key = tuple(s.spec.prompt_ids)
            if key not in row:
                row[key] = len(first)
                first.append(s)
            rows.append(row[key])
        logits = self._prefill(first, [s.spec.prompt_ids for s in first])
        if len(first) == len(seqs):
            return logits
        n = len(first[0].spec.prompt_ids)
        shared = [(first[r], s) for r, s in zip(rows, seqs, strict=True) if s is not first[r]]
        self.pool.copy([(a.blocks, b.blocks) for a, b in shared], n)
        for _, s in shared:
            s.kv_len = n
        return logits[torch.tensor(rows, device=logits.device)]

    def _check_kv(self, seq: _Seq) -> None:
        expect = len(seq.spec.prompt_ids) + len(seq.generated) - 1
        if seq.kv_len != expect:
            raise RolloutError(
                f"sample {seq.sid}: KV holds {seq.kv_len} tokens, expected {expect} "
                "(prompt + generated - 1); the ticket is inconsistent"
            )

    def _decode(self, finished: list[SampleResult]) -> None:
        assert self.pool is not None
        seqs = self._active
        bs = self.pool.block_size
        lens = [s.kv_len for s in seqs]
        # Blocks of a sample are consecutive (see PagedKVPool.allocate): position p of sample s
        # sits at flat slot blocks[0] * block_size + p.
        starts = [s.blocks[0] * bs for s in seqs]
        width = max(len(s.blocks) for s in seqs)
        dev = self.device
        table = None
        if self._triton is not None:
            table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs],
                                 dtype=torch.int32, device=dev)
        ctx = PagedContext(
            pool=self.pool,
            write_slots=torch.tensor([[a + n] for a, n in zip(starts, lens, strict=True)],
                                     device=dev),
            decode=True,
            spans=[(a, n + 1) for a, n in zip(starts, lens, strict=True)],
            block_table=table,
            seq_lens=torch.tensor(lens, device=dev, dtype=torch.int32) + 1,
            triton_fn=self._triton,
        )
        ids = torch.tensor([[s.generated[-1]] for s in seqs])
        logits = self._forward(ids, torch.tensor(lens)[:, None], ctx)
        for s in seqs:
            s.kv_len += 1
        self._append_tokens(seqs, logits, finished)

    def _append_tokens(self, seqs: list[_Seq], logits: torch.Tensor,
                       finished: list[SampleResult]) -> None:
        tokens, logps = keyed_sample(
            logits,
            [s.spec.seed for s in seqs],
            [s.sid for s in seqs],
            [len(s.generated) for s in seqs],
            [s.spec.temperature for s in seqs],
        )
        done: set[int] = set()
        for s, tok, lp in zip(seqs, tokens, logps, strict=True):
            s.generated.append(int(tok))
            s.logprobs.append(float(lp))
            reason = None
            if tok in s.spec.stop_token_ids:
                reason = "stop"
            elif len(s.generated) >= s.spec.max_new_tokens:
                reason = "length"
            if reason is not None:
                finished.append(self._retire(s, reason))
                done.add(s.sid)
        if done:
            self._active = [s for s in self._active if s.sid not in done]

    def _retire(self, seq: _Seq, reason: str) -> SampleResult:
        assert self.pool is not None
        self.pool.release(seq.blocks)
        seq.blocks = []
        self._known.discard(seq.sid)
        return SampleResult(
            sample_id=seq.sid, prompt_ids=seq.spec.prompt_ids, token_ids=tuple(seq.generated),
            logprobs=tuple(seq.logprobs), finish_reason=reason, instance=self.instance_id,
            migrated=seq.migrated,
        )

    # -- removal: abort and export ------------------------------------------------------------
    def _take(self, sid: int) -> _Seq | None:
        for i, s in enumerate(self._active):
            if s.sid == sid:
                del self._active[i]
                return s
        for i, s in enumerate(self._queue):
            if s.sid == sid:
                del self._queue[i]
                return s
        return None

    def abort(self, ids: Iterable[int]) -> None:
        assert self.pool is not None or self._sleeping
        for sid in ids:
            s = self._take(int(sid))
            if s is not None:
                if s.blocks and self.pool is not None:
                    self.pool.release(s.blocks)
                self._known.discard(s.sid)

    def export_samples(
        self, ids: Iterable[int], mode: MigrationMode = "kv"
    ) -> list[MigrationTicket]:
        check_migration_mode(mode)
        self._require_awake("export_samples")
        assert self.pool is not None
        taken = [s for s in (self._take(int(sid)) for sid in ids) if s is not None]
        # (a sample already emitted, or never here, gets no ticket: nothing is duplicated)
        live = [s for s in taken if s.blocks and mode == "kv" and s.generated]
        exported = dict(zip((s.sid for s in live),
                            self.pool.export([(s.blocks, s.kv_len) for s in live]), strict=True))
        tickets = []
        freed: list[int] = []   # released at once: the free list is sorted on each release
        for s in taken:
            kv: Any = exported.get(s.sid)
            if s.blocks:
                freed += s.blocks
            elif mode == "kv" and isinstance(s.spec.kv, KVHandle):
                kv = s.spec.kv  # imported but not yet admitted: pass its KV on untouched
            # (ints and floats this backend appended: nothing for the spec's checks to do)
            spec = s.spec._replace(generated_ids=tuple(s.generated),
                                   logprobs=tuple(s.logprobs), kv=kv)
            self._known.discard(s.sid)
            tickets.append(MigrationTicket(spec=spec, mode=mode, source=self.instance_id))
        if freed:
            self.pool.release(freed)
        return tickets

    # -- weights and memory -------------------------------------------------------------------
    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[Any]) -> None:
        if self._active or self._queue:
            raise RolloutError(
                f"instance {self.instance_id}: update_weights with {len(self.unfinished())} "
                "unfinished samples would mix policies inside a response; finish, abort or "
                "export them first"
            )
        state = dict(weights.items() if isinstance(weights, Mapping) else weights)
        with torch.no_grad():
            self.model.load_state_dict(
                {k: v.to(device=self.device, dtype=self.dtype) for k, v in state.items()},
                strict=True,
            )

    def sleep(self) -> None:
        if self._active or self._queue:
            raise RolloutError(
                f"instance {self.instance_id}: sleep with {len(self.unfinished())} unfinished "
                "samples would lose their KV; finish, abort or export them first"
            )
        self.pool = None
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._sleeping = True

    def wake_up(self) -> None:
        if not self._sleeping:
            return
        self.model.to(self.device)
        self.pool = PagedKVPool(**self._pool_args, device=self.device)
        self._sleeping = False

    def _require_awake(self, what: str) -> None:
        if self._sleeping:
            raise RolloutError(f"instance {self.instance_id}: {what} while asleep; call wake_up()")
