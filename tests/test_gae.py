"""GAE: the blocked torch path and the Triton kernel against the reverse loop.

The reverse loop (``gae_reference``, in float64) is written as TRL/OpenRLHF ("zero") and verl
("skip") write it; where OpenRLHF or verl can be imported, ``gae`` is also checked against their
own functions. ``test_kernel_*`` tests run the Triton kernel: on CUDA when present, else in
one child process under ``TRITON_INTERPRET=1`` (see ``rlhf_fusion.testing.kernels``).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_fusion.testing import InterpreterChild, in_interpreter_child
from rlhf_fusion.triton_kernels import (
    gae,
    gae_packed,
    gae_packed_reference,
    gae_reference,
    gae_torch,
    gae_triton,
)

# the package attribute `gae` is the function; the module is needed for monkeypatching
_GAE = importlib.import_module("rlhf_fusion.triton_kernels.gae")
_CHILD = InterpreterChild(__file__, select="kernel")


@pytest.fixture
def kernel_device(request: pytest.FixtureRequest) -> str | None:
    pytest.importorskip("triton")
    return _CHILD.device_for(request.node.name)


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------

MASK_KINDS = ("none", "right", "left", "holes", "random", "empty_row", "single")


def make_mask(kind: str, bsz: int, steps: int, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    pos = torch.arange(steps)[None, :]
    lens = torch.randint(0, steps + 1, (bsz,), generator=gen)
    lens[0] = steps  # one full row
    if kind == "right":
        return pos < lens[:, None]
    if kind == "left":
        return pos >= (steps - lens)[:, None]
    if kind == "holes":
        # multi-turn: response tokens interleaved with observation (tool/env) tokens
        m = torch.ones(bsz, steps, dtype=torch.bool)
        for b in range(bsz):
            t = int(torch.randint(0, 3, (1,), generator=gen))
            while t < steps:
                hole = int(torch.randint(1, 9, (1,), generator=gen))
                m[b, t : t + hole] = False
                t += hole + int(torch.randint(1, 12, (1,), generator=gen))
        m[:, -1] &= torch.rand(bsz, generator=gen) < 0.5  # sometimes ends on a hole
        return m
    if kind == "random":
        return torch.rand(bsz, steps, generator=gen) < 0.6
    if kind == "empty_row":
        m = torch.rand(bsz, steps, generator=gen) < 0.7
        m[-1] = False
        return m
    if kind == "single":
        m = torch.zeros(bsz, steps, dtype=torch.bool)
        m[torch.arange(bsz), torch.randint(0, steps, (bsz,), generator=gen)] = True
        return m
    raise ValueError(kind)


def make_inputs(bsz: int, steps: int, kind: str, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(bsz, steps, generator=gen)
    values = torch.randn(bsz, steps, generator=gen)
    mask = make_mask(kind, bsz, steps, gen)
    if mask is not None:
        # garbage where masked: the result must not depend on it (except skip's returns)
        rewards = torch.where(mask, rewards, 1e3 * torch.randn(bsz, steps, generator=gen))
        values = torch.where(mask, values, -1e3 * torch.randn(bsz, steps, generator=gen))
    return rewards.to(dtype), values.to(dtype), mask


def assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """float32 result vs float64 loop: equal up to float32 rounding of a length-T recursion."""
    assert got.dtype == torch.float32, got.dtype
    assert got.shape == ref.shape
    scale = 1.0 + float(ref.abs().max()) if ref.numel() else 1.0
    steps = max(1, ref.shape[-1])
    atol = 4e-7 * scale * math.sqrt(steps) + 1e-6
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=atol, msg=lambda m: f"{what}{m}")


def check_against_loop(fn, rewards, values, mask, *, gamma, lam, semantics, bootstrap=None):
    adv, ret = fn(
        rewards, values, mask, gamma=gamma, lam=lam, semantics=semantics, bootstrap=bootstrap
    )
    ref_adv, ref_ret = gae_reference(
        rewards, values, mask, gamma=gamma, lam=lam, semantics=semantics, bootstrap=bootstrap
    )
    assert_matches(adv.cpu(), ref_adv.cpu(), "advantages: ")
    assert_matches(ret.cpu(), ref_ret.cpu(), "returns: ")


GAMMA_LAM = [(0.99, 0.95), (1.0, 1.0), (1.0, 0.95), (0.9, 0.0), (0.0, 0.9), (0.3, 0.2)]


# --------------------------------------------------------------------------------------------
# the reference itself
# --------------------------------------------------------------------------------------------


def test_reference_semantics_by_hand():
    # one row, a hole in the middle: t=0 valid, t=1 masked, t=2 valid
    r = torch.tensor([[1.0, 5.0, 2.0]])
    v = torch.tensor([[0.5, 7.0, 0.25]])
    m = torch.tensor([[True, False, True]])
    g, lam = 0.9, 0.8
    adv, ret = gae_reference(r, v, m, gamma=g, lam=lam, semantics="skip")
    d2 = 2.0 - 0.25
    d0 = 1.0 + g * 0.25 - 0.5  # bootstraps from t=2, passing over the hole
    expected = torch.tensor([[d0 + g * lam * d2, d2, d2]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + v.double())
    adv, ret = gae_reference(r, v, m, gamma=g, lam=lam, semantics="zero")
    z2 = 2.0 - 0.25
    z1 = 0.0 + g * 0.25 - 0.0 + g * lam * z2  # the recursion runs through the zeroed hole
    z0 = 1.0 + 0.0 - 0.5 + g * lam * z1
    torch.testing.assert_close(adv, torch.tensor([[z0, z1, z2]], dtype=torch.float64))
    torch.testing.assert_close(ret, adv + torch.tensor([[0.5, 0.0, 0.25]], dtype=torch.float64))


def test_semantics_differ_on_holes_and_agree_without_mask():
    r, v, m = make_inputs(4, 50, "holes")
    a_zero, _ = gae_torch(r, v, m, gamma=0.99, lam=0.95, semantics="zero")
    a_skip, _ = gae_torch(r, v, m, gamma=0.99, lam=0.95, semantics="skip")
    assert (a_zero - a_skip).abs().max() > 1e-2  # the tests below can tell them apart
    a_zero, _ = gae_torch(r, v, None, gamma=0.99, lam=0.95, semantics="zero")
    a_skip, _ = gae_torch(r, v, None, gamma=0.99, lam=0.95, semantics="skip")
    torch.testing.assert_close(a_zero, a_skip)


# --------------------------------------------------------------------------------------------
# the peers' own functions, where they can be imported
# --------------------------------------------------------------------------------------------


def _peer(module: str, attr: str):
    """``module.attr``, or skip: the peer is not installed, or its import chain needs packages
    (ray, deepspeed, vllm, ...) that this environment does not have."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means "not available here"
        pytest.skip(f"{module} is not importable here: {type(exc).__name__}: {exc}")
    return getattr(mod, attr)


PEER_CASES = [  # (mask kind, gamma, lam): every mask kind that tells the semantics apart
    (kind, gamma, lam)
    for kind in ("none", "right", "left", "holes", "random")
    for gamma, lam in ((0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.3, 0.2))
]


def test_zero_semantics_match_openrlhf():
    """OpenRLHF 0.11: ``RemoteExperienceMaker.get_advantages_and_returns`` (uses no ``self``)."""
    maker = _peer("openrlhf.trainer.ppo_utils.experience_maker", "RemoteExperienceMaker")
    for i, (kind, gamma, lam) in enumerate(PEER_CASES):
        r, v, m = make_inputs(4, 96, kind, seed=31 + i)
        mask = None if m is None else m.double()
        # the peer in float64: a reference, not a second float32 rounding to compare against
        want_adv, want_ret = maker.get_advantages_and_returns(
            None, v.double(), r.double(), mask, gamma, lam
        )
        adv, ret = gae(r, v, m, gamma=gamma, lam=lam, semantics="zero")
        case = f"{kind} gamma={gamma} lam={lam}: "
        close = dict(rtol=1e-5, atol=1e-5, msg=lambda msg, case=case: case + msg)
        torch.testing.assert_close(adv.double(), want_adv, **close)
        torch.testing.assert_close(ret.double(), want_ret, **close)


@pytest.mark.verl  # runs in .ci/verl, where verl 0.9.1 is installed
def test_skip_semantics_match_verl():
    """verl: ``compute_gae_advantage_return`` returns whitened advantages and raw returns."""
    verl_gae = _peer("verl.trainer.ppo.core_algos", "compute_gae_advantage_return")
    masked_whiten = _peer("verl.utils.torch_functional", "masked_whiten")
    for i, (kind, gamma, lam) in enumerate(PEER_CASES):
        r, v, m = make_inputs(4, 96, kind, seed=37 + i)
        mask = torch.ones_like(r, dtype=torch.float64) if m is None else m.double()
        r64, v64 = r.double(), v.double()  # the peer in float64, as a reference
        want_whitened, want_ret = verl_gae(r64, v64, mask, gamma, lam)
        adv, ret = gae(r, v, m, gamma=gamma, lam=lam, semantics="skip")
        case = f"{kind} gamma={gamma} lam={lam}: "
        close = dict(rtol=1e-5, atol=1e-5, msg=lambda msg, case=case: case + msg)
        # returns everywhere, masked positions too (there verl's is the carried advantage + value)
        torch.testing.assert_close(ret.double(), want_ret, **close)
        torch.testing.assert_close(adv.double(), want_ret - v64, **close)
        torch.testing.assert_close(masked_whiten(adv.double(), mask), want_whitened, **close)


# --------------------------------------------------------------------------------------------
# blocked torch path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("semantics", ["zero", "skip"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize(
    "shape",
    [(3, 1), (1, 2), (3, 127), (2, 64), (5, 2049), (2, 4100)],
    ids=lambda s: f"{s[0]}x{s[1]}",
)
def test_torch_matches_loop(shape, kind, semantics):
    bsz, steps = shape
    r, v, m = make_inputs(bsz, steps, kind, seed=steps)
    # long rows: 2049 / 4100 need two / three carry levels; two settings keep the loop cheap
    pairs = GAMMA_LAM if steps < 1000 else [(0.99, 0.95), (1.0, 1.0)]
    for gamma, lam in pairs:
        check_against_loop(gae_torch, r, v, m, gamma=gamma, lam=lam, semantics=semantics)


@pytest.mark.parametrize("semantics", ["zero", "skip"])
@pytest.mark.parametrize("kind", ["none", "right", "holes", "empty_row"])
def test_torch_bootstrap(kind, semantics):
    r, v, m = make_inputs(4, 300, kind, seed=3)
    boot = torch.randn(4)
    check_against_loop(gae_torch, r, v, m, gamma=0.97, lam=0.9, semantics=semantics, bootstrap=boot)
    check_against_loop(gae_torch, r, v, m, gamma=1.0, lam=1.0, semantics=semantics, bootstrap=2.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("semantics", ["zero", "skip"])
def test_torch_input_dtypes(dtype, semantics):
    # float32 results (assert_matches checks the dtype) equal to the loop on the same inputs
    r, v, m = make_inputs(3, 257, "holes", seed=5, dtype=dtype)
    check_against_loop(gae_torch, r, v, m, gamma=0.99, lam=0.95, semantics=semantics)


@pytest.mark.parametrize("semantics", ["zero", "skip"])
def test_torch_mask_dtypes_and_strides(semantics):
    r, v, m = make_inputs(3, 200, "holes", seed=7)
    ref = gae_torch(r, v, m, gamma=0.95, lam=0.9, semantics=semantics)
    for mask in (m.to(torch.uint8), m.to(torch.float32), m.to(torch.int64)):
        got = gae_torch(r, v, mask, gamma=0.95, lam=0.9, semantics=semantics)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # non-contiguous views (time-major storage)
    rt, vt, mt = (x.t().contiguous().t() for x in (r, v, m))
    got = gae_torch(rt, vt, mt, gamma=0.95, lam=0.9, semantics=semantics)
    torch.testing.assert_close(got, ref)


def test_torch_masked_positions_are_ignored():
    r, v, m = make_inputs(3, 100, "holes", seed=11)
    r2 = torch.where(m, r, torch.randn_like(r))
    v2 = torch.where(m, v, torch.randn_like(v))
    for semantics in ("zero", "skip"):
        a1, ret1 = gae_torch(r, v, m, gamma=0.99, lam=0.95, semantics=semantics)
        a2, ret2 = gae_torch(r2, v2, m, gamma=0.99, lam=0.95, semantics=semantics)
        torch.testing.assert_close(a1, a2)
        torch.testing.assert_close(ret1[m], ret2[m])


def test_torch_nan_in_masked_positions_does_not_leak():
    r, v, m = make_inputs(2, 70, "holes", seed=2)
    r = torch.where(m, r, float("nan"))
    v = torch.where(m, v, float("nan"))
    for semantics in ("zero", "skip"):
        adv, ret = gae_torch(r, v, m, gamma=0.99, lam=0.95, semantics=semantics)
        assert torch.isfinite(adv).all()
        assert torch.isfinite(ret[m]).all()


def test_torch_results_do_not_alias_scratch_buffers():
    r, v, m = make_inputs(3, 256, "holes", seed=1)
    adv, ret = gae_torch(r, v, m, gamma=0.9, lam=0.9, semantics="skip")
    saved = adv.clone(), ret.clone()
    r2, v2, m2 = make_inputs(3, 256, "random", seed=2)
    gae_torch(r2, v2, m2, gamma=0.5, lam=0.5, semantics="skip")
    torch.testing.assert_close((adv, ret), saved, rtol=0, atol=0)


def test_torch_blocks_stay_small_and_normal(monkeypatch):
    """No T x T matrix is built, and no power is a denormal."""
    sizes = []
    real = _GAE._block_mats

    def spy(w, n, device):
        sizes.append(n)
        ut, tail = real(w, n, device)
        for t in (ut, tail):
            nz = t[t != 0]
            assert (nz.abs() >= torch.finfo(torch.float32).tiny).all(), (w, n)
        return ut, tail

    monkeypatch.setattr(_GAE, "_block_mats", spy)
    r, v, m = make_inputs(2, 9000, "right")
    for gamma, lam in [(0.99, 0.95), (0.5, 0.3), (1.0, 1.0), (0.9, 0.0)]:
        gae_torch(r, v, m, gamma=gamma, lam=lam)
    assert max(sizes) <= _GAE.TORCH_BLOCK


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    bsz=st.integers(1, 4),
    steps=st.integers(1, 300),
    kind=st.sampled_from(MASK_KINDS),
    semantics=st.sampled_from(["zero", "skip"]),
    gamma=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]),
    lam=st.sampled_from([0.0, 0.3, 0.95, 1.0]),
    with_boot=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_torch_property(bsz, steps, kind, semantics, gamma, lam, with_boot, seed):
    r, v, m = make_inputs(bsz, steps, kind, seed=seed)
    boot = torch.randn(bsz) if with_boot else None
    check_against_loop(
        gae_torch, r, v, m, gamma=gamma, lam=lam, semantics=semantics, bootstrap=boot
    )


def test_empty_inputs():
    for shape in [(0, 5), (3, 0), (0, 0)]:
        r = torch.zeros(shape)
        for semantics in ("zero", "skip"):
            adv, ret = gae(r, r, r > 0, gamma=0.9, lam=0.9, semantics=semantics)
            assert adv.shape == ret.shape == shape and adv.dtype == torch.float32
    adv, ret = gae_packed(
        torch.zeros(0), torch.zeros(0), torch.tensor([0, 0, 0]), gamma=0.9, lam=0.9
    )
    assert adv.shape == (0,)


def test_public_gae_uses_torch_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(_GAE, "gae_triton", lambda *a, **k: calls.append("triton"))
    r, v, m = make_inputs(2, 10, "right")
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.9)
    assert calls == []
    ref_adv, ref_ret = gae_reference(r, v, m, gamma=0.9, lam=0.9)
    assert_matches(adv, ref_adv)
    assert_matches(ret, ref_ret)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(semantics="verl"), "semantics"),
        (dict(gamma=1.5), "gamma"),
        (dict(lam=-0.1), "lam"),
        (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "mask shape"),
        (dict(values=torch.zeros(2, 4)), "values shape"),
        (dict(rewards=torch.zeros(2, 5, dtype=torch.int64)), "floating point"),
        (dict(bootstrap=torch.zeros(3)), "bootstrap"),
        (dict(rewards=torch.zeros(5), values=torch.zeros(5)), r"\[batch, time\]"),
    ],
)
def test_validation_errors(kwargs, match):
    args = dict(
        rewards=torch.zeros(2, 5),
        values=torch.zeros(2, 5),
        mask=None,
        gamma=0.9,
        lam=0.9,
        semantics="zero",
        bootstrap=None,
    )
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        gae(**args)


# --------------------------------------------------------------------------------------------
# packed (cu_seqlens)
# --------------------------------------------------------------------------------------------

PACKED_LENS = [[3, 1, 0, 130, 2], [0, 1], [600], [0, 0, 5, 0], [1, 1, 1], [33, 0, 520, 7]]


def make_packed(lens, kind, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    r = torch.randn(total, generator=gen).to(dtype)
    v = torch.randn(total, generator=gen).to(dtype)
    m = None if kind == "none" else torch.rand(total, generator=gen) < 0.7
    return r, v, cu, m


def check_packed(fn_backend, r, v, cu, m, semantics, boot):
    adv, ret = gae_packed(
        r,
        v,
        cu,
        m,
        gamma=0.99,
        lam=0.95,
        semantics=semantics,
        bootstrap=boot,
        backend=fn_backend,
    )
    ref_adv, ref_ret = gae_packed_reference(
        r.cpu(),
        v.cpu(),
        cu.cpu(),
        None if m is None else m.cpu(),
        gamma=0.99,
        lam=0.95,
        semantics=semantics,
        bootstrap=None if boot is None else boot.cpu(),
    )
    assert_matches(adv.cpu(), ref_adv, "packed advantages: ")
    assert_matches(ret.cpu(), ref_ret, "packed returns: ")


@pytest.mark.parametrize("semantics", ["zero", "skip"])
@pytest.mark.parametrize("kind", ["none", "random"])
@pytest.mark.parametrize("lens", PACKED_LENS, ids=str)
def test_torch_packed(lens, kind, semantics):
    r, v, cu, m = make_packed(lens, kind, seed=len(lens))
    check_packed("torch", r, v, cu, m, semantics, None)
    check_packed("torch", r, v, cu, m, semantics, torch.randn(len(lens)))


def test_packed_equals_padded():
    r, v, m = make_inputs(3, 40, "holes", seed=1)
    cu = torch.tensor([0, 40, 80, 120])
    for semantics in ("zero", "skip"):
        a_pad, r_pad = gae_torch(r, v, m, gamma=0.9, lam=0.8, semantics=semantics)
        a_pk, r_pk = gae_packed(
            r.flatten(), v.flatten(), cu, m.flatten(), gamma=0.9, lam=0.8, semantics=semantics
        )
        torch.testing.assert_close(a_pk.view(3, 40), a_pad)
        torch.testing.assert_close(r_pk.view(3, 40), r_pad)


def test_packed_validation():
    r = torch.zeros(6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gae_packed(r, r, torch.tensor([0, 2, 5]), gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="non-decreasing"):
        gae_packed(r, r, torch.tensor([0, 4, 2, 6]), gamma=0.9, lam=0.9)
    with pytest.raises(TypeError, match="int32 or int64"):
        gae_packed(r, r, torch.tensor([0.0, 6.0]), gamma=0.9, lam=0.9)


# --------------------------------------------------------------------------------------------
# Triton kernel (CUDA, or TRITON_INTERPRET=1 in a child process)
# --------------------------------------------------------------------------------------------

KERNEL_CASES = [
    # (B, T, mask kind, gamma, lam)
    (3, 1, "none", 0.99, 0.95),
    (3, 1, "single", 0.99, 0.95),
    (1, 2, "right", 1.0, 1.0),
    (3, 127, "right", 0.99, 0.95),
    (3, 127, "left", 1.0, 0.95),
    (3, 127, "holes", 0.99, 0.95),
    (3, 127, "holes", 0.9, 0.0),
    (2, 513, "holes", 1.0, 1.0),
    (2, 513, "random", 0.3, 0.2),
    (5, 64, "empty_row", 0.0, 0.9),
    (2, 2049, "left", 0.99, 0.95),
    (2, 2049, "holes", 0.999, 0.99),
]


def _case_id(case):
    return "B{}-T{}-{}-g{}-l{}".format(*case)


@pytest.mark.parametrize("semantics", ["zero", "skip"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[_case_id(c) for c in KERNEL_CASES])
def test_kernel_matches_loop(kernel_device, case, semantics):
    if kernel_device is None:
        return  # ran under TRITON_INTERPRET=1 in the child process
    bsz, steps, kind, gamma, lam = case
    r, v, m = make_inputs(bsz, steps, kind, seed=steps + bsz)
    dev = lambda x: None if x is None else x.to(kernel_device)
    check_against_loop(
        gae_triton, dev(r), dev(v), dev(m), gamma=gamma, lam=lam, semantics=semantics
    )
    boot = torch.randn(bsz)
    adv, ret = gae_triton(
        dev(r), dev(v), dev(m), gamma=gamma, lam=lam, semantics=semantics, bootstrap=dev(boot)
    )
    ref_adv, ref_ret = gae_reference(
        r, v, m, gamma=gamma, lam=lam, semantics=semantics, bootstrap=boot
    )
    assert_matches(adv.cpu(), ref_adv, "bootstrap advantages: ")
    assert_matches(ret.cpu(), ref_ret, "bootstrap returns: ")


@pytest.mark.parametrize("semantics", ["zero", "skip"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_kernel_input_dtypes(kernel_device, dtype, semantics):
    if kernel_device is None:
        return
    r, v, m = make_inputs(3, 300, "holes", seed=9, dtype=dtype)
    adv, ret = gae_triton(
        r.to(kernel_device),
        v.to(kernel_device),
        m.to(kernel_device),
        gamma=0.99,
        lam=0.95,
        semantics=semantics,
    )
    assert adv.dtype == ret.dtype == torch.float32
    ref_adv, ref_ret = gae_reference(r, v, m, gamma=0.99, lam=0.95, semantics=semantics)
    assert_matches(adv.cpu(), ref_adv)
    assert_matches(ret.cpu(), ref_ret)


@pytest.mark.parametrize("semantics", ["zero", "skip"])
def test_kernel_mask_dtypes_and_strides(kernel_device, semantics):
    if kernel_device is None:
        return
    r, v, m = make_inputs(3, 200, "holes", seed=4)
    r, v, m = r.to(kernel_device), v.to(kernel_device), m.to(kernel_device)
    ref = gae_triton(r, v, m, gamma=0.95, lam=0.9, semantics=semantics)
    check_against_loop(gae_triton, r, v, m, gamma=0.95, lam=0.9, semantics=semantics)
    for mask in (m.to(torch.uint8), m.to(torch.float32), m.to(torch.int32)):
        got = gae_triton(r, v, mask, gamma=0.95, lam=0.9, semantics=semantics)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    rt, vt, mt = (x.t().contiguous().t() for x in (r, v, m))  # column-major views
    got = gae_triton(rt, vt, mt, gamma=0.95, lam=0.9, semantics=semantics)
    torch.testing.assert_close(got, ref)
    wide = torch.zeros(3, 410, device=r.device)  # a strided slice of a wider buffer
    wide[:, 5:405] = torch.cat([r, v], dim=1)
    got = gae_triton(wide[:, 5:205], wide[:, 205:405], m, gamma=0.95, lam=0.9, semantics=semantics)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("semantics", ["zero", "skip"])
@pytest.mark.parametrize("kind", ["none", "random"])
@pytest.mark.parametrize("lens", PACKED_LENS, ids=str)
def test_kernel_packed(kernel_device, lens, kind, semantics):
    if kernel_device is None:
        return
    r, v, cu, m = make_packed(lens, kind, seed=len(lens))
    dev = lambda x: None if x is None else x.to(kernel_device)
    check_packed("triton", dev(r), dev(v), dev(cu), dev(m), semantics, None)
    check_packed(
        "triton", dev(r), dev(v), dev(cu.long()), dev(m), semantics, dev(torch.randn(len(lens)))
    )


def test_compiled_kernel_rejects_cpu_tensors():
    pytest.importorskip("triton")
    if in_interpreter_child():
        pytest.skip("the interpreter runs CPU tensors")
    r = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gae_triton(r, r, None, gamma=0.9, lam=0.9)


def test_kernel_empty_inputs(kernel_device):
    if kernel_device is None:
        return
    for shape in [(0, 5), (3, 0)]:
        r = torch.zeros(shape, device=kernel_device)
        adv, ret = gae_triton(r, r, None, gamma=0.9, lam=0.9)
        assert adv.shape == shape
    z = torch.zeros(0, device=kernel_device)
    adv, _ = gae_packed(
        z, z, torch.tensor([0, 0], device=kernel_device), gamma=0.9, lam=0.9, backend="triton"
    )
    assert adv.shape == (0,)


def test_kernel_nan_in_masked_positions_does_not_leak(kernel_device):
    if kernel_device is None:
        return
    r, v, m = make_inputs(2, 300, "holes", seed=2)
    r = torch.where(m, r, float("nan")).to(kernel_device)
    v = torch.where(m, v, float("nan")).to(kernel_device)
    m = m.to(kernel_device)
    for semantics in ("zero", "skip"):
        adv, ret = gae_triton(r, v, m, gamma=0.99, lam=0.95, semantics=semantics)
        assert torch.isfinite(adv).all()
        assert torch.isfinite(ret[m]).all()


def test_kernel_agrees_with_torch_path(kernel_device):
    if kernel_device is None:
        return
    r, v, m = make_inputs(4, 1000, "holes", seed=21)
    for semantics in ("zero", "skip"):
        k = gae_triton(r.to(kernel_device), v.to(kernel_device), m.to(kernel_device),
                       gamma=0.99, lam=0.95, semantics=semantics)  # fmt: skip
        t = gae_torch(r, v, m, gamma=0.99, lam=0.95, semantics=semantics)
        for a, b in zip(k, t, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=2e-5)
