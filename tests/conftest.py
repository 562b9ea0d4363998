"""Shared test setup: hypothesis profiles, the `cuda` marker's skip, the perturbed timing of
`just test-perturbed` (tests/perturb.py), and a host-reservations directory of each test's own
(`omni_pcache.host_reservations`), so that no test counts the caches of another test, or of
processes outside the suite, against its host budget."""

from __future__ import annotations

import itertools
import os
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=60, stateful_step_count=40, deadline=None)
settings.register_profile(
    "slow",
    max_examples=600,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Small CPU tensors: intra-op threads only add contention on the 2-core test machines.
torch.set_num_threads(1)


@pytest.fixture
def busy_switching(request: pytest.FixtureRequest):
    """More thread switches per second (every 1e-4 s, or the indirect parameter), so more
    interleavings of engine, committer and reader threads; restored after the test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(getattr(request, "param", 1e-4))
    yield
    sys.setswitchinterval(before)


_reservation_dirs = tempfile.TemporaryDirectory(prefix="omni_pcache_reservations_")
_reservation_serials = itertools.count()


@pytest.fixture(autouse=True)
def own_reservations_dir(monkeypatch: pytest.MonkeyPatch) -> str:
    """A host-reservations directory no other test uses (made by the first cache to admit keys)."""
    path = os.path.join(_reservation_dirs.name, str(next(_reservation_serials)))
    monkeypatch.setenv("OMNI_PCACHE_RESERVATIONS_DIR", path)
    return path


def pytest_configure(config: pytest.Config) -> None:
    kind = os.environ.get("OMNI_PCACHE_PERTURB")
    if kind:  # (`just test-perturbed`: tests/perturb.py)
        import perturb

        perturb.install(kind)


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `just gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
