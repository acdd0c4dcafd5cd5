"""The ``--fusion.*`` flags of ``rlhf-fusion openrlhf`` and their split from OpenRLHF's own.

Pure Python (no torch, ray or openrlhf): the launcher parses these before anything heavy is
imported, and the Ray workers read them back from one environment variable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ...errors import RLHFFusionError

__all__ = ["ENV_VAR", "FUSION_FLAGS", "FusionFlagError", "FusionOptions", "split_argv"]

# Carries the options from the driver to every Ray worker (runtime_env env_vars).
ENV_VAR = "RLHF_FUSION_OPENRLHF"

# flag -> (takes a value, help)
FUSION_FLAGS: dict[str, tuple[bool, str]] = {
    "--fusion.stream": (False, "sample-level streaming generation: one vLLM request per sample, "
                               "each collected the moment it finishes"),
    "--fusion.stream_scoring": (False, "stream the Reward/Ref/Critic (and Actor) forwards of each "
                                       "micro-batch while the rest still decodes; implies "
                                       "--fusion.stream; stock where the topology gives nothing "
                                       "to overlap (colocate_all, async, dynamic batches)"),
    "--fusion.rt": (True, "long-tail migration when at most R_t samples still decode: 'auto' "
                          "or a fraction of the batch in (0, 1]; implies --fusion.stream"),
    "--fusion.mechanism": (True, "migration mechanism: 'tokens' (abort, resubmit prompt + "
                                 "generated ids) or 'auto' (= tokens: vLLM engines export no KV)"),
    "--fusion.wait_s": (True, "give up (an error) when no sample finished for this many seconds; "
                              "default: wait without bound, as stock"),
    "--fusion.gae": (False, "GAE advantages and returns by rlhf_fusion's blocked matrix form in "
                            "place of RemoteExperienceMaker.get_advantages_and_returns (only "
                            "--algo.advantage.estimator gae calls it; on CPU tensors there)"),
    "--fusion.pipeline": (False, "fused Actor/Critic pipeline (not wired for OpenRLHF's "
                                 "DeepSpeed groups yet: refused with an error)"),
}


class FusionFlagError(RLHFFusionError, ValueError):
    """A ``--fusion.*`` flag that does not exist or has a bad value; the message lists the fix."""


def _known() -> str:
    return ", ".join(f"{f}{' VALUE' if v else ''}" for f, (v, _) in FUSION_FLAGS.items())


@dataclass(frozen=True)
class FusionOptions:
    """Which plugins run. The default (every field off) is stock OpenRLHF."""

    stream: bool = False
    stream_scoring: bool = False
    rt: float | str | None = None  # None: no migration; "auto" or a fraction of the batch
    mechanism: str = "tokens"
    wait_s: float | None = None  # None: wait for the next sample without bound (stock)
    gae: bool = False
    pipeline: bool = False

    def __post_init__(self) -> None:
        if self.rt is not None and self.rt != "auto":
            try:
                rt = float(self.rt)
            except (TypeError, ValueError):
                raise FusionFlagError(f"--fusion.rt {self.rt!r}: use 'auto' or a fraction "
                                      "of the batch in (0, 1], e.g. 0.25") from None
            if not 0 < rt <= 1:
                raise FusionFlagError(f"--fusion.rt {self.rt!r}: a fraction must be in (0, 1]")
            object.__setattr__(self, "rt", rt)
        if self.wait_s is not None:
            try:
                wait_s = float(self.wait_s)
            except (TypeError, ValueError):
                raise FusionFlagError(f"--fusion.wait_s {self.wait_s!r}: give seconds, "
                                      "e.g. 1800") from None
            if not wait_s > 0:
                raise FusionFlagError(f"--fusion.wait_s {self.wait_s!r}: must be > 0")
            object.__setattr__(self, "wait_s", wait_s)
        if self.mechanism not in ("tokens", "auto"):
            raise FusionFlagError(f"--fusion.mechanism {self.mechanism!r}: use 'tokens' or "
                                  "'auto' (vLLM engines have no KV export, so no 'kv')")
        if (self.rt is not None or self.stream_scoring) and not self.stream:
            # migration moves streamed requests; scoring consumes them as they finish
            object.__setattr__(self, "stream", True)

    @property
    def migrate(self) -> bool:
        return self.rt is not None

    @property
    def any(self) -> bool:
        return self.stream or self.gae or self.pipeline

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FusionOptions | None:
        raw = (os.environ if environ is None else environ).get(ENV_VAR)
        return None if raw is None else cls(**json.loads(raw))


def split_argv(argv: Sequence[str]) -> tuple[list[str], FusionOptions]:
    """``argv`` without the ``--fusion.*`` flags (OpenRLHF's, untouched and in order), and them.

    Accepts ``--fusion.rt 0.25`` and ``--fusion.rt=0.25``. An unknown ``--fusion.*`` flag is a
    FusionFlagError listing the known ones (before OpenRLHF's parser would see it).
    """
    stock: list[str] = []
    values: dict[str, object] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--fusion"):  # no stock flag starts so
            stock.append(arg)
            i += 1
            continue
        flag, eq, inline = arg.partition("=")
        if flag not in FUSION_FLAGS:
            near = "--fusion." + flag.removeprefix("--fusion").lstrip(".-_").replace("-", "_")
            hint = f" (did you mean {near}?)" if near in FUSION_FLAGS else ""
            raise FusionFlagError(f"unknown flag {flag}{hint}; the --fusion flags are: "
                                  f"{_known()}")
        takes_value, _ = FUSION_FLAGS[flag]
        if takes_value:
            if eq:
                value: object = inline
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                raise FusionFlagError(f"{flag} needs a value ({FUSION_FLAGS[flag][1]})")
        else:
            if eq:
                raise FusionFlagError(f"{flag} is a switch and takes no value; write just {flag}")
            value = True
        values[flag.removeprefix("--fusion.")] = value
        i += 1
    return stock, FusionOptions(**values)  # type: ignore[arg-type]
