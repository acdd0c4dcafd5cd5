"""Tensor parallelism (DTensor, ``parallelize_module``) on 2 gloo ranks equals one process.

Llama (tied and untied), Qwen2 and GPT-2 (``Conv1D``, fused ``c_attn``) Actors and Llama and
GPT-2 Critics: the forward, three clipped AdamW steps over 4 micro-batches, and the gathered
whole weights, against the same model trained on one process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _sharded_cases import CASES, VOCAB, check_equal, sharded_rank  # noqa: E402

from rlhf_fusion.launch import run_ranks  # noqa: E402
from rlhf_fusion.runtime.tensor_parallel import (  # noqa: E402
    TensorParallelError,
    apply_tensor_parallel,
    check_tensor_parallel,
    fused_qkv_order,
)
from rlhf_fusion.testing.models import tiny_config  # noqa: E402

# float64: the sharded and the whole computation differ only by summation order (row-parallel
# partial sums all-reduced; clipping norms summed per rank), a few ulps. In float32 the same
# order differences are ~1e-7 relative and Adam's first steps (update ~ lr * sign) amplify a
# gradient differing in its last bits where it is near zero; the float32 run is in the loop
# tests, under the loop's data-parallel bound.
TOL = 1e-6
DP_TP_CASES = ("llama-tied-actor", "gpt2-critic")


@pytest.fixture(scope="module")
def tp_results():
    res = run_ranks(sharded_rank, 2, "tp", "float64", timeout=420.0, collective_timeout=120.0)
    return [r.value for r in res]


@pytest.fixture(scope="module")
def dp_tp_results():
    """4 ranks: two data-parallel replicas of a tp=2 model (gradients summed between the
    ranks of equal tp index)."""
    res = run_ranks(sharded_rank, 4, "dp_tp", "float64", DP_TP_CASES, timeout=600.0,
                    collective_timeout=120.0)
    return [r.value for r in res]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_tensor_parallel_training_equals_one_process(tp_results, case):
    check_equal(tp_results, case, TOL, whole_dtensor=False)


@pytest.mark.parametrize("case", DP_TP_CASES)
def test_data_parallel_replicas_of_tensor_parallel_models_equal_one_process(dp_tp_results,
                                                                            case):
    check_equal(dp_tp_results, case, TOL, whole_dtensor=False)


def test_gpt2_fused_qkv_order_gives_each_rank_its_own_heads():
    order = fused_qkv_order(8, 2).tolist()
    # Rank 0: q columns 0-3, k 8-11, v 16-19; rank 1: q 4-7, k 12-15, v 20-23.
    assert order[:12] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert order[12:] == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_indivisible_heads_are_rejected_naming_the_fix():
    conf = tiny_config("llama", vocab_size=VOCAB, hidden_size=48, heads=6, kv_heads=3)
    with pytest.raises(TensorParallelError, match=r"tp=2 does not divide its key/value heads"):
        check_tensor_parallel(conf, 2, "actor")
    check_tensor_parallel(conf, 3, "actor")


def test_a_model_without_a_known_layout_is_rejected():
    class Mesh:
        ndim = 1

        def size(self) -> int:
            return 2

    with pytest.raises(TensorParallelError, match="Linear is not supported; use rlhf_fusion.runtime.CriticModel"):
        apply_tensor_parallel(torch.nn.Linear(2, 2), "critic", Mesh())
