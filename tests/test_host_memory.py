"""The host-memory budget (`CacheConfig.host_budget_bytes`): keys whose pool and staging pages
would pass it are refused at their first save, before anything is allocated, and the cache
goes on serving the keys it has; by default the budget is this host's memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cachekit import fail_first_pool_allocation, slots_of, small_cache, small_cache_bytes
from omni_pcache import CacheConfig, CachePolicy, ConfigError, InvalidInputError, NewRequest, StepBatch, StepEvents
from omni_pcache.host_memory import cgroup_memory_limit, footprint, host_memory_limit, physical_memory

BS = 4  # (small_cache: 16 blocks of 4 slots, 3 staging pages of 64 rows)


def test_keys_that_each_fit_the_host_but_not_together_are_refused_before_allocating() -> None:
    """Two keys whose pools are each 60% of this host's memory: each would allocate (Linux lends
    more than it has) and the pair be killed for memory once written. The save is refused with a
    `ConfigError` naming both keys and the budget; nothing is allocated, no step id is held, and
    a save of narrower rows is cached as usual."""
    limit = host_memory_limit()
    assert limit is not None and 0 < limit <= physical_memory()
    num_blocks = 1 << 16
    width = int(0.6 * limit) // (num_blocks * BS * 4)  # (float32 rows: 60% of the host per key)
    with small_cache(num_blocks=num_blocks) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        batch = StepBatch(["a"], [4], slots_of([0, 1], 0, 4, BS))
        wide = torch.zeros(4, width)
        with pytest.raises(ConfigError) as err:
            cache.save(wide, {"codes": wide}, batch)
        assert cache.stats().host_budget_bytes == limit
        message = str(err.value)
        assert f"'hidden' rows ({width},) float32" in message and f"'codes' rows ({width},) float32" in message
        assert "past this host's memory (CacheConfig.host_budget_bytes=None)" in message
        stats = cache.stats()
        assert (stats.pool_bytes, stats.staging_bytes, stats.steps_outstanding) == ({}, {}, [])
        hidden, codes = torch.randn(4, 8), torch.arange(4)
        out = cache.materialize(cache.save(hidden, {"codes": codes}, batch), ["a"])
        assert torch.equal(out.hidden["a"], hidden) and torch.equal(out.mm["codes"]["a"], codes)


def test_a_new_key_past_the_budget_leaves_the_cached_keys_serving_hits() -> None:
    """A budget that holds hidden and a wide codes key exactly: a later step that leaves codes
    out and brings a key that needs less than codes holds is still refused (codes' storage is
    held), the error names the new key and what the cache holds, the keys held stay as they
    were, and a hit on the first step's rows still gets them back."""
    budget = small_cache_bytes({"hidden": 16, "codes": 128})
    with small_cache(host_budget_bytes=budget) as cache:
        assert cache.stats().host_budget_bytes == budget
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        a_hidden, a_codes = torch.randn(8, 4), torch.randn(8, 32)
        step = cache.save(a_hidden, {"codes": a_codes}, StepBatch(["a"], [8], slots_of([0, 1], 0, 8, BS)))
        cache.materialize(step, ["a"])
        cache.flush()
        held = cache.stats().pool_bytes
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], num_computed_tokens=4)], finished=["a"]))
        b_batch = StepBatch(["b"], [2], slots_of([0, 2], 4, 2, BS))
        refused = (
            r"past CacheConfig\.host_budget_bytes: .*\. New keys \(pool and staging pages\): 'extra' rows \(\) "
            r"float32: [\d.]+ KiB\. Keys held: 'hidden': [\d.]+ KiB, 'codes': [\d.]+ KiB\. Ledger columns: "
        )
        with pytest.raises(ConfigError, match=refused):
            cache.save(torch.randn(2, 4), {"extra": torch.zeros(2)}, b_batch)
        assert cache.stats().pool_bytes == held and cache.stats().steps_outstanding == []
        b_hidden = torch.randn(2, 4)
        b_codes = torch.randn(2, 32)
        out = cache.materialize(cache.save(b_hidden, {"codes": b_codes}, b_batch), ["b"])
        assert torch.equal(out.hidden["b"], torch.cat([a_hidden[:4], b_hidden]))
        assert torch.equal(out.mm["codes"]["b"], torch.cat([a_codes[:4], b_codes]))


def test_a_deferred_key_is_budgeted_without_staging_pages() -> None:
    """A deferred key's rows stay on the device until its request finishes: it has a pool and
    ledger columns but no staging pages, so a budget of exactly that admits it, and one byte
    less refuses it."""
    policy = CachePolicy(deferred_keys={"feat"})
    exact = small_cache_bytes({"hidden": 8, "feat": 12}, deferred=frozenset({"feat"}))
    for budget, admitted in ((exact, True), (exact - 1, False)):
        with small_cache(policy=policy, host_budget_bytes=budget) as cache:
            cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
            hidden, feat = torch.randn(4, 2), torch.randn(4, 3)
            batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
            if admitted:
                out = cache.materialize(cache.save(hidden, {"feat": feat}, batch), ["a"])
                assert torch.equal(out.hidden["a"], hidden) and torch.equal(out.mm["feat"]["a"], feat)
                assert sorted(cache.stats().pool_bytes) == ["feat", "hidden"]
                assert sorted(cache.stats().staging_bytes) == ["hidden"]
            else:
                with pytest.raises(ConfigError, match=r"'feat' rows \(3,\) float32"):
                    cache.save(hidden, {"feat": feat}, batch)


def test_a_forgotten_keys_ledger_columns_are_reused_not_counted_again() -> None:
    """A save refused after its key registered (its pool's allocation fails once, injected)
    leaves that key's ledger columns to the next new key: a budget of exactly one key's
    storage still admits the retry."""
    with small_cache(host_budget_bytes=small_cache_bytes({"hidden": 8})) as cache:
        calls = fail_first_pool_allocation(cache)
        cache.begin_step(StepEvents(new=[NewRequest("a", [0])]))
        batch = StepBatch(["a"], [4], slots_of([0], 0, 4, BS))
        with pytest.raises(InvalidInputError, match="its host pool cannot be allocated"):
            cache.save(torch.zeros(4, 2), None, batch)
        hidden = torch.randn(4, 2)
        assert torch.equal(cache.materialize(cache.save(hidden, None, batch), ["a"]).hidden["a"], hidden)
        assert calls == ["hidden", "hidden"]


def test_the_budget_must_be_none_or_a_byte_count() -> None:
    for value in (-1, True, 1.5, "1GiB"):
        with pytest.raises(ConfigError, match=f"host_budget_bytes must be None or an int >= 0, got {value!r}"):
            CacheConfig(num_blocks=1, block_size=16, host_budget_bytes=value)
    assert CacheConfig(num_blocks=1, block_size=16, host_budget_bytes=0).host_budget_bytes == 0


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_tightest_limit_of_a_v2_group_and_its_ancestors_is_read(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "self" / "cgroup", "0::/pods/pod1/ctr\n")
    write(root / "pods" / "pod1" / "ctr" / "memory.max", "max\n")  # (no limit of its own)
    write(root / "pods" / "pod1" / "memory.max", f"{8 << 30}\n")
    write(root / "pods" / "memory.max", f"{4 << 30}\n")  # (an ancestor's tighter limit binds too)
    write(root / "memory.max", f"{64 << 30}\n")
    assert cgroup_memory_limit(proc, root) == 4 << 30
    # (a group outside the namespace: neither it nor what its ".." lead to is read)
    write(proc / "self" / "cgroup", "0::/../../other/ctr\n")
    write(root / "memory.max", f"{32 << 30}\n")
    write(tmp_path / "memory.max", f"{1 << 30}\n")
    assert cgroup_memory_limit(proc, root) is None


def test_a_v1_memory_limit_is_read_and_no_limit_reads_none(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "self" / "cgroup", "5:cpu,cpuacct:/ctr\n4:memory:/ctr\n")
    write(root / "memory" / "ctr" / "memory.limit_in_bytes", f"{3 << 30}\n")
    assert cgroup_memory_limit(proc, root) == 3 << 30
    write(root / "memory" / "ctr" / "memory.limit_in_bytes", "max\n")
    assert cgroup_memory_limit(proc, root) is None
    assert cgroup_memory_limit(tmp_path / "no-proc", root) is None, "no /proc: no limit known"


def test_pinned_storage_counts_its_page_locked_size() -> None:
    assert footprint(9 << 30, pinned=True) == 16 << 30
    assert footprint(9 << 30, pinned=False) == 9 << 30
    assert footprint(0, pinned=True) == 0
    assert np.log2(footprint(3000, pinned=True)) == 12
