"""Migration decisions shared by the simulator, the in-process driver and the coordinator.

Pure Python (no torch): given what every instance reports, decide deterministically where the
long tail goes, so every rank computes the same plan without another round of messages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..types import KVCapacityError, MigrationMode, RolloutConfigError


def required_instances(rt: int, bs_max: int, longest_kv_tokens: float,
                       kv_capacity_tokens: float | None) -> int:
    """m = max(ceil(R_t / BS_max), ceil(R_t * M / C)) (RLHFuse §4): enough batch slots and KV."""
    by_batch = math.ceil(rt / bs_max)
    if kv_capacity_tokens is None or math.isinf(kv_capacity_tokens):
        return max(by_batch, 1)
    return max(by_batch, math.ceil(rt * longest_kv_tokens / kv_capacity_tokens), 1)


def validate_fusion(
    *,
    batch_size: int,
    instances: int,
    rt: int,
    bs_max: int,
    longest_kv_tokens: float,
    kv_capacity_tokens: float | None = None,
    m: int | None = None,
) -> int:
    """Check an inter-stage fusion configuration before anything runs; return m.

    Raises RolloutConfigError (KVCapacityError for memory) naming the field and the fix.
    """
    if instances < 2:
        raise RolloutConfigError(
            f"instances={instances}: inter-stage fusion needs at least 2 generation instances "
            "(one keeps the long tail, the others are freed); run serial with 1 instance"
        )
    if bs_max < 1:
        raise RolloutConfigError(f"bs_max={bs_max}: the max batch per instance must be >= 1")
    if not 1 <= rt <= batch_size:
        lo, hi = max(1, round(0.05 * batch_size)), max(1, round(0.95 * batch_size))
        raise RolloutConfigError(
            f"R_t={rt} is outside the batch of {batch_size} samples; it is the number of "
            f"unfinished samples that triggers migration: pick 1 <= R_t <= {batch_size} "
            f"(the planner searches {lo}..{hi}, 5%-95%), or run without migration "
            "(RolloutConfig(rt=0) or fused=False)"
        )
    cap = kv_capacity_tokens
    if cap is not None and longest_kv_tokens > cap:
        raise KVCapacityError(
            f"the longest sample needs M={longest_kv_tokens:g} KV tokens but one instance holds "
            f"C={cap:g}; raise the KV capacity per instance or lower max_new_tokens"
        )
    need = required_instances(rt, bs_max, longest_kv_tokens, cap)
    if m is None:
        m = need
    elif m < 1:
        raise RolloutConfigError(f"m={m}: the number of destination instances must be >= 1")
    elif m < need:
        by_kv = "" if cap is None else (
            f", ceil(R_t*M/C) = {math.ceil(rt * longest_kv_tokens / cap)}")
        raise RolloutConfigError(
            f"m={m} destinations cannot hold R_t={rt} samples: they need at least {need} "
            f"(ceil(R_t/BS_max) = {math.ceil(rt / bs_max)}{by_kv}); set m >= {need} or lower R_t"
        )
    if m >= instances:
        per = bs_max if cap is None else min(bs_max, int(cap // max(longest_kv_tokens, 1)))
        raise RolloutConfigError(
            f"m={m} destinations leave none of the {instances} instances free (m must be <= "
            f"{instances - 1}); lower R_t to at most {max(per * (instances - 1), 1)} or raise "
            "BS_max / the KV capacity per instance"
        )
    return m


def choose_destinations(remaining: Mapping[int, int], m: int) -> list[int]:
    """The m instances with most samples left (ties: lower index), among those with any left."""
    ranked = sorted((inst for inst, n in remaining.items() if n > 0),
                    key=lambda inst: (-remaining[inst], inst))
    return sorted(ranked[:m])


def destination_at_trigger(counts: Sequence[int], claimer: int) -> int:
    """The one destination of a migration planned from the counts the trigger was claimed on
    (``claimer``: the rank that claimed it): the rank with most samples left among the others
    that still have any (ties: lower rank), else the claimer itself (then nothing moves).

    Not simply the rank with most samples left: the claimer has just ended a decode step (it
    claims between two), while its peers are usually in the middle of one. As a source it
    exports at once and its tickets are there when the destination's step ends; as the
    destination it would idle until the peer's step ended and that peer had exported (half
    a step and more: 0.5-2 ms a rollout on the GRPO demo, in 23 of 39 rollouts), or step
    without the migrated samples."""
    others = {i: n for i, n in enumerate(counts) if i != claimer and n > 0}
    return choose_destinations(others, 1)[0] if others else claimer


@dataclass(frozen=True)
class MovingSample:
    sample_id: int
    kv_tokens: int        # KV entries held now (what a KV transfer ships / a re-prefill recomputes)
    reserved_tokens: int  # prompt + max_new_tokens (what the destination must reserve)


@dataclass
class MigrationAssignment:
    """Who sends what to whom; identical on every rank that computes it from the same reports."""

    destinations: list[int]
    freed: list[int]
    moves: dict[int, dict[int, list[int]]] = field(default_factory=dict)  # src -> dst -> ids

    def incoming(self, dst: int) -> dict[int, list[int]]:
        return {src: per[dst] for src, per in sorted(self.moves.items()) if dst in per}

    @property
    def moved_ids(self) -> list[int]:
        return sorted(i for per in self.moves.values() for ids in per.values() for i in ids)


def assign_migration(
    unfinished: Mapping[int, Sequence[MovingSample]],
    m: int,
    *,
    bs_max: int | None = None,
    kv_capacity_tokens: float | None = None,
) -> MigrationAssignment:
    """Send every unfinished sample of non-destination instances to one of the m destinations.

    Longest-context first, each to the destination with the fewest samples (then least reserved
    KV), never past its KV capacity. ``bs_max`` only balances: a destination may queue more than
    BS_max samples, which is slower but loses nothing.
    """
    remaining = {inst: len(s) for inst, s in unfinished.items()}
    dests = choose_destinations(remaining, m)
    freed = sorted(inst for inst in unfinished if inst not in dests)
    count = {d: remaining[d] for d in dests}
    kv = {d: sum(s.reserved_tokens for s in unfinished[d]) for d in dests}
    moving = sorted(
        ((src, s) for src in freed for s in unfinished[src]),
        key=lambda p: (-p[1].kv_tokens, p[1].sample_id),
    )
    moves: dict[int, dict[int, list[int]]] = {}
    for src, s in moving:
        fits = [d for d in dests if kv_capacity_tokens is None
                or kv[d] + s.reserved_tokens <= kv_capacity_tokens]
        if not fits:
            raise KVCapacityError(
                f"sample {s.sample_id} ({s.reserved_tokens} reserved KV tokens) fits on none of "
                f"the destinations {dests} (capacity {kv_capacity_tokens:g} tokens each); "
                "raise m, lower R_t, or raise the KV capacity per instance"
            )
        over = bs_max is not None and all(count[d] >= bs_max for d in fits)
        d = min(fits, key=lambda x: (count[x], kv[x], x)) if not over else min(
            fits, key=lambda x: (kv[x], count[x], x))
        count[d] += 1
        kv[d] += s.reserved_tokens
        moves.setdefault(src, {}).setdefault(d, []).append(s.sample_id)
    for per in moves.values():
        for ids in per.values():
            ids.sort()
    return MigrationAssignment(destinations=dests, freed=freed, moves=moves)


def migration_costs(
    tokens_in: float, *, kv_bytes_per_token: float, bandwidth_bytes_s: float,
    latency_s: float, prefill_s_per_token: float,
) -> dict[str, float]:
    """Seconds a destination spends taking ``tokens_in`` context tokens in, per mechanism."""
    kv = latency_s + tokens_in * kv_bytes_per_token / bandwidth_bytes_s if tokens_in else 0.0
    return {"kv": kv, "tokens": tokens_in * prefill_s_per_token}


def choose_mechanism(
    tokens_in: float, *, kv_bytes_per_token: float, bandwidth_bytes_s: float,
    latency_s: float, prefill_s_per_token: float, kv_supported: bool = True,
) -> tuple[MigrationMode, str]:
    """KV transfer when moving the cache beats recomputing it by prefill, else token ids."""
    costs = migration_costs(tokens_in, kv_bytes_per_token=kv_bytes_per_token,
                            bandwidth_bytes_s=bandwidth_bytes_s, latency_s=latency_s,
                            prefill_s_per_token=prefill_s_per_token)
    if not kv_supported:
        return "tokens", "the backend cannot export KV; re-prefill from token ids"
    mode: MigrationMode = "kv" if costs["kv"] <= costs["tokens"] else "tokens"
    why = (f"KV transfer {costs['kv'] * 1e3:.3g} ms vs re-prefill {costs['tokens'] * 1e3:.3g} ms "
           f"for {tokens_in:g} context tokens")
    return mode, why
