"""A hypothesis state machine driving the native core against a pure-Python model.

Covers write tasks (transitions, queues, escalation, completions), the ledger (claims,
commits, abandons, reads, validation, release), step ids and staging slots. After every rule
the native objects and the model must agree on task states, slot occupancy, versions, reader
counts, outstanding step ids and staging holders; illegal moves must raise the typed error
and change nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from omni_pcache import (
    SOURCE_ABSENT,
    SOURCE_POOL,
    InvalidInputError,
    Ledger,
    StagingSlots,
    StagingTimeoutError,
    StepIdError,
    StepIds,
    TaskStateError,
    WriteTasks,
)

NUM_SLOTS = 12
NUM_KEYS = 2
NUM_STAGING = 3
EDGES = {
    ("PENDING", "QUEUED"),
    ("QUEUED", "COPYING"),
    ("COPYING", "HOST_READY"),
    ("HOST_READY", "WRITTEN"),
}
TERMINAL = {"WRITTEN", "FAILED"}


@dataclass
class TaskModel:
    state: str = "PENDING"
    escalated: bool = False


@dataclass
class ReadModel:
    key: int
    slots: list[int]
    versions: list[int]
    owners: list[int]


@dataclass
class LedgerModel:
    owner: dict[tuple[int, int], int] = field(default_factory=dict)  # SOURCE_* or task id
    version: dict[tuple[int, int], int] = field(default_factory=dict)
    readers: dict[tuple[int, int], int] = field(default_factory=dict)
    claims: dict[int, dict[int, list[tuple[int, int]]]] = field(default_factory=dict)
    # Successful claims and invalidations so far: a claim's slots get the next number as version.
    num_claims: int = 0

    def get(self, slot: int, key: int) -> tuple[int, int, int]:
        k = (slot, key)
        return self.owner.get(k, SOURCE_ABSENT), self.version.get(k, 0), self.readers.get(k, 0)


BLOCK_SIZE = 4  # the ledger's: whole blocks of 4 are summarised, parts of one are per slot
# Scattered slots, or whole blocks of consecutive slots (as an engine hands them out), the last
# one sometimes cut short.
slot_lists = st.one_of(
    st.lists(st.integers(0, NUM_SLOTS - 1), unique=True, max_size=5),
    st.builds(
        lambda blocks, cut: [s for b in blocks for s in range(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)][
            : len(blocks) * BLOCK_SIZE - cut
        ],
        st.lists(st.integers(0, NUM_SLOTS // BLOCK_SIZE - 1), unique=True, min_size=1, max_size=2),
        st.integers(0, BLOCK_SIZE - 1),
    ),
)
# The ledger's rules name tasks by id alone (the ledger keeps no task table of its own): a few
# ids, so claims, steals and commits meet on the same slots.
ledger_tasks = st.integers(0, 3)

# How often each ledger outcome was checked, summed over every run in this process (see
# `test_the_machine_reaches_every_ledger_outcome`).
OUTCOMES = dict.fromkeys(["claimed", "invalidated", "stolen", "preserved", "moved"], 0)


class NativeMachine(RuleBasedStateMachine):
    tasks = Bundle("tasks")
    reads = Bundle("reads")
    steps = Bundle("steps")

    def __init__(self) -> None:
        super().__init__()
        self.write_tasks = WriteTasks()
        self.ledger = Ledger(NUM_SLOTS, BLOCK_SIZE)
        assert [self.ledger.add_key() for _ in range(NUM_KEYS)] == list(range(NUM_KEYS))
        self.step_ids = StepIds()
        self.staging = StagingSlots(NUM_STAGING)
        self.m_tasks: dict[int, TaskModel] = {}
        self.m_lanes: dict[str, deque[int]] = {"escalated": deque(), "high": deque(), "low": deque()}
        self.m_completions: list[int] = []
        self.m_published: set[int] = set()  # tasks whose completion was published
        self.m_ledger = LedgerModel()
        self.m_reads: dict[int, ReadModel] = {}
        self.m_next_step = 0
        self.m_outstanding: set[int] = set()
        self.m_holders: list[list[tuple[str, int]]] = [[] for _ in range(NUM_STAGING)]
        self.m_ring_next = 0

    # ---- write tasks -------------------------------------------------------------------

    @rule(target=tasks)
    def create_task(self) -> int:
        task_id = self.write_tasks.create()
        assert task_id not in self.m_tasks
        self.m_tasks[task_id] = TaskModel()
        return task_id

    def _expect_move(self, task_id: int, to: str, action) -> None:
        model = self.m_tasks[task_id]
        legal = (model.state, to) in EDGES or (to == "FAILED" and model.state not in TERMINAL)
        if legal:
            action()
            model.state = to
        else:
            with pytest.raises(TaskStateError) as err:
                action()
            assert (err.value.task_id, err.value.from_state, err.value.to_state) == (task_id, model.state, to)
            assert f"task#{task_id}" in str(err.value)

    @rule(task_id=tasks, high=st.booleans())
    def enqueue(self, task_id: int, high: bool) -> None:
        before = self.m_tasks[task_id].state
        self._expect_move(task_id, "QUEUED", lambda: self.write_tasks.enqueue(task_id, high))
        if before == "PENDING":
            lane = "escalated" if self.m_tasks[task_id].escalated else ("high" if high else "low")
            self.m_lanes[lane].append(task_id)

    @rule(task_id=tasks)
    def start_copy(self, task_id: int) -> None:
        self._expect_move(task_id, "COPYING", lambda: self.write_tasks.start_copy(task_id))

    @rule(task_id=tasks)
    def copy_done(self, task_id: int) -> None:
        self._expect_move(task_id, "HOST_READY", lambda: self.write_tasks.copy_done(task_id))

    @rule(task_id=tasks)
    def written(self, task_id: int) -> None:
        self._expect_move(task_id, "WRITTEN", lambda: self.write_tasks.written(task_id))

    @rule(task_id=tasks)
    def fail(self, task_id: int) -> None:
        self._expect_move(task_id, "FAILED", lambda: self.write_tasks.fail(task_id))

    @rule(task_id=tasks)
    def escalate(self, task_id: int) -> None:
        model = self.m_tasks[task_id]
        if model.escalated or model.state not in ("PENDING", "QUEUED"):
            expected = "unchanged"
        elif model.state == "QUEUED":
            expected = "moved_to_front"
            self.m_lanes["escalated"].append(task_id)
        else:
            expected = "flagged"
        if expected != "unchanged":
            model.escalated = True
        assert self.write_tasks.escalate(task_id) == expected

    def _model_pop(self) -> int | None:
        """The model's next pop: the first still-QUEUED entry, escalated lane first."""
        for lane in ("escalated", "high", "low"):
            queue = self.m_lanes[lane]
            while queue:
                candidate = queue.popleft()
                if self.m_tasks[candidate].state == "QUEUED":
                    self.m_tasks[candidate].state = "COPYING"
                    return candidate
        return None

    @rule()
    def pop(self) -> None:
        assert self.write_tasks.pop() == self._model_pop()

    @rule(max_tasks=st.integers(0, 4))
    def pop_many(self, max_tasks: int) -> None:
        expected = []
        while len(expected) < max_tasks and (task_id := self._model_pop()) is not None:
            expected.append(task_id)
        assert self.write_tasks.pop_many(max_tasks) == expected

    @rule(task_id=tasks)
    def complete(self, task_id: int) -> None:
        if task_id in self.m_published:  # (a completion is published once: its reader forgets the task)
            with pytest.raises(InvalidInputError, match="already published as complete"):
                self.write_tasks.complete(task_id)
        elif self.m_tasks[task_id].state in TERMINAL:
            self.write_tasks.complete(task_id)
            self.m_completions.append(task_id)
            self.m_published.add(task_id)
        else:
            with pytest.raises(InvalidInputError, match="cannot complete"):
                self.write_tasks.complete(task_id)

    @rule()
    def drain_completions(self) -> None:
        assert self.write_tasks.drain_completions().tolist() == self.m_completions
        self.m_completions.clear()

    # ---- ledger ------------------------------------------------------------------------

    @rule(task_id=ledger_tasks, slots=slot_lists, key=st.integers(0, NUM_KEYS - 1))
    def claim(self, task_id: int, slots: list[int], key: int) -> None:
        self._claim(task_id, slots, key)

    @rule(task_id=ledger_tasks, read_id=reads)
    def claim_what_a_read_captured(self, task_id: int, read_id: int) -> None:
        """A new tenant of slots a pending read captured: the copy-on-write case."""
        read = self.m_reads.get(read_id)
        if read is not None:
            self._claim(task_id, list(dict.fromkeys(read.slots)), read.key)

    @rule(slots=slot_lists, key=st.integers(0, NUM_KEYS - 1))
    def invalidate(self, slots: list[int], key: int) -> None:
        self._claim(None, slots, key)

    @rule(read_id=reads)
    def invalidate_what_a_read_captured(self, read_id: int) -> None:
        read = self.m_reads.get(read_id)
        if read is not None:
            self._claim(None, list(dict.fromkeys(read.slots)), read.key)

    def _claim(self, task_id: int | None, slots: list[int], key: int) -> None:
        """A claim for ``task_id``, or with ``None`` an invalidation (a claim by nobody: the
        slots become absent), checked against the model."""
        if task_id is None:
            out = self.ledger.invalidate(np.array(slots, dtype=np.int64), key)
            me, rows = SOURCE_ABSENT, []
        else:
            out = self.ledger.claim(np.array(slots, dtype=np.int64), key, task_id)
            me, rows = task_id, self.m_ledger.claims.setdefault(task_id, {}).setdefault(key, [])
        stolen, stolen_from, preserve = [], [], []
        self.m_ledger.num_claims += 1
        new_version = self.m_ledger.num_claims
        for slot in slots:
            owner, version, readers = self.m_ledger.get(slot, key)
            other_task = owner >= 0 and owner != me
            if other_task:
                stolen.append(slot)
                stolen_from.append(owner)
            if readers > 0 and (owner == SOURCE_POOL or other_task):
                preserve.append((slot, version, owner))
            self.m_ledger.owner[(slot, key)] = me
            self.m_ledger.version[(slot, key)] = new_version
            self.m_ledger.readers[(slot, key)] = 0
            rows.append((slot, new_version))
        OUTCOMES["preserved"] += len(preserve)
        OUTCOMES["stolen"] += len(stolen)
        OUTCOMES["invalidated" if task_id is None else "claimed"] += len(slots)
        assert out.stolen_slots.tolist() == stolen
        assert out.stolen_from.tolist() == stolen_from
        assert out.preserve_slots.tolist() == [s for s, _, _ in preserve]
        assert out.preserve_versions.tolist() == [v for _, v, _ in preserve]
        assert out.preserve_from.tolist() == [o for _, _, o in preserve]

    def _still_owned(self, task_id: int, key: int, slot: int, version: int) -> bool:
        owner, now, _ = self.m_ledger.get(slot, key)
        return owner == task_id and now == version

    @rule(task_id=ledger_tasks, key=st.integers(0, NUM_KEYS - 1))
    def owned(self, task_id: int, key: int) -> None:
        if task_id not in self.m_ledger.claims:
            with pytest.raises(InvalidInputError, match="unknown task"):
                self.ledger.owned(task_id, key)
            return
        rows = self.m_ledger.claims[task_id].get(key, [])
        expected = [(i, s) for i, (s, v) in enumerate(rows) if self._still_owned(task_id, key, s, v)]
        positions, slots = self.ledger.owned(task_id, key)
        assert list(zip(positions.tolist(), slots.tolist(), strict=True)) == expected

    def _settle(self, task_id: int, to: int, call) -> None:
        if task_id not in self.m_ledger.claims:
            with pytest.raises(InvalidInputError, match=f"unknown task#{task_id}"):
                call(task_id)
            return
        count = 0
        for key, rows in self.m_ledger.claims.pop(task_id).items():
            for slot, version in rows:
                if self._still_owned(task_id, key, slot, version):
                    self.m_ledger.owner[(slot, key)] = to
                    count += 1
        assert call(task_id) == count

    @rule(task_id=ledger_tasks)
    def commit(self, task_id: int) -> None:
        self._settle(task_id, SOURCE_POOL, self.ledger.commit)

    @rule(task_id=ledger_tasks)
    def abandon(self, task_id: int) -> None:
        self._settle(task_id, SOURCE_ABSENT, self.ledger.abandon)

    @rule(
        target=reads,
        slots=st.one_of(st.lists(st.integers(0, NUM_SLOTS - 1), max_size=5), slot_lists),
        key=st.integers(0, 1),
    )
    def plan_read(self, slots: list[int], key: int) -> int:
        plan = self.ledger.plan_read(np.array(slots, dtype=np.int32), key)
        owners, versions = [], []
        for slot in slots:
            owner, version, readers = self.m_ledger.get(slot, key)
            owners.append(owner)
            versions.append(version)
            self.m_ledger.readers[(slot, key)] = readers + 1
        assert plan.sources.tolist() == owners
        assert self.ledger.captured_versions(plan.read_id).tolist() == versions
        assert len(plan) == len(slots)
        self.m_reads[plan.read_id] = ReadModel(key, slots, versions, owners)
        return plan.read_id

    @rule(target=reads, key=st.integers(0, NUM_KEYS - 1))
    def plan_read_of_rows(self, key: int) -> int:
        """A read of slots that hold a row (committed or in transit), as a hit reads them."""
        held = [s for s in range(NUM_SLOTS) if self.m_ledger.get(s, key)[0] != SOURCE_ABSENT][:5]
        return self.plan_read(held, key)

    @rule(read_id=reads)
    def validate(self, read_id: int) -> None:
        read = self.m_reads.get(read_id)
        if read is None:
            with pytest.raises(InvalidInputError, match="never planned, or already released"):
                self.ledger.validate(read_id)
            return
        moved = []
        for i, (slot, version, owner_then) in enumerate(zip(read.slots, read.versions, read.owners, strict=True)):
            owner, now, _ = self.m_ledger.get(slot, read.key)
            if now != version or (owner == SOURCE_ABSENT and owner_then != SOURCE_ABSENT):
                moved.append(i)
        OUTCOMES["moved"] += len(moved)
        assert self.ledger.validate(read_id).tolist() == moved

    @rule(read_id=reads)
    def release(self, read_id: int) -> None:
        read = self.m_reads.pop(read_id, None)
        if read is None:
            with pytest.raises(InvalidInputError):
                self.ledger.release(read_id)
            return
        self.ledger.release(read_id)
        for slot, version in zip(read.slots, read.versions, strict=True):
            _, now, readers = self.m_ledger.get(slot, read.key)
            if now == version:
                self.m_ledger.readers[(slot, read.key)] = max(0, readers - 1)

    # ---- step ids ----------------------------------------------------------------------

    @rule(target=steps)
    def issue_step(self) -> int:
        step_id = self.step_ids.issue()
        assert step_id == self.m_next_step
        self.m_next_step += 1
        self.m_outstanding.add(step_id)
        return step_id

    @rule(step_id=st.one_of(steps, st.integers(0, 40)))
    def consume_step(self, step_id: int) -> None:
        if step_id in self.m_outstanding:
            self.step_ids.consume(step_id)
            self.m_outstanding.remove(step_id)
            return
        with pytest.raises(StepIdError) as err:
            self.step_ids.consume(step_id)
        assert err.value.step_id == step_id
        assert err.value.outstanding == sorted(self.m_outstanding)
        reason = "already consumed" if step_id < self.m_next_step else "never issued"
        assert reason in str(err.value)

    # ---- staging slots -----------------------------------------------------------------

    @rule(kind=st.sampled_from(["step", "task"]), holder_id=st.integers(0, 5))
    def staging_claim(self, kind: str, holder_id: int) -> None:
        free = [
            (self.m_ring_next + i) % NUM_STAGING
            for i in range(NUM_STAGING)
            if not self.m_holders[(self.m_ring_next + i) % NUM_STAGING]
        ]
        if free:
            assert self.staging.claim((kind, holder_id), 0.0) == free[0]
            self.m_holders[free[0]].append((kind, holder_id))
            self.m_ring_next = (free[0] + 1) % NUM_STAGING
        else:
            with pytest.raises(StagingTimeoutError) as err:
                self.staging.claim((kind, holder_id), 0.0)
            assert [sorted(h) for h in err.value.holders] == [sorted(h) for h in self.m_holders]

    @rule(slot=st.integers(0, NUM_STAGING - 1), task_id=st.integers(0, 5))
    def staging_hold(self, slot: int, task_id: int) -> None:
        self.staging.hold(slot, ("task", task_id))
        self.m_holders[slot].append(("task", task_id))

    @rule(slot=st.integers(0, NUM_STAGING - 1), data=st.data())
    def staging_release(self, slot: int, data: st.DataObject) -> None:
        holders = self.m_holders[slot]
        if not holders:
            with pytest.raises(InvalidInputError, match="does not hold"):
                self.staging.release(slot, ("step", 99))
            return
        holder = data.draw(st.sampled_from(holders))
        holders.remove(holder)
        assert self.staging.release(slot, holder) is (not holders)

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def task_states_agree(self) -> None:
        expected = [(t, m.state) for t, m in sorted(self.m_tasks.items())]
        assert self.write_tasks.states() == expected
        for task_id, model in self.m_tasks.items():
            assert self.write_tasks.is_escalated(task_id) is model.escalated

    @invariant()
    def ledger_agrees(self) -> None:
        every_slot = np.arange(NUM_SLOTS, dtype=np.int64)
        for key in range(NUM_KEYS):
            sources, versions = self.ledger.peek(every_slot, key)
            expected = [self.m_ledger.get(s, key) for s in range(NUM_SLOTS)]
            assert sources.tolist() == [o for o, _, _ in expected]
            assert versions.tolist() == [v for _, v, _ in expected]
            assert self.ledger.readers(every_slot, key).tolist() == [r for _, _, r in expected]
        assert self.ledger.num_tasks == len(self.m_ledger.claims)
        assert self.ledger.num_pending_reads == len(self.m_reads)

    @invariant()
    def registries_agree(self) -> None:
        assert self.step_ids.outstanding() == sorted(self.m_outstanding)
        assert [sorted(h) for h in self.staging.holders()] == [sorted(h) for h in self.m_holders]
        assert self.staging.num_free == sum(1 for h in self.m_holders if not h)


TestNativeStateMachine = NativeMachine.TestCase


def test_the_machine_reaches_every_ledger_outcome() -> None:
    # A fixed run of the machine must check each outcome many times, or the comparisons above
    # could pass on empty lists (stolen slots, preserved rows, reads whose rows moved). (100
    # examples reached no moved read when this file ran alone, only after other test files.)
    OUTCOMES.update(dict.fromkeys(OUTCOMES, 0))
    run_state_machine_as_test(
        NativeMachine, settings=settings(max_examples=200, stateful_step_count=50, derandomize=True, database=None)
    )
    assert min(OUTCOMES.values()) >= 10, OUTCOMES
