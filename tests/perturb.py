"""Perturbed timing for a whole test run, so a test that passes only because the committer
usually keeps up fails every time instead of once in a while on a loaded machine.

``OMNI_PCACHE_PERTURB`` (set by `just test-perturbed`, read by conftest at start) names one:

- ``slow-write``: each batch the pool's writer writes waits 30 ms first (tasks stay in
  transit, their staging pages held);
- ``late-wake``: the committer waits 20 ms after each wake-up before it pops (tasks stay
  queued);
- ``slow-copy``: each step's CPU copies into staging wait 20 ms first (the fence, a
  reader's wait and the committer all find the copy running).

Delays only: nothing is reordered that a real machine could not reorder, so every test must
pass under each.
"""

from __future__ import annotations

import threading
import time

from omni_pcache import committer, copy_engine, writes


def _slow_write(delay_s: float = 0.03) -> None:
    write_batch = writes.PoolWriter.write_batch

    def delayed(self, groups):
        time.sleep(delay_s)
        return write_batch(self, groups)

    writes.PoolWriter.write_batch = delayed


def _late_wake(delay_s: float = 0.02) -> None:
    drain_locked = committer.Committer._drain_locked

    def delayed(self):
        if threading.current_thread().name == "omni-pcache-committer":
            time.sleep(delay_s)
        return drain_locked(self)

    committer.Committer._drain_locked = delayed


def _slow_copy(delay_s: float = 0.02) -> None:
    run = copy_engine.HostCopy.run

    def delayed(self):
        if not self.done():
            time.sleep(delay_s)
        return run(self)

    copy_engine.HostCopy.run = delayed


PERTURBATIONS = {"slow-write": _slow_write, "late-wake": _late_wake, "slow-copy": _slow_copy}


def install(kind: str) -> None:
    """Patches the cache's modules for the rest of the process."""
    if kind not in PERTURBATIONS:
        raise ValueError(f"OMNI_PCACHE_PERTURB={kind!r}: one of {sorted(PERTURBATIONS)}")
    PERTURBATIONS[kind]()
