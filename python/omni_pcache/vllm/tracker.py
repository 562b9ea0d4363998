"""`BlockTracker`: each live request's KV block ids, mirrored from vLLM's SchedulerOutputs alone.

vLLM 0.33's default V2 model runner keeps no block table on the CPU, and the classic V1 runner's
table is runner-internal; both receive the same `SchedulerOutput` each step. Applying those
outputs in order reproduces every request's block list, so the adapter works under both runners
and never reads runner state or device memory. Contract of `BlockTracker.update` (one call per
SchedulerOutput, in order, including steps with zero scheduled tokens):

- ``finished_req_ids`` (finished or aborted) are forgotten first;
- ``preempted_req_ids`` lose their blocks (freed by the scheduler) but stay known until they
  come back or finish;
- each ``scheduled_new_reqs`` entry sets its request's list to ``block_ids[0]``, also when the id
  is already known (V2 sends resumed requests as new ones: the list is replaced); a known id
  that was not preempted is a streaming-input session's next chunk (`continued`);
- each ``scheduled_cached_reqs`` entry appends ``new_block_ids[i][0]`` (``None`` = no new blocks),
  or replaces the list when the id is in ``resumed_req_ids``.

Outputs vLLM drops (`dropped_saves`): ``reset_prefix_cache(reset_running_requests=True)``
preempts every running request with ``drop_stale_output``, so the outputs of the steps still in
flight (async scheduling, pipeline parallelism) never reach the consumer, though the cache
counted their rows as delivered. Only the last ``steps_in_flight - 1`` SchedulerOutputs before
the preemption can be in flight, so the tracker keeps them, with the ids of the steps saved for
them (`saved`), and, at a preemption, the request's spans in them since it last (re)entered.
Two facts tell which outputs were dropped, outputs being processed in order:

- at the preemption, when it is a reset's (the output schedules no running request and admits
  waiting ones, which vLLM never does with a normal preemption), every output from the first
  one not yet taken by ``materialize`` or ``discard`` (``awaited``) on: the scheduler cannot
  have processed an output that was not built. Likewise at a normal preemption while a step
  that was in flight at the request's reset, or when its streaming-input session's turn
  stopped (its next chunk sent as new: `continued`), is still outstanding: vLLM keeps the
  request in drop mode until those outputs are processed;
- at the resume, the request's tokens (``all_token_ids`` for the V1 runner,
  ``prefill_token_ids`` for V2): an output that reached the consumer ended its span with a
  sampled token, so the spans ending at or past the token count were dropped.

The larger count is the request's ``dropped_saves`` entry (the cache's
``StepEvents.dropped_saves``: what those steps returned is delivered again). A normal
preemption's outputs in flight (out of drop mode) are delivered, and vLLM holds its resume
until they are processed, so their tokens are there. Not seen: a dropped prefill chunk that
samples nothing whose output was built before the preempting output reached the runner
(always so with sync scheduling and pipeline parallelism, whose last stage builds each output
at once), or dropped by a reset whose output admits no waiting request.

A ``SchedulerOutput`` carrying ``kv_cache_block_copies`` is refused with `ConfigError` (the
scheduler copies a block's KV for a sub-block hit; the cache does not mirror those copies), as
is one whose KV connector loads KV computed elsewhere into this instance's blocks
(`gate.refuse_kv_loads`: their rows were never saved here), and one naming a running request the
tracker does not hold raises `InvalidInputError`; all before anything changes. `update` returns
an undo: the mixin calls it when the cache refuses the step's events, so a refused step leaves
the tracker as it was. Engine thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from omni_pcache.errors import ConfigError, InvalidInputError
from omni_pcache.validation import as_int
from omni_pcache.vllm.gate import refuse_kv_loads

_SCHEDULER_OUTPUT_FIELDS = ("scheduled_new_reqs", "scheduled_cached_reqs", "finished_req_ids")
"""What `BlockTracker.update` reads of every SchedulerOutput (the rest only where present)."""


def _group0(block_ids: Any, req_id: str) -> list[int] | None:
    """The single KV group's block ids out of vLLM's per-group tuple (``None`` stays ``None``)."""
    if block_ids is None:
        return None
    if not isinstance(block_ids, Sequence) or not all(isinstance(g, Sequence) for g in block_ids):
        raise InvalidInputError(
            f"request {req_id!r}: block ids must be one list of ids per KV-cache group (a tuple of lists), "
            f"got {block_ids!r}"
        )
    if len(block_ids) != 1:
        raise ConfigError(
            f"request {req_id!r} has block ids for {len(block_ids)} KV-cache groups; the cache serves exactly "
            "one full-attention group (see omni_pcache.vllm.cache_config_from_vllm)"
        )
    return list(block_ids[0])


def resumed_ids(cached: Any) -> set[str]:
    """Ids of ``CachedRequestData`` entries whose ``new_block_ids`` replace the block list:
    ``resumed_req_ids`` (vLLM >= 0.11), or the older per-entry ``resumed_from_preemption``."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is not None:
        return set(resumed)
    flags = getattr(cached, "resumed_from_preemption", None) or ()
    return {req_id for req_id, flag in zip(cached.req_ids, flags, strict=False) if flag}


_ABSENT = object()  # (an undo entry's "the request was not known")


def _span_in(scheduler_output: Any, req_id: str) -> tuple[int, int, bool] | None:
    """The positions ``[start, end)`` a SchedulerOutput computes for ``req_id``, and whether it
    (re)enters there (new, or resumed); ``None``: not scheduled in it."""
    so = scheduler_output
    count = so.num_scheduled_tokens.get(req_id)
    if not count:
        return None
    cached = so.scheduled_cached_reqs
    if req_id in cached.req_ids:
        start = cached.num_computed_tokens[cached.req_ids.index(req_id)]
        enters = req_id in resumed_ids(cached)
    else:
        start = next((r.num_computed_tokens for r in so.scheduled_new_reqs if r.req_id == req_id), None)
        if start is None:  # (counted but listed nowhere: nothing to go by)
            return None
        enters = True
    return int(start), int(start) + int(count), enters


def _spans_since_entry(recent: deque[list[Any]], req_id: str) -> list[tuple[int, int, int | None]]:
    """``req_id``'s spans in the ``recent`` ``[SchedulerOutput, step id]`` entries (oldest first)
    since it last (re)entered, with their steps' ids: those of its saves that may still be in
    flight (an earlier one, before a preemption, belongs to what an earlier resume settled)."""
    spans = []
    for past, step_id in reversed(recent):
        found = _span_in(past, req_id)
        if found is not None:
            spans.append((found[0], found[1], step_id))
            if found[2]:
                break
    spans.reverse()
    return spans


def _certainly_dropped(spans: list[tuple[int, int, int | None]], awaited: Callable[[int], bool] | None) -> int:
    """How many of a request's latest ``spans`` preempted by a reset were certainly dropped:
    from the first whose step's output was not taken yet (``awaited``) on, as outputs are
    taken in order (the scheduler cannot have processed an output that was not built)."""
    if awaited is None:
        return 0
    for i, (_, _, step_id) in enumerate(spans):
        if step_id is not None and awaited(step_id):
            return len(spans) - i
    return 0


def _dropped_saves(in_flight: tuple[list[tuple[int, int, int | None]], int], tokens: Sequence[int] | None) -> int:
    """How many of a resumed request's spans possibly in flight at its preemption (oldest
    first, with how many of the latest were certainly dropped) had their outputs dropped: those
    too, and those ending at or past its ``tokens`` at the resume (a delivered output's sampled
    token would be among them), its latest. ``tokens`` ``None``: not known."""
    spans, certain = in_flight
    if tokens is None:
        return certain
    return max(certain, sum(1 for _, end, _ in spans if end >= len(tokens)))


class BlockTracker:
    """Block ids (KV group 0) of every request the scheduler has sent and not yet finished."""

    def __init__(self, steps_in_flight: int = 1) -> None:
        """``steps_in_flight``: the most SchedulerOutputs the engine runs ahead of the outputs it
        has taken (`gate.steps_in_flight`: vLLM's ``max_concurrent_batches``); at 1 (the default)
        no output is ever in flight, so none is dropped. Raises `InvalidInputError` for one
        that is not an int >= 1."""
        steps_in_flight = as_int(steps_in_flight, "steps_in_flight", 1)
        self._blocks: dict[str, list[int] | None] = {}  # None: preempted, blocks freed
        # The last update's new requests that were live and not preempted: a streaming-input
        # session's next chunk (vLLM rewinds such a request to the rows its consumer got).
        self.continued: set[str] = set()
        # The last update's resumed requests whose latest steps' outputs, in flight, vLLM
        # dropped: how many.
        self.dropped_saves: dict[str, int] = {}
        # The SchedulerOutputs that may be in flight at the next update, oldest first, each with
        # the id of the step saved for it (`saved`; None: none yet).
        self._recent: deque[list[Any]] = deque(maxlen=steps_in_flight - 1)
        # Preempted requests' spans (start, end, step id) in the SchedulerOutputs that may have
        # been in flight at their preemption, oldest first, and how many of the latest were
        # certainly dropped.
        self._spans_in_flight: dict[str, tuple[list[tuple[int, int, int | None]], int]] = {}
        # Requests a reset preempted, or whose session turn stopped: the ids of their steps
        # still outstanding then, whose outputs vLLM drops (while one is outstanding, a later
        # preemption drops too).
        self._stale_steps: dict[str, list[int]] = {}

    def saved(self, scheduler_output: Any, step_id: int | None) -> None:
        """Notes the id of the step saved for the last SchedulerOutput applied (the mixin's
        ``pcache_save``), for `update`'s ``awaited``."""
        if self._recent and self._recent[-1][0] is scheduler_output:
            self._recent[-1][1] = step_id

    def update(self, scheduler_output: Any, awaited: Callable[[int], bool] | None = None) -> Callable[[], None]:
        """Applies one SchedulerOutput (see the module doc for the rules). ``awaited(step_id)``:
        whether a saved step's output has not been taken yet (the cache's `PrefixCache.awaited`);
        a reset's preemption then certainly dropped it. Returns a function that undoes the
        update, valid until the next one (what each request had before: the replaced or
        forgotten lists themselves, and each extended list's former length; and `continued`
        as it was)."""
        so = scheduler_output
        missing = [name for name in _SCHEDULER_OUTPUT_FIELDS if not hasattr(so, name)]
        if missing:  # (None, or a runner's own object passed by mistake: a typed error, not AttributeError)
            raise InvalidInputError(
                f"update takes vLLM's SchedulerOutput, got {type(so).__name__} without {', '.join(missing)}"
            )
        if getattr(so, "kv_cache_block_copies", None):
            copies = list(so.kv_cache_block_copies)
            raise ConfigError(
                f"SchedulerOutput.kv_cache_block_copies holds {len(copies)} block copies (first: {copies[0]!r}): "
                "the scheduler matched a prefix inside a block. The cache mirrors whole blocks only; unset "
                "cache_config.prefix_match_unit (sub-block prefix matching) or set enable_prefix_caching=False"
            )
        refuse_kv_loads(so)
        drafts = getattr(so, "scheduled_spec_decode_tokens", None)
        if drafts:  # (a config the gate refuses; this catches what it cannot see, e.g. a diffusion canvas)
            raise ConfigError(
                f"SchedulerOutput.scheduled_spec_decode_tokens holds draft tokens for {len(drafts)} requests: part of "
                "them will be rejected and their positions computed again, and rows saved for rejected positions "
                "would be served as the sequence's; no speculative decoding (or diffusion LM) with "
                "enable_prefix_caching=True"
            )
        cached = so.scheduled_cached_reqs
        resumed = resumed_ids(cached)
        finished = set(so.finished_req_ids or ())
        preempted = set(getattr(so, "preempted_req_ids", None) or ())
        # Check everything before changing anything.
        new_lists = [(req.req_id, _group0(req.block_ids, req.req_id)) for req in so.scheduled_new_reqs]
        lengths = (len(cached.req_ids), len(cached.new_block_ids), len(cached.num_computed_tokens))
        if len(set(lengths)) != 1:
            raise InvalidInputError(
                "SchedulerOutput.scheduled_cached_reqs has {} req_ids, {} new_block_ids and {} "
                "num_computed_tokens: one of each per request".format(*lengths)
            )
        cached_lists = list(zip(cached.req_ids, cached.new_block_ids, strict=True))
        gone = finished | preempted
        get = self._blocks.get
        for req_id, new_ids in cached_lists:
            if new_ids is not None and len(new_ids) != 1:
                _group0(new_ids, req_id)  # raises
            if req_id not in resumed and (get(req_id) is None or req_id in gone):
                if req_id in finished:
                    state = "reported finished in the same output, so unknown"
                else:
                    state = "preempted" if req_id in self._blocks or req_id in preempted else "unknown"
                raise InvalidInputError(
                    f"SchedulerOutput schedules running request {req_id!r}, which is {state} to the tracker: "
                    "every SchedulerOutput must reach pcache_begin_step, in order"
                )
        blocks_of = self._blocks
        continued_before, dropped_before = self.continued, self.dropped_saves
        recent = self._recent
        # (the output this update pushes out of `recent`, put back by the undo)
        dropped_out = recent[0] if recent.maxlen and len(recent) == recent.maxlen else _ABSENT
        spans, stale = self._spans_in_flight, self._stale_steps
        # (only preemptions, finishes and entries of requests they noted, and a session's next
        # chunk, sent as new, change these: a step without any copies nothing)
        touched = (
            (preempted and recent)
            or ((spans or stale) and (finished or resumed or so.scheduled_new_reqs))
            or (so.scheduled_new_reqs and recent)
        )
        spans_before = dict(spans) if touched else None
        stale_before = dict(stale) if touched else None
        if spans_before is not None:
            for req_id in finished:
                spans.pop(req_id, None)
                stale.pop(req_id, None)
            # (a reset's: it preempted every running request, so none is scheduled as running,
            # and waiting ones are admitted, which vLLM never does with a normal preemption)
            reset = bool(so.scheduled_new_reqs or resumed) and resumed.issuperset(cached.req_ids)
            for req_id in preempted - finished:
                in_flight = _spans_since_entry(recent, req_id)
                # vLLM keeps a request in drop mode while the outputs a reset left in flight are
                # not all processed (_preempt_request): a normal preemption then drops too.
                drops = reset or (awaited is not None and any(map(awaited, stale.get(req_id, ()))))
                if drops and awaited is not None:  # (the steps still outstanding: in flight)
                    ids = [*stale.get(req_id, ()), *(step_id for *_, step_id in in_flight if step_id is not None)]
                    if outstanding := [step_id for step_id in ids if awaited(step_id)]:
                        stale[req_id] = outstanding
                    else:
                        stale.pop(req_id, None)
                if in_flight:
                    spans[req_id] = (in_flight, _certainly_dropped(in_flight, awaited) if drops else 0)
        # What each changed request had before, oldest first: (req_id, its entry or _ABSENT) for
        # an entry replaced or removed; (the list, its former length) for a list extended in place.
        replaced: list[tuple[str, Any]] = []
        extended: list[tuple[list[int], int]] = []
        for req_id in finished:
            if req_id in blocks_of:
                replaced.append((req_id, blocks_of.pop(req_id)))
        for req_id in preempted:
            if req_id in blocks_of:
                replaced.append((req_id, blocks_of[req_id]))
                blocks_of[req_id] = None
        continued = set()
        dropped_saves: dict[str, int] = {}
        for req, (req_id, blocks) in zip(so.scheduled_new_reqs, new_lists, strict=True):
            before = blocks_of.get(req_id, _ABSENT)
            if before is not _ABSENT and before is not None:
                continued.add(req_id)
            elif req_id in spans:  # (V2: a preempted request sent again as new)
                in_flight = spans.pop(req_id)
                if before is None and (n := _dropped_saves(in_flight, getattr(req, "prefill_token_ids", None))):
                    dropped_saves[req_id] = n
            replaced.append((req_id, before))
            blocks_of[req_id] = [] if blocks is None else blocks
        # vLLM ends a session's turn in drop mode (_handle_stopped_request): the outputs then in
        # flight are dropped (`StepEvents.dropped` returns their rows), and a preemption before
        # they are all processed drops the outputs in flight at it too, as after a reset's. The
        # request's steps not taken yet are noted as a reset's are (`touched`: the undo puts them back).
        if continued and awaited is not None and recent:
            for req_id in continued:
                ids = [
                    *stale.get(req_id, ()),
                    *(s for past, s in recent if s is not None and past.num_scheduled_tokens.get(req_id)),
                ]
                if outstanding := [step_id for step_id in dict.fromkeys(ids) if awaited(step_id)]:
                    stale[req_id] = outstanding
                else:
                    stale.pop(req_id, None)
        for req_id, new_ids in cached_lists:
            if req_id in resumed:
                replaced.append((req_id, blocks_of.get(req_id, _ABSENT)))
                blocks_of[req_id] = [] if new_ids is None else list(new_ids[0])
                if req_id in spans:
                    tokens = (getattr(cached, "all_token_ids", None) or {}).get(req_id)
                    if n := _dropped_saves(spans.pop(req_id), tokens):
                        dropped_saves[req_id] = n
            elif new_ids is not None and new_ids[0]:
                listed: list[int] = blocks_of[req_id]  # type: ignore[assignment]
                extended.append((listed, len(listed)))
                listed.extend(new_ids[0])

        def undo() -> None:
            # (each change restores what it found: the extended lists themselves cut back, then
            # entries put back newest first, so an entry changed twice ends as it began)
            for listed, length in extended:
                del listed[length:]
            for req_id, before in reversed(replaced):
                if before is _ABSENT:
                    blocks_of.pop(req_id, None)
                else:
                    blocks_of[req_id] = before
            self.continued, self.dropped_saves = continued_before, dropped_before
            if recent.maxlen:
                recent.pop()
                if dropped_out is not _ABSENT:
                    recent.appendleft(dropped_out)
            if spans_before is not None and stale_before is not None:
                spans.clear()
                spans.update(spans_before)
                stale.clear()
                stale.update(stale_before)

        self.continued, self.dropped_saves = continued, dropped_saves
        if recent.maxlen:
            recent.append([so, None])
        return undo

    def blocks(self, req_id: str) -> list[int]:
        """The block ids of a live, not preempted request (the tracker's list: do not modify)."""
        blocks = self._blocks.get(req_id)
        if blocks is None:
            state = "preempted" if req_id in self._blocks else "unknown"
            raise InvalidInputError(f"request {req_id!r} is {state} to the block tracker; it has no blocks")
        return blocks

    def lists(self, req_ids: Sequence[str]) -> list[list[int]]:
        """`blocks` of each of ``req_ids``, in order (one call per step instead of one per request)."""
        get = self._blocks.get
        out = [get(r) for r in req_ids]
        if None in out:
            self.blocks(req_ids[out.index(None)])  # raises, naming the request
        return out  # type: ignore[return-value]

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)
