"""Device→host copies of a step's rows: one copy per key per step, on a side CUDA stream
ordered after the compute stream, or a plain synchronous copy for CPU tensors.

Engine thread: `CopyEngine.start` / `StepCopy.copy` / `StepCopy.snapshot` / `StepCopy.finish`
at save, and `CopyEngine.fence` at the next step's begin (the compute stream waits, on the
device, for last step's copies before the next forward may overwrite their sources).
Committer and materializing threads: `CopyHandle.wait`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pinned_available() -> bool:
    """Pinned host memory needs a CUDA runtime; without one the host side is pageable."""
    return torch.cuda.is_available()


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor, pinned when CUDA is available (so device→host copies are asynchronous)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned_available())


class CopyHandle:
    """Completion of one step's copies. ``wait`` blocks until the host rows are valid;
    a CPU-only step is complete from the start."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())


@dataclass
class StepCopy:
    """The copies of one step, launched in order; `finish` returns their handle."""

    engine: CopyEngine
    _stream: torch.cuda.Stream | None = None
    _device: torch.device | None = None

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._device = device
            self._stream = self.engine.side_stream(device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            self._stream.wait_event(ready)
        elif device != self._device:
            raise ValueError(f"one step's tensors must share one CUDA device ({self._device} vs {device})")
        return self._stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``: asynchronous on the side stream for a CUDA source, else now."""
        if not src.is_cuda:
            dst.copy_(src)
            return
        stream = self._side_stream(src.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        # The caching allocator must not hand src's memory to the compute stream before
        # the side stream has read it.
        src.record_stream(stream)

    def snapshot(self, src: torch.Tensor) -> torch.Tensor:
        """A host copy of ``src`` (valid after the step's handle is waited)."""
        src = src.detach()
        if not src.is_cuda:
            return src.clone()
        dst = empty_host(tuple(src.shape), src.dtype)
        self.copy(dst, src)
        return dst

    def finish(self) -> CopyHandle:
        """Records completion of every copy launched so far."""
        if self._stream is None:
            return CopyHandle(None)
        done = torch.cuda.Event()
        done.record(self._stream)
        self.engine.remember(self._device, done)
        return CopyHandle(done)


class CopyEngine:
    """Owns one side stream per CUDA device and the fence of the last step's copies."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: dict[torch.device, torch.cuda.Event] = {}

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            self._streams[device] = stream
        return stream

    def remember(self, device: torch.device | None, event: torch.cuda.Event) -> None:
        if device is not None:
            self._last[device] = event

    def start(self) -> StepCopy:
        return StepCopy(self)

    def fence(self) -> None:
        """Makes each compute stream wait (on the device, the host does not block) for the last
        step's copies, so the next forward cannot overwrite a buffer still being read."""
        for device, event in self._last.items():
            torch.cuda.current_stream(device).wait_event(event)
        self._last.clear()
