"""A request of the embedded engine: its tokens, progress and KV blocks.

Output tokens are fixed in advance by the workload (teacher forcing), so a run with prefix
caching and a reference run without it schedule the same tokens whatever tiny numerical
differences their forwards have.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Request:
    """One request: ``prompt`` then up to ``len(outputs)`` generated tokens."""

    req_id: str
    prompt: list[int]
    outputs: list[int]
    arrival_step: int = 0
    abort_step: int | None = None
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_published_blocks: int = 0  # leading blocks of ``blocks`` already published under their hashes
    status: Status = Status.WAITING
    scheduled_before: bool = False
    preempted: bool = False
    num_preemptions: int = 0
    saved_upto: int = 0  # positions [0, saved_upto) covered by its saved steps: what its consumer gets

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def is_done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def full_sequence_len(self) -> int:
        """Positions whose rows the engine produces when the request runs to completion: every
        token but the last generated one (which is never fed back)."""
        return len(self.prompt) + len(self.outputs) - 1
