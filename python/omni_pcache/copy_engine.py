"""Copies of a step's rows into host staging: one copy per key per step, launched at save and
never waited for by the engine thread.

- CUDA source: asynchronous on a side CUDA stream ordered after the compute stream; the next
  step's `CopyEngine.fence` makes the compute stream wait for it on the device.
- CPU source: a `HostCopy`, run once by whichever thread needs the rows first: normally the
  committer (it is woken at the end of save and runs the copy while the engine thread goes
  on), else a materializing thread, else the next `CopyEngine.fence` on the engine thread.
  A source under `INLINE_COPY_BYTES` is copied at once instead: for a small step (decode)
  the copy costs less than handing it to another thread.

Either way the tensors handed to save must stay unchanged until the next `begin_step`
(the fence); the caller may reuse them after it.

Engine thread: `CopyEngine.start` / `StepCopy.copy` / `StepCopy.finish` at save, and
`CopyEngine.fence` at the next step's begin. Committer and materializing threads:
`CopyHandle.wait`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from omni_pcache.errors import InvalidInputError
from omni_pcache.host_memory import footprint, size_text

INLINE_COPY_BYTES = 256 * 1024
"""CPU sources smaller than this are copied inside save; larger ones by the committer."""


def pinned_available() -> bool:
    """Pinned host memory needs a CUDA runtime; without one the host side is pageable."""
    return torch.cuda.is_available()


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor, pinned when CUDA is available (so device→host copies are asynchronous)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned_available())


def held_bytes(tensor: torch.Tensor) -> str:
    """What a host tensor holds, for a log line: its size, and for pinned memory the
    page-locked size torch's caching host allocator rounds it up to (the next power of two;
    kept in torch's cache, not returned to the system, when the tensor is freed)."""
    nbytes = tensor.numel() * tensor.element_size()
    text = size_text(nbytes)
    if tensor.is_pinned() and nbytes > 0:
        locked = footprint(nbytes, pinned=True)
        text += f" (pinned: {size_text(locked)} page-locked)" if locked != nbytes else " (pinned)"
    return text


def host_waited_event(enable_timing: bool = False) -> torch.cuda.Event:
    """An event a host thread waits with ``synchronize``: a blocking one, so the waiting thread
    (the committer, a materializing thread) sleeps instead of spinning a core the engine thread
    may need. Device-side waits (``wait_event``) are the same either way."""
    return torch.cuda.Event(enable_timing=enable_timing, blocking=True)


def host_copy(rows: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``rows``, from any device."""
    if not rows.is_cpu:  # (`is_cpu` and a plain `clone()`: ~2 µs less per key than `device.type`)
        return rows.to("cpu", memory_format=torch.contiguous_format)
    return rows.clone() if rows.is_contiguous() else rows.clone(memory_format=torch.contiguous_format)


class HostCopy:
    """One step's CPU→CPU copies, run exactly once by the first thread that calls `run`; a
    thread calling it meanwhile blocks until they are done (its own lock, held only for
    these copies). torch releases the GIL while copying, so the engine thread goes on."""

    __slots__ = ("_lock", "_pairs")

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._lock = threading.Lock()
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = pairs

    def run(self) -> None:
        if self._pairs is None:  # done (reading a reference is atomic)
            return
        with self._lock:
            if self._pairs is not None:
                for dst, src in self._pairs:
                    dst.copy_(src)
                self._pairs = None  # drops the references to the caller's tensors

    def done(self) -> bool:
        return self._pairs is None


class CopyHandle:
    """Completion of one step's copies. ``wait`` returns once the host rows are valid (running
    the step's CPU copies itself if nobody has yet). Any thread: the event is waited and
    queried with its ``device`` current (the committer and output threads never set one, and a
    CUDA event call on a thread whose current device has no context creates one there: device
    0's, hundreds of MiB, in a worker that owns another GPU)."""

    __slots__ = ("_device", "_event", "_host")

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        host: HostCopy | None = None,
        device: torch.device | None = None,
    ) -> None:
        self._event = event
        self._host = host
        self._device = device

    def wait(self) -> None:
        if self._host is not None:
            self._host.run()
        self.wait_device()

    def wait_device(self) -> None:
        """Waits only the step's device→host copies (not its CPU copies, which a reader of the
        caller's CPU tensors does not need)."""
        if self._event is None:
            return
        if self._device is None:
            self._event.synchronize()
            return
        with torch.cuda.device(self._device):
            self._event.synchronize()

    def done(self) -> bool:
        if self._host is not None and not self._host.done():
            return False
        if self._event is None:
            return True
        if self._device is None:
            return bool(self._event.query())
        with torch.cuda.device(self._device):
            return bool(self._event.query())


@dataclass
class StepCopy:
    """The copies of one step. CPU copies are made now (small) or handed to a `HostCopy`;
    device→host copies are collected and launched back to back by `finish`, on the side stream
    after the compute stream's work so far, so the copy engine is not left idle between one
    key's copy and the next while the host does bookkeeping. `finish` returns their handle."""

    engine: CopyEngine
    _device: torch.device | None = None
    _cuda: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _host: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``: for a CUDA source, at `finish` on the side stream; else a deferred
        host copy (or now, when it is small). Raises `InvalidInputError` for a second CUDA device."""
        if not src.is_cuda:
            if src.numel() * src.element_size() < INLINE_COPY_BYTES:
                dst.copy_(src)
            else:
                self._host.append((dst, src))
            return
        if self._device is None:
            self._device = src.device
        elif src.device != self._device:
            raise InvalidInputError(f"one step's tensors must share one CUDA device ({self._device} vs {src.device})")
        self._cuda.append((dst, src))

    def snapshot(self, src: torch.Tensor) -> torch.Tensor:
        """A host copy of ``src`` (valid after the step's handle is waited; a CPU source is
        cloned now: leftovers are small and handed back as they were)."""
        if src.requires_grad:  # (an engine's outputs never do: no view to make then)
            src = src.detach()
        if not src.is_cuda:
            return src.clone()
        dst = empty_host(tuple(src.shape), src.dtype)
        self.copy(dst, src)
        return dst

    def finish(self) -> CopyHandle:
        """Launches the collected device→host copies and records their completion, with every
        CPU copy handed over so far."""
        host = None
        if self._host:
            host = HostCopy(self._host)
            self._host = []
        if not self._cuda:
            if host is not None:
                self.engine.remember_host(host)
            return CopyHandle(None, host)
        device, pairs, self._cuda = self._device, self._cuda, []
        stream = done = None
        # Every CUDA call is inside the try: one that raises before the copies (a CUDA error)
        # must not leave the CPU copies remembered for the next fence either.
        try:
            stream = self.engine.side_stream(device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            stream.wait_event(ready)
            timing = self.engine.timing
            started = torch.cuda.Event(enable_timing=True) if timing else None
            done = host_waited_event(timing)
            # (the tensors' device current for the context too: leaving a stream context entered
            # from another device sets that device again, and a thread that never set one would
            # get a CUDA context on device 0, as in `deferred._on_device`)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                if started is not None:  # right before the copies, as a raw copy would be timed
                    started.record(stream)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                    # The caching allocator must not hand src's memory to the compute stream before
                    # the side stream has read it (recorded per copy: a later copy may raise).
                    src.record_stream(stream)
            done.record(stream)
        except BaseException:
            # The caller releases the page these copies write into and raises: the copies already
            # launched must land first, and the CPU copies handed over must not run at the next
            # fence, into a page a later step may hold by then.
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.synchronize()
            if host is not None:
                with contextlib.suppress(Exception):
                    host.run()
            raise
        if host is not None:
            self.engine.remember_host(host)
        self.engine.remember(device, done)
        if started is not None:
            self.engine.timed.append((started, done))
        return CopyHandle(done, host, device)


class CopyEngine:
    """Owns one side stream per CUDA device and the fence of the last step's copies.

    ``timing`` (off by default; benchmarks turn it on): each step's device→host copies are
    bracketed by timing events on the side stream, appended to ``timed`` as (start, done) for
    the caller to read with ``start.elapsed_time(done)`` once ``done`` has completed; the
    caller empties the list."""

    def __init__(self) -> None:
        self.timing = False
        self.timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: dict[torch.device, torch.cuda.Event] = {}
        self._last_host: list[HostCopy] = []
        self.epoch = 0  # fences so far: a step's sources are the caller's again once it moves

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[device] = stream
        return stream

    def remember(self, device: torch.device | None, event: torch.cuda.Event) -> None:
        if device is not None:
            self._last[device] = event

    def remember_host(self, host: HostCopy) -> None:
        self._last_host.append(host)

    def start(self) -> StepCopy:
        return StepCopy(self)

    def fence(self) -> None:
        """Makes each compute stream wait (on the device, the host does not block) for the last
        step's copies, and finishes its CPU copies (normally done already by the committer), so
        the next forward cannot overwrite a buffer still being read."""
        for device, event in self._last.items():
            torch.cuda.current_stream(device).wait_event(event)
        self._last.clear()
        for host in self._last_host:
            host.run()
        self._last_host.clear()
        self.epoch += 1
