"""Parameter reallocation between layouts (``runtime.realloc_execute``), executed on gloo ranks.

The distributed test runs EVERY ordered pair of layouts (all legal meshes of 4 ranks, all
(dp, tp, pp) on each with pp <= 4 layers) of a 4-layer model, on two clusters: one node of 4
GPUs, and 2 nodes x 2 GPUs (so the planner's "same node over NVLink first" source choice is
exercised). Each pair goes A -> B and back B -> A inside one spawn of 4 processes.
"""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
import torch

from rlhf_fusion.placement import Cluster, MeshLayout, enumerate_meshes, strategies_for
from rlhf_fusion.runtime.realloc_execute import (
    assemble,
    column_rows,
    execute,
    layer_of,
    local_shard,
    param_table,
    realloc_model_shape,
    shard,
)
from rlhf_fusion.testing.models import build_causal_lm, build_value_model, tiny_config

LAYERS = 4


def _models() -> dict[str, tuple[torch.nn.Module, str]]:
    """name -> (model, role): an untied llama actor, a tied GPT-2 actor (LM head = wte) and a
    bfloat16 llama critic (a value head of one row: empty tp pieces)."""
    return {
        "llama": (build_causal_lm(tiny_config("llama", vocab_size=96, hidden_size=32,
                                              layers=LAYERS, max_positions=64), seed=1), "actor"),
        "gpt2": (build_causal_lm(tiny_config("gpt2", vocab_size=96, hidden_size=32,
                                             layers=LAYERS, max_positions=64), seed=2), "actor"),
        "critic": (build_value_model(tiny_config("llama", vocab_size=96, hidden_size=32,
                                                 layers=LAYERS, max_positions=64),
                                     seed=3).to(torch.bfloat16), "critic"),
    }


def _layouts(cluster: Cluster, table) -> list[MeshLayout]:  # noqa: ANN001
    shape = realloc_model_shape(table)
    return [MeshLayout(m, s) for m in enumerate_meshes(cluster) for s in strategies_for(m, shape)]


def _clusters() -> dict[str, Cluster]:
    return {"1x4": Cluster.uniform(1, 4), "2x2": Cluster.uniform(2, 2)}


# -- no processes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_columns_tile_every_parameter(tp: int) -> None:
    for model, role in _models().values():
        lay = layer_of(model, role)
        params = dict(model.named_parameters())
        pieces = [shard(params, lay, (0, LAYERS), (Fraction(t, tp), Fraction(t + 1, tp)))
                  for t in range(tp)]
        for name in lay:
            whole = torch.cat([p[name] for p in pieces])
            assert torch.equal(whole, params[name]), name
            assert sum(p[name].shape[0] for p in pieces) == params[name].shape[0]
    assert column_rows(1, (Fraction(0), Fraction(1, 2))) == (0, 0)
    assert column_rows(1, (Fraction(1, 2), Fraction(1))) == (0, 1)
    assert column_rows(10, (Fraction(1, 3), Fraction(2, 3))) == (3, 6)


def test_layer_of_assigns_every_parameter_once() -> None:
    models = _models()
    for key, (model, role) in models.items():
        lay = layer_of(model, role)
        unique = {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
        assert len(lay) == len(unique), key
        assert set(lay.values()) == set(range(LAYERS))
        for name, k in lay.items():
            if ".layers." in name or ".h." in name:
                assert int(name.split(".layers." if ".layers." in name else ".h.")[1]
                           .split(".")[0]) == k
            elif any(e in name for e in ("embed_tokens", "wte", "wpe")):
                assert k == 0, name
            else:
                assert k == LAYERS - 1, name
    assert "lm_head.weight" in layer_of(*models["llama"])
    assert "lm_head.weight" not in layer_of(*models["gpt2"])      # tied: under wte
    assert layer_of(*models["gpt2"])["transformer.wte.weight"] == 0
    assert layer_of(*models["critic"])["value_head.weight"] == LAYERS - 1
    from transformers import AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification.from_config(
        tiny_config("gpt2", vocab_size=96, hidden_size=32, layers=LAYERS, max_positions=64))
    assert layer_of(cls, "critic")["score.weight"] == LAYERS - 1
    # The pipeline partition keeps exactly the parameters of its stage's layers (pp divides L).
    import copy

    from rlhf_fusion.runtime.partition import partition_

    for key, (model, role) in models.items():
        whole = layer_of(model, role)
        for stage in range(2):
            part = copy.deepcopy(model)
            partition_(part, role, stage, 2)
            kept = {n for n, _ in part.named_parameters()}
            want = {n for n, k in whole.items() if 2 * stage <= k < 2 * stage + 2}
            # A tied LM head is kept on the last stage too; we move it once, under wte.
            assert want <= kept and len(kept - want) <= 1, (key, stage, kept ^ want)
            # (there, untied from the dropped wte, it is the last layer's like any head)
            assert layer_of(part, role) == {n: whole.get(n, LAYERS - 1) for n in kept}
    with torch.device("meta"):   # every rank can build the table without weights
        meta = build_causal_lm(tiny_config("llama", vocab_size=96, hidden_size=32,
                                           layers=LAYERS, max_positions=64))
    assert param_table(meta, "actor").shapes == param_table(*models["llama"]).shapes


def test_local_shards_assemble_to_the_model() -> None:
    model, role = _models()["gpt2"]
    table = param_table(model, role)
    cluster = Cluster.uniform(1, 4)
    for lay in _layouts(cluster, table):
        shards = {r: local_shard(model, role, lay, r) for r in lay.mesh.ranks}
        whole = assemble(table, lay, shards)
        params = dict(model.named_parameters())
        assert all(torch.equal(whole[n], params[n]) for n in table.names)


# -- 4 gloo ranks ---------------------------------------------------------------------------------
def _all_pairs_rank(rank: int, world: int) -> dict:
    rows: list[dict] = []
    t0 = time.perf_counter()
    for cname, cluster in _clusters().items():
        for mname, (model, role) in _models().items():
            table = param_table(model, role)
            layouts = _layouts(cluster, table)
            mine = [local_shard(model, role, lay, rank) for lay in layouts]
            for i, a in enumerate(layouts):
                for j in range(i, len(layouts)):
                    b = layouts[j]
                    ab = execute(table, a, b, mine[i], cluster, timeout=30.0)
                    _same(ab.shard, mine[j], f"{cname} {mname} {a} -> {b}")
                    ba = execute(table, b, a, ab.shard, cluster, timeout=30.0)
                    _same(ba.shard, mine[i], f"{cname} {mname} {b} -> {a}")
                    links = {t.link for r in (ab, ba) for t in r.plan.transfers}
                    rows.append({"pair": (cname, mname, _name(a), _name(b)), "links": links,
                                 "ab": (ab.bytes, ab.min_bytes, ab.sent_bytes, ab.recv_bytes),
                                 "ba": (ba.bytes, ba.min_bytes, ba.sent_bytes, ba.recv_bytes)})
    return {"rows": rows, "seconds": time.perf_counter() - t0}


def _name(lay: MeshLayout) -> str:
    s = lay.strategy
    return f"{lay.mesh.name}({s.dp},{s.tp},{s.pp})"


def _same(got, want, what: str) -> None:  # noqa: ANN001
    if want is None:
        assert got is None, what
        return
    assert got is not None and list(got) == list(want), what
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), f"{what}: {n}"


def test_every_layout_pair_round_trips_bit_exact() -> None:
    from rlhf_fusion.launch import run_ranks

    results = run_ranks(_all_pairs_rank, 4, timeout=240.0, collective_timeout=60.0)
    per_rank = [r.value["rows"] for r in results]
    rows = per_rank[0]
    # 1x4: 4 + 2 * 3 + 6 = 16 layouts (136 pairs with i <= j); 2x2: tp <= 2, 4 + 2 * 3 + 5 = 15
    # (120 pairs); three models. Each pair ran both ways.
    assert len(rows) == 3 * (136 + 120)
    assert all(len(x) == len(rows) for x in per_rank)
    for k, row in enumerate(rows):
        for way in ("ab", "ba"):
            total, least, _, _ = row[way]
            assert total == least, row
            # Every byte counted is a byte some rank sent and another received.
            assert sum(x[k][way][2] for x in per_rank) == total, row
            assert sum(x[k][way][3] for x in per_rank) == total, row
    assert any(row["ab"][0] > 0 for row in rows)
    # Two nodes: some pieces had a holder on the destination's node (NVLink), some did not (IB).
    two_node = set().union(*(row["links"] for row in rows if row["pair"][0] == "2x2"))
    assert two_node == {"nvlink", "ib"}
    assert set().union(*(row["links"] for row in rows if row["pair"][0] == "1x4")) == {"nvlink"}


def _stalled_peer_rank(rank: int, world: int) -> str:
    """Rank 1 waits for a piece rank 0 never sends (rank 0 skips the call)."""
    model, role = _models()["llama"]
    table = param_table(model, role)
    cluster = Cluster.uniform(1, 2)
    from rlhf_fusion.placement import Layout, make_mesh

    a = MeshLayout(make_mesh(cluster, "main", 0, 1, 0, 1), Layout(1, 1, 1))
    b = MeshLayout(make_mesh(cluster, "main", 0, 1, 1, 1), Layout(1, 1, 1))
    if rank == 0:
        time.sleep(6.0)
        return "skipped"
    execute(table, a, b, None, cluster, timeout=1.0)
    return "no timeout"


def test_stalled_peer_times_out_naming_the_transfer() -> None:
    from rlhf_fusion.launch import run_ranks

    t0 = time.perf_counter()
    results = run_ranks(_stalled_peer_rank, 2, timeout=60.0, collective_timeout=60.0,
                        raise_on_error=False, wait_for=[1])
    bad = results[1]
    assert not bad.ok and bad.error_type == "PipelineTimeoutError", bad
    assert "receiving layers [0, 4) columns [0, 1) from rank 0 to rank 1" in bad.error
    assert bad.seconds < 30.0, time.perf_counter() - t0
