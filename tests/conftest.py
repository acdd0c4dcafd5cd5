import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _single_thread_torch_env(monkeypatch):
    # Two-core machine: keep each test (and the processes it spawns) from oversubscribing.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # CI steps whose whole point is a dependency (the vLLM step) set RLHF_FUSION_NO_SKIP=1, so a
    # test that skips there (vllm failed to import, a fixture found no engine) fails the step
    # instead of passing it with nothing run.
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and os.environ.get("RLHF_FUSION_NO_SKIP") == "1" and not hasattr(rep, "wasxfail"):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"skipped where RLHF_FUSION_NO_SKIP=1 forbids skips: {reason}"
