"""Test support: run a test module's kernel tests under the Triton interpreter.

The interpreter is chosen per process when Triton is imported (``TRITON_INTERPRET=1``), and a
test session on a CPU-only machine must not switch every other test to it. So a kernel test
asks :class:`InterpreterChild` for its device:

* on a machine with CUDA, the compiled kernel runs in the test process itself (``"cuda"``);
* in the interpreter child, it runs on the CPU (``"cpu"``);
* otherwise (a CPU-only test session), the first kernel test of the module starts one child
  ``pytest`` on the same file with ``TRITON_INTERPRET=1``, selecting the kernel tests, and each
  kernel test then reports the outcome its twin had in the child (``None`` is returned and the
  test body returns early).

Usage in a test module::

    _CHILD = InterpreterChild(__file__, select="kernel")

    @pytest.fixture
    def kernel_device(request):
        return _CHILD.device_for(request.node.name)

    def test_kernel_something(kernel_device):
        if kernel_device is None:
            return  # ran in the TRITON_INTERPRET=1 child, outcome checked by the fixture
        ...
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass

__all__ = ["CHILD_ENV", "InterpreterChild", "in_interpreter_child"]

CHILD_ENV = "RLHF_FUSION_INTERPRETER_CHILD"


def in_interpreter_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


@dataclass
class _Outcome:
    status: str  # "passed" | "failed" | "skipped"
    message: str


class InterpreterChild:
    """Runs the ``select``-ed tests of ``test_file`` once in a TRITON_INTERPRET=1 child."""

    def __init__(self, test_file: str, select: str, timeout: float = 900.0) -> None:
        self.test_file = os.path.abspath(test_file)
        self.select = select
        self.timeout = timeout
        self._outcomes: dict[str, _Outcome] | None = None
        self._error: str | None = None

    def device_for(self, test_name: str) -> str | None:
        import pytest
        import torch

        if in_interpreter_child():
            return "cpu"
        if torch.cuda.is_available():
            return "cuda"
        outcome = self._outcome(test_name)
        if outcome.status == "failed":
            pytest.fail(f"under TRITON_INTERPRET=1 (child process):\n{outcome.message}")
        if outcome.status == "skipped":
            pytest.skip(f"skipped in the TRITON_INTERPRET=1 child: {outcome.message}")
        return None

    def _outcome(self, test_name: str) -> _Outcome:
        if self._outcomes is None and self._error is None:
            self._run()
        if self._error is not None:
            return _Outcome("failed", self._error)
        assert self._outcomes is not None
        outcome = self._outcomes.get(test_name)
        if outcome is None:
            return _Outcome("failed", f"{test_name} did not run in the interpreter child")
        return outcome

    def _run(self) -> None:
        env = dict(os.environ)
        env["TRITON_INTERPRET"] = "1"
        env[CHILD_ENV] = "1"
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.xml")
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                self.test_file,
                "-q",
                "-k",
                self.select,
                "-p",
                "no:cacheprovider",
                f"--junitxml={report}",
            ]
            try:
                proc = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, timeout=self.timeout
                )
            except subprocess.TimeoutExpired as exc:
                self._error = f"interpreter child timed out after {self.timeout:.0f}s: {exc}"
                return
            if not os.path.exists(report):
                self._error = (
                    f"interpreter child produced no report (exit {proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                )
                return
            self._outcomes = _parse_junit(report)
        if not self._outcomes:
            self._error = f"interpreter child ran no tests:\n{proc.stdout[-4000:]}"


def _parse_junit(path: str) -> dict[str, _Outcome]:
    outcomes: dict[str, _Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
            if child.tag == "skipped":
                status, message = "skipped", child.get("message") or ""
        outcomes[name] = _Outcome(status, message.strip())
    return outcomes
