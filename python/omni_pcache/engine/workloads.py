"""Seeded workloads for the embedded engine: who arrives when, with which prompt.

- ``chat``: multi-turn chats; every conversation starts with one of a few system prompts and
  each turn's prompt is the whole conversation so far plus a new user message. A turn's
  generated tokens are the reply the next turn's prompt holds, so later turns hit blocks that
  were filled during decode, one row per step.
- ``fewshot``: a long shared few-shot preamble per task, then a short question.
- ``random``: unrelated random prompts (no sharing; measures overhead).
- ``mixed``: all three interleaved.
Some requests can be aborted at a chosen step (``abort_rate``).
"""

from __future__ import annotations

import random

from omni_pcache.engine.request import Request

WORKLOADS = ("chat", "fewshot", "random", "mixed")
VOCAB = 512


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


Spec = tuple[list[int], int, list[int] | None]
"""A request to make: prompt, max tokens, and the tokens it generates when fixed by the workload."""


def _chat(rng: random.Random, num_requests: int) -> list[Spec]:
    systems = [_tokens(rng, rng.randint(24, 72)) for _ in range(3)]
    out: list[Spec] = []
    while len(out) < num_requests:
        history = list(rng.choice(systems))
        for _ in range(rng.randint(1, 4)):
            history += _tokens(rng, rng.randint(4, 20))
            max_tokens = rng.randint(2, 10)
            reply = _tokens(rng, max_tokens)  # what this turn generates, and the user saw
            out.append((list(history), max_tokens, reply))
            history += reply
            if len(out) == num_requests:
                break
    return out


def _fewshot(rng: random.Random, num_requests: int) -> list[Spec]:
    preambles = [_tokens(rng, rng.randint(60, 120)) for _ in range(2)]
    return [
        (rng.choice(preambles) + _tokens(rng, rng.randint(3, 16)), rng.randint(1, 8), None) for _ in range(num_requests)
    ]


def _random(rng: random.Random, num_requests: int) -> list[Spec]:
    return [(_tokens(rng, rng.randint(8, 80)), rng.randint(1, 10), None) for _ in range(num_requests)]


def make_workload(
    name: str, num_requests: int, seed: int, arrivals_per_step: float = 2.0, abort_rate: float = 0.0
) -> list[Request]:
    """The requests of workload ``name``, with arrival steps and optional aborts."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    rng = random.Random(seed)
    if name == "chat":
        specs = _chat(rng, num_requests)
    elif name == "fewshot":
        specs = _fewshot(rng, num_requests)
    elif name == "random":
        specs = _random(rng, num_requests)
    else:
        thirds = [num_requests // 3, num_requests // 3, num_requests - 2 * (num_requests // 3)]
        specs = _chat(rng, thirds[0]) + _fewshot(rng, thirds[1]) + _random(rng, thirds[2])
        rng.shuffle(specs)
    requests = []
    step = 0.0
    abort_rng = random.Random(seed + 7919)  # separate, so aborts never change the prompts
    for i, (prompt, max_tokens, generated) in enumerate(specs):
        step += rng.expovariate(arrivals_per_step)
        arrival = int(step)
        abort = arrival + abort_rng.randint(0, 6) if abort_rng.random() < abort_rate else None
        drawn = _tokens(rng, max_tokens)  # (drawn for every request: the same stream as before for the rest)
        outputs = drawn if generated is None else generated
        requests.append(Request(f"{name[:2]}{i}", prompt, outputs, arrival_step=arrival, abort_step=abort))
    return requests
