"""Drives vLLM 0.33's REAL scheduler step by step through `PrefixCacheRunnerMixin` (CPU, no model).

Used by tests/test_vllm_scheduler.py, which imports it only once vLLM imports. The stage is
vLLM's own: a `VllmConfig` over a tiny local model directory (a ``config.json``, no weights; its
architecture is a stub class registered with vLLM's `ModelRegistry`, so nothing is downloaded
and no model module is imported), a `KVCacheConfig` with one full-attention group, the
scheduler class vLLM picks (`Scheduler`, or `AsyncScheduler` with async scheduling) and vLLM's
block hasher, with prefix caching on.

The "model" is deterministic and causal, as a transformer is: a request's whole token sequence
is a function of its prompt (each sampled token is a digest of the tokens before it, so requests
that share a prefix share its continuation too), and its output row at position ``p`` is
`vllm_replay.hidden_row` of the sequence (a digest of ``tokens[: p + 1]``) plus one per-token mm
key, ``codes`` (``1000 * p + token_p``). So a row served from another request's prefix is the
row this request would have computed, and a row names its position.

`run` is vLLM's engine loop: ``EngineCore.step`` (schedule, execute, sample, update), or with
async scheduling ``EngineCore.step_with_batch_queue`` (step N+1 is scheduled and executed before
step N's output reaches ``update_from_output``; step N's rows are materialized then, one step
late, inline or on an output thread). Requests arrive and are aborted between steps
(``finish_requests``, also while a step computing them is in flight); streaming-input sessions
(resumable requests) get their next input chunks and their end the same way. The runner calls
the mixin where vLLM's V1 GPU runner does, with its rows in its own order (not the
scheduler's), padded like a CUDA graph, and samples like it: a token for every scheduled request
except a partial prefill, from the tokens the runner knows (under async scheduling, ones the
scheduler has not seen yet).

`check_full_sequences` then compares each request's rows, concatenated over its steps as its
consumer got them, with the full-sequence rows of its final tokens.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import queue
import random
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, RSWASpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from omni_pcache import CachePolicy
from omni_pcache.vllm import PrefixCacheRunnerMixin, VllmOmniPrefixCacheMixin
from vllm_replay import digest, full_rows, hidden_row, padded_step

ARCH = "OmniPcacheStubForCausalLM"
VOCAB = 1000


class OmniPcacheStubForCausalLM(nn.Module):
    """A model class that only has to pass vLLM's registry inspection; never instantiated."""

    def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@functools.cache
def model_config() -> ModelConfig:
    """vLLM's ModelConfig of a tiny llama-like model read from a local directory (no weights)."""
    ModelRegistry.register_model(ARCH, OmniPcacheStubForCausalLM)
    path = tempfile.mkdtemp(prefix="omni-pcache-stub-model-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # (vLLM may read it until the end)
    config = {
        "architectures": [ARCH],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return ModelConfig(model=path, tokenizer=path, skip_tokenizer_init=True, max_model_len=2048, dtype="float32")


# ---- the deterministic model -------------------------------------------------------------


def next_token(tokens: list[int]) -> int:
    """The token "sampled" after ``tokens`` (never a special id below 3)."""
    return 3 + digest(tokens) % (VOCAB - 3)


def continuation(prompt: list[int], length: int) -> list[int]:
    """The first ``length`` tokens of the sequence the model produces from ``prompt``."""
    tokens = list(prompt)
    while len(tokens) < length:
        tokens.append(next_token(tokens))
    return tokens[:length]


@dataclass
class Tokens:
    """A request's tokens: its prompt, extended on demand with the model's continuation."""

    tokens: list[int]

    def upto(self, n: int) -> list[int]:
        while len(self.tokens) < n:
            self.tokens.append(next_token(self.tokens))
        return self.tokens[:n]


# ---- the stage ---------------------------------------------------------------------------


@dataclass
class Stage:
    """A real vLLM scheduler and the configs the runner gets."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler: Any
    block_hasher: Any
    queue_size: int  # the engine's batch queue (max_concurrent_batches, under the runner kind's env)

    @property
    def block_size(self) -> int:
        return self.vllm_config.cache_config.block_size


@contextmanager
def _runner_kind(v2: bool) -> Iterator[None]:
    key = "VLLM_USE_V2_MODEL_RUNNER"
    old = os.environ.get(key)
    os.environ[key] = "1" if v2 else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def make_stage(
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 8,
    async_scheduling: bool = False,
    v2: bool = False,
    long_prefill_token_threshold: int = 0,
    pipeline_parallel_size: int = 1,
    rswa_window: int | None = None,
) -> Stage:
    """vLLM's scheduler for a one-group full-attention stage with prefix caching on. ``v2``: the
    scheduler talks to the V2 model runner (it sends resumed requests again as new ones).
    ``rswa_window``: the group's spec is RSWA's (full attention whose manager frees the blocks
    of generated tokens behind that window, writing the null block 0 over them)."""
    mc = model_config()
    with _runner_kind(v2):
        vc = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=mc.max_model_len,
                is_encoder_decoder=False,
                enable_chunked_prefill=True,
                long_prefill_token_threshold=long_prefill_token_threshold,
                async_scheduling=False,
            ),
        )
        # vLLM's CPU platform turns async scheduling off while it validates the config (it has
        # no async executor); the scheduler itself is plain Python, so turn it on as on a GPU.
        vc.scheduler_config.async_scheduling = async_scheduling
        # (likewise pipeline parallelism: only its batch queue matters here, the stage being the
        # last one, which the scheduler's outputs reach as they reach every stage)
        vc.parallel_config.pipeline_parallel_size = pipeline_parallel_size
        assert vc.use_v2_model_runner == v2
        assert vc.cache_config.enable_prefix_caching and vc.cache_config.block_size == block_size
        vc.cache_config.num_gpu_blocks = num_blocks
        shape = {"block_size": block_size, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
        spec = FullAttentionSpec(**shape) if rswa_window is None else RSWASpec(rswa_window=rswa_window, **shape)
        kv = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        queue_size = vc.max_concurrent_batches  # (reads the runner kind from the environment)
        scheduler = vc.scheduler_config.get_scheduler_cls()(
            vllm_config=vc,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=block_size,
            log_stats=True,
        )
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return Stage(vc, kv, scheduler, get_request_block_hasher(block_size, hash_fn), queue_size)


# ---- the runner --------------------------------------------------------------------------


@dataclass
class Counters:
    """What happened in a run, to check that a scenario exercised what it is about."""

    steps: int = 0
    empty_steps: int = 0
    hits: int = 0  # requests first scheduled with num_computed_tokens > 0
    same_step_hits: int = 0  # ... on a block computed in that same step
    first_computed: dict[str, int] = field(default_factory=dict)  # req_id -> its prefix-hit length
    preemptions: int = 0
    stale_preemptions: int = 0  # async: preempted while a step computing it was in flight
    drop_mode_preemptions: int = (
        0  # ... by KV pressure while a reset's or a stopped turn's outputs in flight were not all processed
    )
    resumed_v1: int = 0  # resumed through resumed_req_ids
    resumed_v2: int = 0  # resumed by being sent again as new
    resumed_with_hit: int = 0
    partial_prefills: int = 0  # scheduled prefill chunks that did not reach the end of the tokens
    session_chunks: int = 0  # streaming sessions' next chunks scheduled
    null_block_lists: int = 0  # new requests' block lists holding the null block 0 (RSWA's freed gap)
    dropped_outputs: int = 0  # step outputs update_from_output dropped (drop_stale_output)
    dropped_chunks: int = 0  # ... of more than one position (a prefill chunk)
    resets: int = 0  # reset_prefix_cache(reset_running_requests=True) calls
    in_flight_at_resets: int = 0  # steps in flight at those calls (summed)
    reused_blocks: int = 0  # blocks written by a request other than the one that wrote them before
    max_in_flight: int = 0
    aborted: dict[str, tuple[RequestStatus, int, int]] = field(default_factory=dict)  # status, computed, prompt
    aborted_in_flight: int = 0  # async: aborted while a step computing it was in flight


class Runner(PrefixCacheRunnerMixin):
    """A V1 GPU model runner reduced to its cache hooks, its token bookkeeping and a fake forward."""

    def __init__(self, stage: Stage, seqs: dict[str, Tokens], order_seed: int = 0) -> None:
        self.stage = stage
        self.seqs = seqs
        self.order = random.Random(order_seed)
        self.received: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.known: dict[str, int] = {}  # tokens the runner knows per request (prompt + sampled)
        self.tables: dict[str, list[int]] = {}  # block ids per request (the counters' own copy)
        self.writer: dict[int, str] = {}  # block id -> the request that last wrote it
        self.preempted: set[str] = set()
        self.spans: dict[str, list[tuple[int, int, int]]] = {}  # req_id -> (step number, start, end) per step
        self.dropped: set[tuple[int, str]] = set()  # (step number, req_id) of outputs the scheduler dropped
        self.counters = Counters()
        self.log: list[str] = []
        self.init_cache()

    # The cache's calls, one method each (`OmniHooksRunner` makes them through vLLM-Omni's hooks).

    def init_cache(self) -> None:
        """KV-cache init: the policy, then the gate."""
        c = self.stage.vllm_config
        self.pcache_load_policy(CachePolicy(token_keys=frozenset({"codes"})))
        assert self.pcache_init(
            cache_config=c.cache_config,
            kv_cache_config=self.stage.kv_cache_config,
            kv_transfer_config=c.kv_transfer_config,
            scheduler_config=c.scheduler_config,
            model_config=c.model_config,
            speculative_config=c.speculative_config,
            parallel_config=c.parallel_config,
            is_pooling=False,
            is_last_pipeline_stage=True,
            tensor_parallel_rank=0,
        )

    def begin(self, so: SchedulerOutput) -> None:
        self.pcache_begin_step(so)

    def save(self, hidden: torch.Tensor, mm: dict, so: SchedulerOutput, req_ids: list[str]) -> int | None:
        return self.pcache_save(hidden, mm, so, list(req_ids), num_tokens_padded=hidden.shape[0])

    def materialize(self, step_id: int | None, req_ids: list[str]) -> Any:
        """The step's `StepOutputs` (``.hidden[req]``, ``.mm[key][req]``), ``None`` for ``None``."""
        return self.pcache_materialize(step_id, req_ids)

    @torch.inference_mode()  # (as vLLM's runners run it: save then makes no inference tensors)
    def execute_model(self, so: SchedulerOutput) -> tuple[int | None, list[str], ModelRunnerOutput]:
        """begin_step, forward, save, sample; returns the step id, the row order and the output."""
        self.begin(so)  # first, before the runner drops finished requests
        self.log.append(describe(so))
        self.preempted |= set(so.preempted_req_ids or ())
        self.preempted -= set(so.finished_req_ids)
        kinds = {r.req_id: self._kind(r) for r in so.scheduled_new_reqs}
        computed = self._count(so, kinds)
        for r in so.scheduled_new_reqs:
            if kinds[r.req_id] == "session":
                # A streaming session's next chunk: its prompt is the previous turn's tokens (less
                # the last sampled one) and the new input.
                self.seqs[r.req_id] = Tokens(list(r.prompt_token_ids))
                self.known[r.req_id] = len(r.prompt_token_ids)
            assert r.prompt_token_ids == self.seqs[r.req_id].tokens[: len(r.prompt_token_ids)]
            self.known[r.req_id] = max(self.known.get(r.req_id, 0), len(r.prompt_token_ids))
            self.preempted.discard(r.req_id)
        # A resumed request's tokens are the scheduler's (a real runner takes them from the
        # SchedulerOutput): those of an output vLLM dropped (drop_stale_output) are not among them.
        for req_id in so.scheduled_cached_reqs.resumed_req_ids:
            self.known[req_id] = len(so.scheduled_cached_reqs.all_token_ids[req_id])
        for r in so.scheduled_new_reqs:
            if kinds[r.req_id] == "resumed" and r.prefill_token_ids is not None:
                self.known[r.req_id] = len(r.prefill_token_ids)
        self.preempted -= so.scheduled_cached_reqs.resumed_req_ids
        if so.total_num_scheduled_tokens == 0:
            return None, [], ModelRunnerOutput(req_ids=[], req_id_to_index={})
        req_ids = sorted(so.num_scheduled_tokens)
        self.order.shuffle(req_ids)  # the runner's row order is its own
        rows, codes, sampled = [], [], []
        for req_id in req_ids:
            start, n = computed[req_id], so.num_scheduled_tokens[req_id]
            # (every input token is one the runner knows: the prompt's, or one it sampled)
            assert start + n <= self.known[req_id], f"{req_id}: positions [{start}, {start + n}) past its tokens"
            tokens = self.seqs[req_id].upto(start + n + 1)
            for pos in range(start, start + n):
                rows.append(hidden_row(tokens, pos))
                codes.append(1000 * pos + tokens[pos])
            self.spans.setdefault(req_id, []).append((self.counters.steps, start, start + n))
            if start + n == self.known[req_id]:  # not a partial prefill: sample the next token
                sampled.append([tokens[start + n]])
                self.known[req_id] += 1
            else:
                sampled.append([])
                self.counters.partial_prefills += 1
        hidden, mm = padded_step(rows, codes)
        step_id = self.save(hidden, mm, so, req_ids)
        out = ModelRunnerOutput(
            req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        return step_id, req_ids, out

    def _kind(self, r: Any) -> str:
        """What a ``scheduled_new_reqs`` entry is: a request's ``"first"`` scheduling, a preempted
        request ``"resumed"`` (the V2 runner's way), or a streaming session's next ``"session"``
        chunk (a live request, or a preempted one whose turn ended on a stale output: its prompt
        is no longer the tokens it had)."""
        if r.req_id not in self.known:
            return "first"
        seq = self.seqs[r.req_id].tokens
        if r.req_id in self.preempted and r.prompt_token_ids == seq[: len(r.prompt_token_ids)]:
            return "resumed"
        return "session"

    def computed_upto(self, req_id: str) -> int:
        """The end of the furthest span a forward computed for the request."""
        return max((end for _, _, end in self.spans.get(req_id, ())), default=0)

    def delivered_upto(self, req_id: str) -> int:
        """The end of the furthest span a forward computed for the request whose output the
        scheduler did not drop."""
        return max(
            (end for step, _, end in self.spans.get(req_id, ()) if (step, req_id) not in self.dropped), default=0
        )

    def consume(self, step_id: int | None, req_ids: list[str], dropped: frozenset[str] = frozenset()) -> None:
        """The output builder: the step's full-sequence rows per request (`deliver`)."""
        self.deliver(self.materialize(step_id, req_ids), req_ids, dropped)

    def deliver(self, out: Any, req_ids: list[str], dropped: frozenset[str]) -> None:
        """A step's built outputs reach the consumer, but for ``dropped`` (outputs the
        scheduler drops); ``out`` ``None``: the step ran no forward."""
        if out is None:
            return
        for req_id in req_ids:
            if req_id not in dropped:
                self.received.setdefault(req_id, []).append((out.hidden[req_id], out.mm["codes"][req_id]))

    def start_output_thread(self) -> None:
        """Consumes the step ids handed to `hand_off` on a thread of their own, in order (an
        async output thread)."""
        self._inbox: queue.Queue[tuple[int | None, list[str], frozenset[str], threading.Event] | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._output_worker, name="output-builder", daemon=True)
        self._thread.start()

    def _output_worker(self) -> None:
        while (item := self._inbox.get()) is not None:
            *args, done = item
            try:
                self.consume(*args)
            except BaseException as exc:  # (raised by stop_output_thread)
                self._errors.append(exc)
                return
            finally:
                done.set()

    def hand_off(self, step_id: int | None, req_ids: list[str], dropped: frozenset[str]) -> None:
        """Builds the step's output (materializes it) inline or on the output thread; returns
        once it is built, as vLLM's engine waits for the output it then processes."""
        if getattr(self, "_thread", None) is None:
            self.consume(step_id, req_ids, dropped)
        else:
            done = threading.Event()
            self._inbox.put((step_id, req_ids, dropped, done))
            assert done.wait(60), "the output thread did not build the step's output"

    def stop_output_thread(self, check: bool = True) -> None:
        """Ends the output thread (a no-op when none runs). With ``check`` off (a run already
        failing) it raises nothing, so the run's own error is the one reported and no thread
        is left blocked on its inbox (a soak runs thousands)."""
        if getattr(self, "_thread", None) is not None:
            self._inbox.put(None)
            self._thread.join(timeout=60)
            alive, self._thread = self._thread.is_alive(), None
            if check:
                assert not alive, "the output thread did not finish"
                if self._errors:
                    raise self._errors[0]

    def _count(self, so: SchedulerOutput, kinds: dict[str, str]) -> dict[str, int]:
        """Updates the counters and the runner's own copy of the block tables; returns each
        scheduled request's num_computed_tokens."""
        c = self.counters
        bs = self.stage.block_size
        cached = so.scheduled_cached_reqs
        computed = starts(so)
        tables = self.tables
        for r in so.finished_req_ids:
            tables.pop(r, None)
        for r in so.scheduled_new_reqs:
            tables[r.req_id] = list(r.block_ids[0])
        for r, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if r in cached.resumed_req_ids:
                tables[r] = list(new_ids[0])
            elif new_ids is not None:
                tables[r] += new_ids[0]
        c.steps += 1
        c.empty_steps += so.total_num_scheduled_tokens == 0
        c.preemptions += len(so.preempted_req_ids or ())
        c.resumed_v1 += len(cached.resumed_req_ids)
        c.resumed_with_hit += sum(computed[r] > 0 for r in cached.resumed_req_ids)
        # The blocks this step's forward writes, and whose they were.
        written = set()
        for r, start in computed.items():
            for b in tables[r][start // bs : (start + so.num_scheduled_tokens[r] - 1) // bs + 1]:
                written.add(b)
                c.reused_blocks += self.writer.get(b, r) != r
                self.writer[b] = r
        for r in so.scheduled_new_reqs:
            if kinds[r.req_id] == "resumed":
                c.resumed_v2 += 1
                c.resumed_with_hit += r.num_computed_tokens > 0
            elif kinds[r.req_id] == "session":
                c.session_chunks += 1
                c.null_block_lists += 0 in r.block_ids[0]
            else:
                c.first_computed[r.req_id] = r.num_computed_tokens
                if r.num_computed_tokens:
                    c.hits += 1
                    c.same_step_hits += not written.isdisjoint(r.block_ids[0][: r.num_computed_tokens // bs])
        return computed


class OmniRunnerStandin(Runner):
    """What `VllmOmniPrefixCacheMixin` needs of vLLM-Omni's ``GPUARModelRunner`` (0.30): its
    config attributes, ``input_batch.req_ids`` (the forward's row order), the model's
    ``ModelCachePolicy`` snapshot, and ``initialize_metadata_builders`` staging the stage's cache
    config in ``_omni_prefix_cache_cfg`` (vLLM-Omni's ``PrefixCacheConfig``; any object here)."""

    def init_cache(self) -> None:
        c = self.stage.vllm_config
        self.vllm_config = c
        self.cache_config, self.scheduler_config, self.model_config = c.cache_config, c.scheduler_config, c.model_config
        self.speculative_config, self.parallel_config = c.speculative_config, c.parallel_config
        self.kv_cache_config = self.stage.kv_cache_config
        self.is_pooling_model = False
        self.input_batch = SimpleNamespace(req_ids=[])
        self._omni_cache_policy = SimpleNamespace(needs_full_hidden_states=True, deferred_keys=frozenset())
        self.omni_prefix_cache = None
        self._omni_prefix_cache_cfg = None
        self.initialize_metadata_builders(self.kv_cache_config, [self.stage.block_size])

    def initialize_metadata_builders(self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int]) -> None:
        self._omni_prefix_cache_cfg = ("staged", kv_cache_config.num_blocks)


class OmniHooksRunner(VllmOmniPrefixCacheMixin, OmniRunnerStandin):
    """`Runner` calling the cache where vLLM-Omni's ``GPUARModelRunner`` does, through the hooks
    `VllmOmniPrefixCacheMixin` serves: ``_prefix_cache_step_begin``, ``_prefix_cache_save_step``
    (the row order in ``input_batch.req_ids``), ``_prefix_cache_materialize`` → ``(hidden, mm)``;
    the last pipeline stage's tensor-parallel rank 0 (vLLM's parallel state is not set up here)."""

    def _pcache_parallel_ranks(self) -> tuple[bool, int]:
        return True, 0

    def begin(self, so: SchedulerOutput) -> None:
        self._prefix_cache_step_begin(so)

    def save(self, hidden: torch.Tensor, mm: dict, so: SchedulerOutput, req_ids: list[str]) -> int | None:
        """The rows in ``input_batch.req_ids`` order; ``codes`` as a model emits codebooks, one
        column per codebook (2-D: vLLM-Omni's rule caches only tensors of 2+ dims), and ``spk``,
        a row per request (a speaker embedding), which has a row per token in a step where every
        request has one token (it must never be taken for a key)."""
        self.input_batch.req_ids = list(req_ids)
        mm = {name: value[:, None] for name, value in mm.items()}
        mm["spk"] = torch.arange(len(req_ids), dtype=torch.float32)[:, None].expand(-1, 2)
        return self._prefix_cache_save_step(
            hidden, mm, num_tokens_unpadded=so.total_num_scheduled_tokens, num_tokens_padded=hidden.shape[0]
        )

    def materialize(self, step_id: int | None, req_ids: list[str]) -> Any:
        if step_id is None:
            return None
        hidden, mm = self._prefix_cache_materialize(step_id, req_ids)
        assert set(mm) == {"codes", "spk"} and "spk" not in self.pcache.stats().pool_bytes
        return SimpleNamespace(hidden=hidden, mm={"codes": {req: rows[:, 0] for req, rows in mm["codes"].items()}})


# The runner class `run` uses by default (tests/test_vllm_omni_scheduler.py sets it to
# `OmniHooksRunner` for its copy of tests/test_vllm_scheduler.py's tests).
RUNNER_CLS: type[Runner] = Runner


def starts(so: SchedulerOutput) -> dict[str, int]:
    """num_computed_tokens (before the step) of each request a SchedulerOutput schedules."""
    cached = so.scheduled_cached_reqs
    computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return computed | {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}


def describe(so: SchedulerOutput) -> str:
    """One line per step: what the scheduler sent (for failure messages)."""
    cached = so.scheduled_cached_reqs
    new = [
        f"{r.req_id}@{r.num_computed_tokens}+{so.num_scheduled_tokens[r.req_id]}:{r.block_ids[0]}"
        for r in so.scheduled_new_reqs
    ]
    run = [
        f"{r}{'(resumed)' if r in cached.resumed_req_ids else ''}@{c}+{so.num_scheduled_tokens[r]}:+{b and b[0]}"
        for r, c, b in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True)
    ]
    return (
        f"new={new} cached={run} finished={sorted(so.finished_req_ids)} preempted={sorted(so.preempted_req_ids or ())}"
    )


# ---- the engine loop ---------------------------------------------------------------------


@dataclass
class Req:
    """A request of a scenario: added at engine iteration ``arrival``, aborted (before that
    iteration's schedule) at ``abort_at`` if it has not finished by then."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    arrival: int = 0
    abort_at: int | None = None
    # A streaming-input session (``resumable``): its next input chunks, (tokens, max_tokens,
    # arrival), and the iteration its end (a non-resumable request with the same id) arrives.
    turns: list[tuple[list[int], int, int]] = field(default_factory=list)
    end_at: int | None = None
    stop: int | None = None  # a stop token id (all turns)


@dataclass
class Result:
    runner: Runner
    requests: dict[str, Request]
    seqs: dict[str, Tokens]
    stats: Any

    @property
    def counters(self) -> Counters:
        return self.runner.counters


def run(
    stage: Stage,
    reqs: list[Req],
    *,
    order_seed: int = 0,
    output_thread: bool = False,
    max_iters: int = 5000,
    reset_at: frozenset[int] = frozenset(),
    pause_reset_at: frozenset[int] = frozenset(),
    early_outputs: bool | None = None,
    runner_cls: type[Runner] | None = None,
) -> Result:
    """Runs the requests to completion through vLLM's scheduler and the runner; each step's rows
    are materialized where vLLM's output builder would: inline, or one step late under async
    scheduling (when the step's output is taken for ``update_from_output``), on the engine
    thread or, with ``output_thread``, handed to a thread of their own. At each iteration in
    ``reset_at`` the engine resets the prefix cache with ``reset_running_requests=True``
    (between steps: under async scheduling while steps are in flight); at each iteration in
    ``pause_reset_at`` it does so as ``pause_generation(mode="keep", clear_cache=True)`` does:
    once the steps in flight are done and their outputs taken. With ``early_outputs`` each
    step's output is built (materialized) as soon as its forward is done, as a worker's output
    thread may, not when the engine takes it; by default so without async scheduling (the
    runner builds it in ``sample_tokens``, the engine taking it then or, with pipeline
    parallelism, steps later), and late with it (the engine thread builds it as it takes it).
    ``runner_cls``: `Runner`, or `OmniHooksRunner` (the cache behind vLLM-Omni's hooks); by
    default `RUNNER_CLS`'s."""
    sched = stage.scheduler
    seqs = {r.req_id: Tokens(list(r.prompt)) for r in reqs}
    runner = (runner_cls or RUNNER_CLS)(stage, seqs, order_seed)
    if output_thread:
        runner.start_output_thread()
    c = runner.counters
    requests: dict[str, Request] = {}
    arrivals = sorted(reqs, key=lambda r: r.arrival)
    queue_size = stage.queue_size  # (async: 2; pipeline: its depth, +1 with async and the V2 runner)
    if early_outputs is None:
        early_outputs = not stage.vllm_config.scheduler_config.async_scheduling
    batch_queue: deque[tuple[SchedulerOutput, int, int | None, list[str], ModelRunnerOutput, Any]] = deque()

    def process_oldest() -> None:
        """Takes the oldest step in flight's output for ``update_from_output``, consuming its rows."""
        so, step_no, step_id, req_ids, out, built = batch_queue.pop()
        # Outputs that update_from_output discards, so their consumer never gets them: the
        # stale output of a step in flight when a streaming session's turn ended or the
        # prefix cache was reset with its running requests (drop_stale_output), and any
        # output once a session is aborted. (Every other output is kept, an aborted
        # request's included, and checked.)
        dropped = frozenset(
            r
            for r in req_ids
            if ((q := requests[r]).resumable and q.is_finished())
            or (q.num_stale_output_tokens > 0 and q.drop_stale_output)
        )
        c.dropped_outputs += len(dropped)
        c.dropped_chunks += sum(so.num_scheduled_tokens[r] > 1 for r in dropped)
        runner.dropped |= {(step_no, r) for r in dropped}
        if early_outputs:
            runner.deliver(built, req_ids, dropped)
        else:
            runner.hand_off(step_id, req_ids, dropped)
        sched.update_from_output(so, out)

    try:
        for it in range(max_iters):
            while arrivals and arrivals[0].arrival <= it:
                r = arrivals.pop(0)
                params = SamplingParams(
                    max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0, stop_token_ids=r.stop and [r.stop]
                )
                session = bool(r.turns) or r.end_at is not None
                req = Request(
                    r.req_id,
                    list(r.prompt),
                    params,
                    None,
                    arrival_time=float(it),
                    block_hasher=stage.block_hasher,
                    resumable=session,
                )
                requests[r.req_id] = req
                sched.add_request(req)
            for r in reqs:  # a live session's next input chunk, or its end
                if r.req_id not in sched.requests:
                    continue
                for chunk, max_tokens, arrival in r.turns:
                    if arrival == it:
                        params = SamplingParams(
                            max_tokens=max_tokens, ignore_eos=True, temperature=0.0, stop_token_ids=r.stop and [r.stop]
                        )
                        sched.add_request(
                            Request(r.req_id, list(chunk), params, None, arrival_time=float(it), resumable=True)
                        )
                if r.end_at == it:
                    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
                    sched.add_request(Request(r.req_id, [0], params, None, arrival_time=float(it)))
            aborts = [r.req_id for r in reqs if r.abort_at == it and not requests[r.req_id].is_finished()]
            if aborts:  # (EngineCore: between steps, or while one is in flight under async scheduling)
                in_flight = {r for so, *_ in batch_queue for r in so.num_scheduled_tokens}
                for r in aborts:
                    req = requests[r]
                    c.aborted[r] = (req.status, req.num_computed_tokens, req.num_prompt_tokens)
                c.aborted_in_flight += len(in_flight.intersection(aborts))
                sched.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
            if it in reset_at or it in pause_reset_at:
                if it in pause_reset_at:  # (pause_generation("keep"): idle first)
                    while batch_queue:
                        process_oldest()
                c.resets += 1
                c.in_flight_at_resets += len(batch_queue)
                assert sched.reset_prefix_cache(reset_running_requests=True)
            pending = any(r.end_at is not None and r.end_at > it for r in reqs)
            if not arrivals and not pending and not sched.has_requests() and not batch_queue:
                break
            # EngineCore.step, or step_with_batch_queue under async scheduling
            if sched.has_requests():
                so = sched.schedule()
                c.stale_preemptions += sum(requests[r].num_stale_output_tokens > 0 for r in so.preempted_req_ids or ())
                if it not in reset_at and it not in pause_reset_at:  # (a normal preemption still in drop mode)
                    c.drop_mode_preemptions += sum(
                        requests[r].drop_stale_output and requests[r].num_stale_output_tokens > 0
                        for r in so.preempted_req_ids or ()
                    )
                step_id, req_ids, out = runner.execute_model(so)
                built = runner.materialize(step_id, req_ids) if early_outputs else None
                batch_queue.appendleft((so, c.steps, step_id, req_ids, out, built))
                c.max_in_flight = max(c.max_in_flight, len(batch_queue))
                if len(batch_queue) < queue_size and (so.total_num_scheduled_tokens > 0 or sched.has_requests()):
                    continue
            if not batch_queue:
                continue
            process_oldest()
        else:
            raise AssertionError(f"the run did not finish in {max_iters} iterations (a request larger than the pool?)")
        runner.stop_output_thread()
    finally:
        runner.stop_output_thread(check=False)  # (a run that raised: no thread left behind)
        runner.pcache_shutdown()
    return Result(runner, requests, seqs, runner.pcache_stats())


def check_full_sequences(result: Result) -> dict[str, int]:
    """Each request's rows, concatenated over its steps, are its full-sequence rows for positions
    0..n-1, bit for bit (no gap, no duplicate, nothing past n): n = prompt + max_tokens - 1 for a
    request that ran to max_tokens (its last sampled token is never an input), the end of what
    its forwards computed for an aborted one. The scheduler's tokens are the model's. And the
    cache ends idle: every request finished, every step consumed, every write done. Returns n
    per request."""
    runner = result.runner
    problems = []
    counts = {}
    for req_id, req in result.requests.items():
        seq = result.seqs[req_id]
        count = runner.delivered_upto(req_id)
        # The scheduler's tokens are the model's (all of them for a request that ran to the end;
        # an aborted session may hold an input chunk that never ran).
        tokens = list(req.all_token_ids)
        n = count if req.status == RequestStatus.FINISHED_ABORTED else len(tokens)
        assert tokens[:n] == seq.upto(n), f"{req_id}: the scheduler's tokens {tokens} are not the model's {seq.tokens}"
        if req.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert len(req.output_token_ids) == req.max_tokens, (req_id, len(req.output_token_ids))
            if count != req.num_prompt_tokens + req.max_tokens - 1:
                problems.append(f"{req_id}: computed {count} positions, not prompt + max_tokens - 1")
        else:
            assert req.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED), (req_id, req.status)
        parts = runner.received.get(req_id, [])
        hidden = torch.cat([h for h, _ in parts]) if parts else torch.empty(0, 4, dtype=torch.float64)
        codes = torch.cat([c for _, c in parts]) if parts else torch.empty(0, dtype=torch.int64)
        want_hidden, want_codes = full_rows(seq.upto(count), count)
        if not (torch.equal(hidden, want_hidden) and torch.equal(codes, want_codes)):
            got = [(int(r[0]), int(r[1])) for r in hidden]
            problems.append(f"{req_id}: got (position, token) rows {got}, expected positions 0..{count - 1}")
        counts[req_id] = count
    steps = "\n".join(f"step {i}: {line}" for i, line in enumerate(runner.log))
    assert not problems, "\n".join(problems) + "\nscheduler outputs:\n" + steps
    st = result.stats
    scheduled = sum(1 for r in result.requests if r in runner.known)
    assert st.hits == runner.counters.hits and st.hits + st.misses == scheduled, (st, runner.counters)
    idle = (st.requests_live, st.reads_pending, st.steps_outstanding, st.tasks_live, st.deferred_open)
    assert idle == (0, 0, [], 0, 0), st
    return counts
