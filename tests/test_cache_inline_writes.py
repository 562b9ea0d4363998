"""A small all-CPU step that save writes to the pool itself: save copies its rows into tensors
of the step's own (not the staging page), writes the pool from them natively (their bytes as
numpy shows them, `row_arrays.numpy_rows`), and materialize hands those copies out when the step has
no hits and is returned whole. These tests pin that the copies are the caller's alone (neither
the caller's buffer nor the pool aliases them), whoever materializes and whenever, that each
dtype's rows reach the pool bit for bit, and the paths that still go through the page."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cachekit import rows, small_cache
from omni_pcache import InvalidInputError, NewRequest, StepBatch, StepEvents, outputs
from omni_pcache.row_arrays import numpy_rows


def counting_output_copies(monkeypatch) -> list[int]:
    """How many rows materialize copied out of the step's rows (its `host_copy` calls)."""
    copied: list[int] = []
    host_copy = outputs.host_copy

    def count(src: torch.Tensor) -> torch.Tensor:
        copied.append(src.shape[0])
        return host_copy(src)

    monkeypatch.setattr(outputs, "host_copy", count)
    return copied


def hit_rows(cache, blocks: list[int], hit: int, slot: int) -> torch.Tensor:
    """A new request over ``blocks`` hitting ``hit`` rows, then one row of its own: the hit rows."""
    cache.begin_step(StepEvents(new=[NewRequest("hit", blocks, hit)]))
    sid = cache.save(rows(9, hit, 1), {}, StepBatch(["hit"], [1], np.array([slot])))
    return cache.materialize(sid, ["hit"]).hidden["hit"][:hit]


def test_a_step_without_hits_hands_out_saves_own_copies_which_alias_neither_the_caller_nor_the_pool(
    monkeypatch,
) -> None:
    copied = counting_output_copies(monkeypatch)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0]), NewRequest("b", [1])]))
        buffer = rows(1, 0, 8)
        saved = buffer.clone()
        sid = cache.save(buffer, {}, StepBatch(["a", "b"], [4, 4], np.arange(8)))
        assert cache.stats().tasks_live == 0, "written to the pool inside save"
        out = cache.materialize(sid, ["a", "b"])
        assert copied == [], "materialize copied nothing: it returned save's own copies"
        assert torch.equal(out.hidden["a"], saved[:4]) and torch.equal(out.hidden["b"], saved[4:])
        buffer.fill_(-1.0)  # the caller's buffer is not the output...
        assert torch.equal(torch.cat([out.hidden["a"], out.hidden["b"]]), saved)
        out.hidden["a"].fill_(-2.0)  # ...and the output is the caller's to write, not the pool
        assert torch.equal(out.hidden["b"], saved[4:]), "each request's rows are its own slice"
        assert torch.equal(hit_rows(cache, [0, 2], 4, 8), saved[:4])


def test_a_step_materialized_after_the_next_begin_step_or_on_another_thread_gets_its_rows(monkeypatch) -> None:
    copied = counting_output_copies(monkeypatch)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2, 3])]))
        buffer = rows(1, 0, 8)
        saved = buffer.clone()
        first = cache.save(buffer, {}, StepBatch(["a"], [8], np.arange(8)))
        second = cache.save(rows(2, 0, 8), {}, StepBatch(["b"], [8], np.arange(8, 16)))
        cache.begin_step(StepEvents())  # the buffer is the caller's again
        buffer.fill_(-1.0)
        got: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: got.append(cache.materialize(second, ["b"]).hidden["b"]))
        thread.start()
        thread.join(10)
        assert torch.equal(cache.materialize(first, ["a"]).hidden["a"], saved)
        assert torch.equal(got[0], rows(2, 0, 8))
        assert copied == [], "both handed out save's own copies"


def test_a_save_refused_after_taking_the_writers_lock_releases_it() -> None:
    """A step save would write itself, refused after save took the pool writer's lock (its
    leftover cannot be copied): the lock is released, so the next step is written inside save
    again and the committer can still write."""
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2, 3])]))
        with pytest.raises(InvalidInputError, match="lock"):
            cache.save(rows(1, 0, 4), {"lock": threading.Lock()}, StepBatch(["a"], [4], np.arange(4)))
        sid = cache.save(rows(1, 0, 4), {}, StepBatch(["a"], [4], np.arange(4)))
        assert cache.stats().tasks_live == 0, "written inside save: the writer's lock was free"
        big = cache.save(torch.zeros(8, 3), {}, StepBatch(["b"], [8], np.arange(8, 16)))  # (as the committer would)
        cache.flush(timeout_s=5)
        cache.discard(big)
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], rows(1, 0, 4))


def test_a_step_with_a_key_too_big_to_copy_in_save_goes_through_the_page(monkeypatch) -> None:
    """Each key's rows must be small enough to copy inside save (`copy_engine.INLINE_COPY_BYTES`),
    whatever `inline_write_bytes` allows: a bigger one is the committer's to copy, as before."""
    copied = counting_output_copies(monkeypatch)
    with small_cache(inline_write_bytes=64 << 20) as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        wide = torch.randn(8, 10_000)  # 320 KB
        sid = cache.save(wide, {}, StepBatch(["a"], [8], np.arange(8)))
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], wide)
        assert copied == [8], "copied out of the page (or the caller's tensor), not handed out"
        # Its page copy was handed over, not done when save returned: save must not write the
        # pool from that page itself (it would write what the page held before), so a hit over
        # a's blocks gets a's rows.
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1, 2], 8)]))
        sid = cache.save(torch.zeros(1, 10_000), {}, StepBatch(["b"], [1], np.array([8])))
        assert torch.equal(cache.materialize(sid, ["b"]).hidden["b"][:8], wide)


def test_a_step_with_hits_copies_its_own_rows_behind_the_hit_rows() -> None:
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        first = rows(1, 0, 8)
        cache.discard(cache.save(first, {}, StepBatch(["a"], [8], np.arange(8))))
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 2], 4), NewRequest("c", [3])]))
        own = rows(2, 4, 6)
        sid = cache.save(own, {}, StepBatch(["b", "c"], [4, 2], np.r_[8:12, 12:14]))
        cache.begin_step(StepEvents())
        out = cache.materialize(sid, ["b", "c"])
        assert torch.equal(out.hidden["b"], torch.cat([first[:4], own[:4]]))
        assert torch.equal(out.hidden["c"], own[4:])


def test_a_step_save_cannot_write_itself_goes_through_the_page_with_the_same_rows() -> None:
    """The committer is writing (save does not wait for the writer's lock): the step is copied
    into its page and queued, as any step the committer writes."""
    with small_cache() as cache:
        entered, gate = threading.Event(), threading.Event()
        write = cache._writer.write_batch
        cache._writer.write_batch = lambda groups: (entered.set(), gate.wait(10), write(groups))
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1]), NewRequest("b", [2, 3])]))
        big = torch.zeros(8, 40_000)  # 1.3 MB, over inline_write_bytes: the committer's
        first = cache.save(big, {}, StepBatch(["a"], [8], np.arange(8)))
        assert entered.wait(10)
        small = rows(2, 0, 1, width=40_000)  # 160 KB: save's to write, but the committer is writing
        sid = cache.save(small, {}, StepBatch(["b"], [1], np.array([8])))
        assert cache.stats().tasks_live == 2, "both queued"
        gate.set()
        cache.flush()
        cache.discard(first)
        assert torch.equal(cache.materialize(sid, ["b"]).hidden["b"], small)


DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
]
SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, as same-width integers (so -0.0 and NaN compare as what they are)."""
    return t.view(SAME_WIDTH_INT[t.element_size()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_row_shape_reaches_the_pool_bit_for_bit(dtype) -> None:
    """Rows written inside save from its own copies (the native write reads their bytes: 16-bit
    floats as int16, bools and 8-bit floats as uint8) come back bit for bit on a hit."""
    if dtype == torch.bool:
        hidden, codes = torch.rand(8, 3) > 0.5, torch.rand(8) > 0.5
    elif dtype.is_floating_point:
        hidden, codes = torch.randn(8, 3).to(dtype), torch.randn(8, 2, 2).to(dtype)
        if dtype.itemsize > 1:  # (signed zeros and NaNs: bits a value comparison would not check)
            hidden[0, :2] = torch.tensor([-0.0, float("nan")], dtype=dtype)
    else:
        hidden = torch.randint(0, 100, (8, 3), dtype=torch.int64).to(dtype)
        codes = torch.randint(0, 100, (8,), dtype=torch.int64).to(dtype)
    assert numpy_rows(hidden) is not None and numpy_rows(codes) is not None, "read as they are, not via the page"
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        cache.discard(cache.save(hidden, {"codes": codes}, StepBatch(["a"], [8], np.arange(8))))
        assert cache.stats().tasks_live == 0, "written inside save"
        cache.begin_step(StepEvents(new=[NewRequest("b", [0, 1, 2], 8)]))
        late = hidden[:1], codes[:1]
        out = cache.materialize(cache.save(late[0], {"codes": late[1]}, StepBatch(["b"], [1], np.array([8]))), ["b"])
        assert torch.equal(bits(out.hidden["b"]), bits(torch.cat([hidden, late[0]])))
        assert torch.equal(bits(out.mm["codes"]["b"]), bits(torch.cat([codes, late[1]])))


def test_padded_strided_and_complex_rows_are_saved_whole() -> None:
    """A padded step (rows past the scheduled ones), a strided tensor (copied contiguous) and
    complex rows (numpy cannot show their bytes: written through the page) all come back."""
    base = rows(1, 0, 10, width=6)
    strided = base[:, ::2]  # every other column: not contiguous; 10 rows, 8 scheduled
    waves = torch.randn(10, 2, dtype=torch.complex64)
    assert numpy_rows(strided) is None and numpy_rows(waves) is None
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        sid = cache.save(strided, {}, StepBatch(["a"], [8], np.arange(8), num_tokens_padded=10))
        assert torch.equal(cache.materialize(sid, ["a"]).hidden["a"], strided[:8])
        cache.begin_step(StepEvents(new=[NewRequest("c", [4, 5])]))
        sid = cache.save(base[:, 1::2], {"waves": waves}, StepBatch(["c"], [8], np.arange(16, 24), 10))
        assert cache.stats().tasks_live == 0, "still written inside save"
        assert torch.equal(cache.materialize(sid, ["c"]).mm["waves"]["c"], waves[:8])
        # (c's rows were read back from the caller's tensors above: a hit reads what reached the pool)
        cache.begin_step(StepEvents(new=[NewRequest("h", [4, 5, 6], 8)]))
        one_wave = torch.zeros(1, 2, dtype=torch.complex64)
        sid = cache.save(rows(9, 8, 1, width=3), {"waves": one_wave}, StepBatch(["h"], [1], np.array([24])))
        out = cache.materialize(sid, ["h"])
        assert torch.equal(out.hidden["h"][:8], base[:8, 1::2]) and torch.equal(out.mm["waves"]["h"][:8], waves[:8])
        assert torch.equal(hit_rows(cache, [0, 1, 2], 8, 8), strided[:8])
        # A dense tensor that is not contiguous (a transpose) comes back as a contiguous copy,
        # as every other step's rows do, not with the caller's strides.
        transposed = torch.arange(24.0).reshape(3, 8).t()
        cache.begin_step(StepEvents(new=[NewRequest("t", [10, 11])]))
        out = cache.materialize(cache.save(transposed, {}, StepBatch(["t"], [8], np.arange(40, 48))), ["t"])
        assert torch.equal(out.hidden["t"], transposed) and out.hidden["t"].is_contiguous()


def test_rows_numpy_refuses_to_show_are_declined_not_raised() -> None:
    # numpy_rows declines (None: the save goes through the page) what tensor.numpy() refuses:
    # rows that need grad, and a contiguous lazily negated view (the imaginary part of a conjugate)
    assert numpy_rows(torch.ones(3, 2, requires_grad=True)) is None
    negated = torch.complex(torch.ones(1, 1), torch.ones(1, 1)).conj().imag
    assert negated.is_neg() and negated.is_contiguous()
    assert numpy_rows(negated) is None
    assert numpy_rows(negated.resolve_neg()).tolist() == [[-1.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool], ids=str)
def test_small_steps_of_dtypes_numpy_has_no_name_for_are_handed_out_without_a_copy(monkeypatch, dtype) -> None:
    # (bf16 rows are read natively as 16-bit ints, bools as bytes: still the step's own copies)
    copied = counting_output_copies(monkeypatch)
    with small_cache() as cache:
        cache.begin_step(StepEvents(new=[NewRequest("a", [0, 1])]))
        h = (torch.arange(16).reshape(8, 2) % 3).to(dtype)
        out = cache.materialize(cache.save(h, {}, StepBatch(["a"], [8], np.arange(8))), ["a"])
        assert torch.equal(out.hidden["a"], h) and copied == []
        assert torch.equal(hit_rows_of(cache, dtype), h[:4])


def hit_rows_of(cache, dtype) -> torch.Tensor:
    """A request hitting block 0 (rows 0-3 of "a"), then one row of its own: the hit rows."""
    cache.begin_step(StepEvents(new=[NewRequest("hit", [0, 2], 4)]))
    sid = cache.save(torch.zeros(1, 2, dtype=dtype), {}, StepBatch(["hit"], [1], np.array([8])))
    return cache.materialize(sid, ["hit"]).hidden["hit"][:4]
