"""How the `PrefixCache` facade's methods are called: weakly, by the cache's own parts and its
committer thread (`weakly`), and with torch's inference mode off (`outside_inference_mode`)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` called through a weak reference to its object (returning what it returns); a
    no-op returning None once that is gone. What the cache's parts and its committer thread
    hold of the cache: no part refers back to it strongly, so a cache nobody holds is freed at
    once (its pool, pages and device clones with it), not at the next cyclic collection."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def outside_inference_mode(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run with torch's inference mode off when the caller has it on (vLLM runs
    ``execute_model`` under ``torch.inference_mode()``): every tensor the cache makes there
    outlives the call or crosses threads — staging pages and the pool (allocated at a key's
    first save), which the committer thread writes in place, and the copies materialize hands
    out, which the caller may write anywhere — and an inference tensor can be written in
    place only inside inference mode, on the thread that has it on. The caller's tensors are
    only read (allowed outside it)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return call


__all__ = ["outside_inference_mode", "weakly"]
