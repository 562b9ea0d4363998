"""What a write failure does to a cache: the sticky `WriteFailedError` every later call raises,
and the release of everything a failed cache still holds, so no waiter, page or device budget
stays taken (`PrefixCache._on_write_failure`, on the writing thread: the committer, or the
engine thread for a step save wrote itself)."""

from __future__ import annotations

from omni_pcache.errors import InvalidInputError, WriteFailedError
from omni_pcache.steps import release_page_holders


def write_failed_error(task_id: int, exc: BaseException, what: str | None) -> WriteFailedError:
    """The sticky error for task ``task_id``, whose request and step ``what`` names, caused by
    ``exc``; for -1 (a failure outside a write), ``what`` is what failed (None: the committer
    thread itself)."""
    if task_id >= 0:
        failed = f"write task#{task_id} ({what})"
    else:
        failed = "the committer thread" if what is None else what
    err = WriteFailedError(
        f"{failed} failed: {exc!r}; every later call raises this error: close the cache and build a new one"
    )
    err.task_id = task_id
    err.__cause__ = exc
    return err


def release_everything(tasks, ledger, step_records, reader, records, deferred, staging) -> None:
    """After a failure (caller holds the ledger lock): every live task failed and its claims
    dropped, every outstanding step's hit reads and every deferred record's clones released, the
    open deferred records forgotten, and the staging registry closed with every holder released."""
    for task_id, state in tasks.states():
        if state not in ("WRITTEN", "FAILED"):
            tasks.fail(task_id)
        try:
            ledger.abandon(task_id)
        except InvalidInputError:  # (no claim left: committed, or never claimed)
            pass
    for hit_owner in step_records.values():
        for hit in hit_owner.hits.values():
            reader.release(hit)
    for record in records.values():
        if record.deferred:
            record.release()
    deferred.drop_all()
    staging.close()
    release_page_holders(staging)


__all__ = ["release_everything", "write_failed_error"]
