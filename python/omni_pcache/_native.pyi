"""Type stubs of the native core (``crates/pcache-py``). Index arrays are int64 unless noted;
inputs accept 1-D int64/int32 numpy arrays (or lists of ints) and are borrowed, not copied."""

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__version__: str
SOURCE_ABSENT: int
"""`ReadPlan.sources` code of a slot with no row (never written, or its writer failed)."""
SOURCE_POOL: int
"""`ReadPlan.sources` code of a slot whose row is in the pool."""
HASH_SEED: int
MAX_DROPPED_SAVES: int
"""The most latest saves of one request `StepEvents.dropped_saves` can name."""

TaskStateName = Literal["PENDING", "QUEUED", "COPYING", "HOST_READY", "WRITTEN", "FAILED"]
IndexArray = npt.NDArray[np.int64]
IndexLike = npt.NDArray[np.int64] | npt.NDArray[np.int32] | Sequence[int]
Holder = tuple[Literal["step", "task"], int]

class WriteTasks:
    """Write tasks, their state machine and the copy/completion queues. Any thread.

    PENDING -> QUEUED -> COPYING -> HOST_READY -> WRITTEN, FAILED from any non-terminal state.
    Illegal moves raise `TaskStateError` naming the task and both states; unknown ids raise
    `InvalidInputError`.
    """

    num_queue_entries: int
    def __init__(self) -> None: ...
    def create(self) -> int: ...
    def create_many(self, n: int) -> list[int]: ...
    def enqueue_many(self, task_ids: Sequence[int], high: bool = True) -> None: ...
    def reap_completions(self) -> list[int]: ...
    def state(self, task_id: int) -> TaskStateName: ...
    def is_escalated(self, task_id: int) -> bool: ...
    def enqueue(self, task_id: int, high: bool = True) -> None: ...
    def escalate(self, task_id: int) -> Literal["moved_to_front", "flagged", "unchanged"]: ...
    def pop(self) -> int | None: ...
    def pop_many(self, max: int) -> list[int]: ...
    def start_copy(self, task_id: int) -> None: ...
    def copy_done(self, task_id: int) -> None: ...
    def written(self, task_id: int) -> None: ...
    def copy_done_many(self, task_ids: Sequence[int]) -> None: ...
    def written_many(self, task_ids: Sequence[int]) -> None: ...
    def complete_many(self, task_ids: Sequence[int]) -> None: ...
    def fail(self, task_id: int) -> None: ...
    def complete(self, task_id: int) -> None: ...
    def drain_completions(self) -> IndexArray: ...
    def remove(self, task_id: int) -> None: ...
    def states(self) -> list[tuple[int, TaskStateName]]: ...
    def __len__(self) -> int: ...

class ClaimOutcome:
    """What a claim found."""

    stolen_slots: IndexArray
    """Slots taken from an older in-transit task, which skips them when it writes."""
    stolen_from: IndexArray
    """The task each stolen slot was taken from."""
    preserve_slots: IndexArray
    """Slots a pending read captured that this claim moves on: keep their rows aside."""
    preserve_versions: npt.NDArray[np.uint64]
    """The version each preserved row had (what the read captured)."""
    preserve_from: IndexArray
    """Where each preserved row is now: SOURCE_POOL, or the id of the in-transit task."""

class ReadPlan:
    """A registered pending read."""

    read_id: int
    sources: IndexArray
    """Per slot: SOURCE_ABSENT, SOURCE_POOL or the id of the in-transit task (built at each
    access: a read served from the pool alone keeps nothing per slot)."""
    num_absent: int
    """Slots never written."""
    num_from_pool: int
    """Slots committed in the pool."""
    tasks: list[int]
    """The in-transit task ids among ``sources``, ascending, each once."""
    def __len__(self) -> int: ...

class Ledger:
    """Per (slot, key) occupancy and versions, pending reads, copy-on-write lists. Any thread."""

    num_slots: int
    block_size: int
    num_keys: int
    key_column_bytes: int  # host bytes of one registered key's columns
    num_tasks: int
    num_pending_reads: int
    def __init__(self, num_slots: int, block_size: int = 16) -> None: ...
    def add_key(self) -> int: ...
    def claim(self, slots: IndexLike, key_id: int, task_id: int) -> ClaimOutcome: ...
    def claim_many(
        self, slots: IndexLike, counts: Sequence[int], key_id: int, task_ids: Sequence[int]
    ) -> ClaimOutcome: ...
    def invalidate(self, slots: IndexLike, key_id: int) -> ClaimOutcome:
        """The slots' rows of the key are gone with nothing replacing them (a step that did not
        give the key): a new version, slots absent; reports what a claim would."""
    def owned(self, task_id: int, key_id: int) -> tuple[IndexArray, IndexArray]: ...
    def owned_many(
        self, task_ids: Sequence[int], key_id: int, offsets: Sequence[int]
    ) -> tuple[IndexArray, IndexArray, int]:
        """Owned rows of several tasks, positions shifted by each offset; the last item is the
        first position when they form one contiguous range, else -1."""
    def commit(self, task_id: int) -> int: ...
    def commit_many(self, task_ids: Sequence[int]) -> int: ...
    def abandon(self, task_id: int) -> int: ...
    def peek(self, slots: IndexLike, key_id: int) -> tuple[IndexArray, npt.NDArray[np.uint64]]: ...
    def plan_read(self, slots: IndexLike, key_id: int) -> ReadPlan: ...
    def unvouched(self, read_id: int, versions: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Positions of a pending read whose captured version differs from ``versions`` there
        (a prefetch's vouched versions, 0 where none); ``InvalidInputError`` for another length."""
    def validate(self, read_id: int) -> IndexArray: ...
    def captured_versions(self, read_id: int) -> npt.NDArray[np.uint64]:
        """The version each position of a pending read captured, in its slot order."""
    def release(self, read_id: int) -> None: ...
    def readers(self, slots: IndexLike, key_id: int) -> IndexArray: ...

class StepIds:
    """Exactly-once step ids. Any thread."""

    def __init__(self, first: int = 0) -> None: ...
    def issue(self) -> int: ...
    def consume(self, step_id: int) -> None: ...
    def outstanding(self) -> list[int]: ...
    def __len__(self) -> int: ...

class StagingSlots:
    """The staging-slot ring; a slot is busy while any holder holds it. Any thread."""

    num_free: int
    closed: bool
    def __init__(self, num_slots: int) -> None: ...
    def claim(self, holder: Holder, timeout_s: float = 0.0) -> int: ...
    def try_claim(self, holder: Holder) -> int | None: ...
    def hold(self, slot: int, holder: Holder) -> None: ...
    def hold_many(self, slot: int, kind: Literal["step", "task"], ids: Sequence[int]) -> None: ...
    def release(self, slot: int, holder: Holder) -> bool: ...
    def release_many(self, slot: int, kind: Literal["step", "task"], ids: Sequence[int]) -> bool: ...
    def holders(self) -> list[list[Holder]]: ...
    def close(self) -> None: ...

def block_hashes(
    token_ids: IndexLike,
    block_size: int,
    parent: int | None = None,
    extra_keys: Sequence[bytes | None] | None = None,
) -> npt.NDArray[np.uint64]:
    """Chained block hashes of every full block as a (num_blocks, 2) array of [low, high]."""

def block_table(blocks: IndexLike, num_blocks: int) -> npt.NDArray[np.int64]:
    """``blocks`` (ints) as an int64 array, each checked to be in ``[0, num_blocks)``."""

def block_slots(table: IndexLike, start: int, stop: int, block_size: int) -> npt.NDArray[np.int64]:
    """Slot ids of positions ``[start, stop)`` under a checked int64 block table."""

def scatter_rows(pool: npt.NDArray[np.uint8], rows: npt.NDArray[np.uint8], slots: IndexLike) -> None:
    """Copies row ``i`` of ``rows`` to row ``slots[i]`` of ``pool`` (C-contiguous 2-D uint8
    arrays of the same row width), one copy per run of consecutive slots, without the GIL.
    Raises ``InvalidInputError``, having written nothing, for a slot outside the pool,
    mismatched widths or a non-contiguous array."""

def prefetch_rows(
    ledger: Ledger,
    key_id: int,
    pool: npt.NDArray[np.uint8],
    slots: IndexLike,
    out: npt.NDArray[np.uint8],
    dest: IndexLike,
) -> npt.NDArray[np.uint64]:
    """Copies pool row ``slots[i]`` to row ``dest[i]`` of ``out`` (C-contiguous 2-D uint8 arrays
    of the same row width; one copy per run), without the GIL, and returns per slot the version
    the ledger vouches the copied row for on ``key_id`` (committed at that version before and
    after the copy), else 0. The caller holds the pool writer's lock. Raises
    ``InvalidInputError``, having copied nothing, for an id outside its array, mismatched
    widths or lengths, or arrays it cannot borrow."""

def claim_step(
    tasks: WriteTasks,
    ledger: Ledger,
    staging: StagingSlots,
    page: int,
    slots: IndexLike,
    counts: Sequence[int],
    key_ids: Sequence[int],
) -> tuple[list[int], list[ClaimOutcome | None]]:
    """A step's immediate claims in one call: ``len(counts)`` new PENDING tasks, the step's
    ``slots`` claimed for them on every key (as `Ledger.claim_many`), each task a holder of
    staging page ``page``. Returns the task ids and per key its outcome, ``None`` when the claim
    stole nothing and moved no captured row (caller holds the cache's ledger lock)."""

def close_step_writes(
    tasks: WriteTasks, ledger: Ledger, staging: StagingSlots, page: int, task_ids: Sequence[int]
) -> int:
    """A run of one step's WRITTEN tasks committed, their holds on staging page ``page`` dropped
    and their completions published, in one call (the writer, under the cache's ledger lock,
    when nothing is owed on them). Returns the slots committed."""

def write_step_rows(
    tasks: WriteTasks,
    ledger: Ledger,
    task_ids: Sequence[int],
    offsets: Sequence[int],
    keys: Sequence[tuple[int, npt.NDArray[np.uint8], npt.NDArray[np.uint8]]],
) -> list[int]:
    """A run of one step's COPYING tasks written into the pool (WRITTEN, not committed): per
    ``(key_id, page bytes, pool bytes)``, the rows the tasks still own copied from the staging
    page (task ``i``'s rows from page row ``offsets[i]``) to their slots, without the GIL.
    Returns the rows written per key. Refuses a page/pool that does not fit
    (``InvalidInputError``) before anything changes."""

def write_step_now(
    tasks: WriteTasks,
    ledger: Ledger,
    staging: StagingSlots,
    page: int,
    task_ids: Sequence[int],
    offsets: Sequence[int],
    keys: Sequence[tuple[int, npt.NDArray[Any], npt.NDArray[np.uint8]]],
) -> list[int]:
    """A small step written whole by the thread that saved it (holding the pool writer's lock):
    its PENDING tasks go to COPYING with no queue entry, their owned rows are copied as in
    `write_step_rows` (keeping the GIL), then they are WRITTEN, committed, their holds on
    staging page ``page`` dropped and the tasks dropped from the table without a completion.
    Each key's rows are read from its staging page (uint8 rows) or from any C-contiguous array
    of uint8, int8, int16, int32, int64, float32 or float64 whose dim 0 indexes rows of the
    pool's byte width (the step's own copies, `row_arrays.numpy_rows`). Returns the rows
    written per key; refusals as `write_step_rows`, and an array it cannot read as rows."""

def check_batch(
    req_ids: Iterable[Any], counts: Iterable[Any], slot_mapping: Any, capacity: int, num_slots: int
) -> tuple[int, npt.NDArray[np.int64], dict[Any, tuple[int, int]], list[Any], list[int], list[int]] | None:
    """One step's batch checked: ``(n, slots, rows, claim_req_ids, claim_starts, claim_counts)``
    (the token count; the mapping's first ``n`` slot ids as a new int64 array; each request's
    ``(first row, rows)``; the requests with rows, their first rows and counts, in batch order).
    ``None`` when ``slot_mapping`` is not a 1-D int64/int32 numpy array (pass it again as
    int64). Raises ``InvalidInputError`` for the first problem found, having built nothing."""

class Deliveries:
    """What each live request's consumer has been given (engine thread only): resumed and
    continued requests get each row once, a hit's prefix is read from the pool once."""

    def __init__(self, block_size: int) -> None: ...
    def __len__(self) -> int: ...
    def begin(
        self,
        finished: Iterable[str],
        new: Iterable[Any],
        resumed: Iterable[Any],
        new_type: type,
        resumed_type: type,
        num_blocks: int,
        dropped: dict[str, int],
        dropped_saves: dict[str, int],
        plan_reads: bool,
    ) -> tuple[int, int, list[str], list[tuple[str, npt.NDArray[np.int64], int]]]:
        """A step's events checked, then registered: ``finished`` forgotten, the ``dropped``
        positions of live requests, and what the last ``n`` saves returned for each
        ``dropped_saves`` entry, counted as not delivered, each new and resumed request
        scheduled. Returns ``(hits, misses, reentered, planned)``: the live requests
        scheduled again, and with ``plan_reads`` the pool reads planned for the next save,
        ``(req_id, slots, room)`` (``room``: positions the request's table holds past the read;
        empty without it). Raises
        `InvalidInputError` for the first problem, changing nothing."""
    def take_step(
        self, rows: dict[str, tuple[int, int]]
    ) -> tuple[dict[str, tuple[int, int, int]], dict[str, npt.NDArray[np.int64]]]:
        """A save's ``{req_id: (first_row, count)}`` rows, in batch order: returns
        ``{req_id: (first_row, count, drop)}`` and the pool reads due now, ``{req_id: slots}``."""
