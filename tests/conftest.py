"""Shared test setup: hypothesis profiles, the `cuda` marker's skip and the perturbed timing of
`just test-perturbed` (tests/perturb.py)."""

from __future__ import annotations

import os
import sys

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
