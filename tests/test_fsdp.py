"""ZeRO-3 (FSDP2 ``fully_shard``) on 2 gloo ranks equals one process.

Each rank runs half of every mini-batch's micro-batches (data parallel), gradients summed
over the two (FSDP's reduce-scatter, SUM), the clipped AdamW step on the rank's 1/2 of every
parameter; the gathered whole weights equal one process running all micro-batches.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _sharded_cases import CASES, check_equal, sharded_rank  # noqa: E402

from rlhf_fusion.launch import run_ranks  # noqa: E402

# float64: the data-parallel sum (rank 0's micro-batches + rank 1's) adds in another order
# than one process accumulating micro-batch by micro-batch; a few ulps (see
# test_tensor_parallel for float32).
TOL = 1e-6


@pytest.fixture(scope="module")
def zero3_results():
    res = run_ranks(sharded_rank, 2, "zero3", "float64", timeout=420.0, collective_timeout=120.0)
    return [r.value for r in res]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_zero3_training_equals_one_process(zero3_results, case):
    check_equal(zero3_results, case, TOL, whole_dtensor=True)
