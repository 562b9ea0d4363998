"""`OutputBuffers`: the persistent per-step output buffers of the embedded engine, as a vLLM
runner keeps its own (`EngineConfig.output_device`)."""

from __future__ import annotations

import numpy as np
import torch


class OutputBuffers:
    """Persistent per-step output buffers on one device, as a vLLM runner keeps them, and a
    reused host buffer for the slot ids: each step's rows are copied into the front of the same
    tensors (on the compute stream) and handed to `PrefixCache.save` padded to a multiple of 8
    rows (a CUDA-graph bucket); the next step overwrites them right after its `begin_step`.
    The cache must therefore hold its own copy by then, and, on CUDA, its side-stream copy must
    wait for the fill: each fill first holds the compute stream for a while
    (``torch.cuda._sleep``), then fills the buffers from the device (the host-to-device copies,
    which sync with the host, come before the delay), so nothing syncs between the delay and
    save, and a copy that ran early would read the previous step's rows. Engine thread only."""

    PAD = 8
    DELAY_CYCLES = 2_000_000  # ~1 ms of GPU time per step: longer than save's own host time

    def __init__(self, device: str, capacity: int) -> None:
        self.device = torch.device(device)
        self.capacity = capacity + self.PAD
        self._hidden: torch.Tensor | None = None
        self._proj: torch.Tensor | None = None
        self._slots = np.zeros(self.capacity, dtype=np.int64)

    def fill(
        self, hidden: torch.Tensor, proj: torch.Tensor, leftover: object, slot_mapping: np.ndarray
    ) -> tuple[torch.Tensor, dict, int, np.ndarray]:
        """The step's rows in the buffers: (padded hidden, mm, padded row count, slot ids). The
        slot ids go into a reused host buffer too, as vLLM's slot mapping does."""
        n = hidden.shape[0]
        self._slots[:n] = slot_mapping
        if self._hidden is None:
            self._hidden = torch.zeros((self.capacity, *hidden.shape[1:]), dtype=hidden.dtype, device=self.device)
            self._proj = torch.zeros((self.capacity, *proj.shape[1:]), dtype=proj.dtype, device=self.device)
        assert self._proj is not None
        # (copies from pageable host memory sync the stream with the host: all of them first)
        hidden, proj = hidden.to(self.device), proj.to(self.device)
        if isinstance(leftover, dict):
            leftover = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in leftover.items()}
        if self.device.type == "cuda" and hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(self.DELAY_CYCLES)
        self._hidden[:n].copy_(hidden)  # (on the device: queued behind the delay)
        self._proj[:n].copy_(proj)
        padded = min(n + (-n) % self.PAD, self.capacity)
        self._hidden[n:padded].fill_(float("nan"))  # padding rows: never part of an output
        self._proj[n:padded].fill_(-1)
        return self._hidden[:padded], {"proj": self._proj[:padded], "step_info": leftover}, padded, self._slots[:n]


__all__ = ["OutputBuffers"]
