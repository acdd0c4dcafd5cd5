"""The root of every exception rlhf-fusion raises, below every other module (it imports
nothing), so ``except RLHFFusionError`` catches any error of ours and nothing else.

Each error class of the package derives from :class:`RLHFFusionError` *and* from the builtin it
has always been (``ValueError`` for a configuration that cannot work, ``RuntimeError`` for a
failure while running), so an existing ``except ValueError`` still matches.

Two exceptions are ``BaseException`` on purpose and stay outside this root:
``rlhf_fusion.launch.RunInterrupted`` (a stop request must pass the ``except Exception``
wrappers between the signal and the loop) and the verl plugin's ``VerlPluginLoadError`` (a
plugin that fails to load must not be swallowed by verl's own ``except Exception``).
``tests/test_errors.py`` holds the rule for every class the package defines.
"""

from __future__ import annotations


class RLHFFusionError(Exception):
    """Any error raised by rlhf-fusion; the message names the fix."""
