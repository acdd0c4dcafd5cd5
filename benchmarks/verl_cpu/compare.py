"""Checks a pair of tiny verl jobs (run_e2e.sh): GAE recorded with our plugin on and off.

Usage: compare.py ON_DIR OFF_DIR ON_LOG OFF_LOG. Exits non-zero when a check fails.

- every GAE call of the "on" job ran ours, and every call of the "off" job verl's;
- on the same inputs, ours against verl's own function: returns within
  |ours - verl| <= 1e-5 * (1 + |verl|) and whitened advantages within
  1e-5 * (1 + M) / std * (2 + |verl|) (the bounds of rlhf_fusion.integrations.verl.gae_plugin);
- across the two jobs: where the recorded inputs are equal, the advantages within that bound;
- every process of the "on" job that logged verl's platform line (every process that imported
  verl) logged the plugin's line, and no process of the "off" job did.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

PLUGIN_LINE = "rlhf_fusion: verl plugins gae on in pid"
VERL_LINE = "Platform override from VERL_PLATFORM"
PREFIX = re.compile(r"\((\w*) ?pid=(\d+)\)")
PLUGIN_PID = re.compile(PLUGIN_LINE + r" (\d+)")


def load(d: str) -> list[dict]:
    return [torch.load(p, weights_only=False) for p in sorted(Path(d).glob("gae_*.pt"))]


def worst_ratios(adv, ret, s_adv, s_ret, values, mask) -> tuple[float, float]:
    ret_bound = 1e-5 * (1 + s_ret.double().abs())
    r_ret = float(((ret.double() - s_ret.double()).abs() / ret_bound).max())
    raw = (s_ret - values)[mask.bool()].double()
    scale = 1e-5 * (1 + float(raw.abs().max())) / float(raw.std())
    r_adv = float(((adv.double() - s_adv.double()).abs()
                   / (scale * (2 + s_adv.double().abs()))).max())
    return r_ret, r_adv


def processes(log: str) -> tuple[set[int], set[int]]:
    """The pids of Ray workers that imported verl (they log verl's platform line; the
    innermost "(Name pid=N)" prefix is the process that printed it) and the pids the plugin's
    line names. The driver (no prefix) is left out: runtime_env.env_vars reaches Ray's workers,
    not the process that calls ray.init, and the driver computes nothing of the step."""
    verl, plugin = set(), set()
    for line in Path(log).read_text(errors="replace").splitlines():
        found = PREFIX.findall(line)
        if VERL_LINE in line and found:
            verl.add(int(found[-1][1]))
        m = PLUGIN_PID.search(line)
        if m:
            plugin.add(int(m.group(1)))
    return verl, plugin


def main(on_dir: str, off_dir: str, on_log: str, off_log: str) -> int:
    ok = True
    on, off = load(on_dir), load(off_dir)
    print(f"GAE calls: on {len(on)}, off {len(off)}")
    ok &= bool(on) and bool(off)
    for i, r in enumerate(on):
        m = r["mask"]
        r_ret, r_adv = worst_ratios(r["advantages"], r["returns"], r["stock_advantages"],
                                    r["stock_returns"], r["values"], m)
        diff = float((r["advantages"] - r["stock_advantages"]).abs().max())
        print(f"on  call {i}: {r['function']} fused={r['fused']} shape={tuple(m.shape)} "
              f"tokens={int(m.sum())} gamma={r['gamma']} lam={r['lam']} "
              f"rewards!=0: {int((r['rewards'] != 0).sum())}; vs verl on the same inputs: "
              f"max|d adv|={diff:.3g}, worst/bound returns {r_ret:.3f}, advantages {r_adv:.3f}")
        ok &= r["fused"] and r_ret <= 1 and r_adv <= 1
    for i, r in enumerate(off):
        same = torch.equal(r["advantages"], r["stock_advantages"])
        print(f"off call {i}: {r['function']} fused={r['fused']} (equal to verl's: {same})")
        ok &= (not r["fused"]) and same
    for i, (a, b) in enumerate(zip(on, off)):
        inputs_equal = all(torch.equal(a[k], b[k]) for k in ("rewards", "values", "mask"))
        if inputs_equal:
            r_ret, r_adv = worst_ratios(a["advantages"], a["returns"], b["advantages"],
                                        b["returns"], b["values"], b["mask"])
            print(f"call {i} on vs off job: same inputs; worst/bound returns {r_ret:.3f}, "
                  f"advantages {r_adv:.3f}")
            ok &= r_ret <= 1 and r_adv <= 1
        else:
            d = max(float((a[k].double() - b[k].double()).abs().max()) for k in ("rewards", "values"))
            print(f"call {i} on vs off job: inputs differ (max |d| {d:.3g}), compared within "
                  f"each job only")
    for name, log, want in (("on", on_log, True), ("off", off_log, False)):
        verl, plugin = processes(log)
        missing = sorted(verl - plugin) if want else sorted(plugin)
        print(f"{name} job: {len(verl)} Ray worker processes imported verl, "
              f"{len(plugin)} logged the plugin's line; {'missing' if want else 'unexpected'}: "
              f"{missing or 'none'}")
        ok &= not missing and (bool(plugin) if want else True)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
