"""Stand-ins for the vLLM 0.33 types the adapter reads, for tests that run without vLLM.

These are NOT vLLM's classes: they are plain dataclasses with vLLM's class names and the field
names, order and defaults of vLLM 0.33.0's ``vllm/v1/core/sched/output.py``
(``NewRequestData``, ``CachedRequestData``, ``SchedulerOutput``), ``vllm/v1/core/kv_cache_utils.py``
(``KVCacheBlockCopy``, a NamedTuple there too), ``vllm/v1/kv_cache_interface.py`` (the KV-cache
specs with vLLM's class hierarchy, ``KVCacheGroupSpec``, ``KVCacheConfig``) and ``vllm/config``
(only the config fields the gate reads). Fields the adapter never reads are kept where they are
required constructor arguments, so the same keyword calls build these and vLLM's real types
(tests/test_vllm_real.py replays the same scenario with the real ones when vLLM is installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

# ---- vllm/v1/core/sched/output.py ---------------------------------------------------------


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int] | None
    mm_features: list[Any]
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: Any
    prompt_embeds: Any = None
    prompt_is_token_ids: list[bool] | None = None
    prefill_token_ids: list[int] | None = None  # V2 model runner only
    replay_start: int = 0


@dataclass
class CachedRequestData:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_token_ids: list[list[int]]
    all_token_ids: dict[str, list[int]]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls([], set(), [], {}, [], [], [])


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    preempted_req_ids: set[str] | None = None
    kv_connector_metadata: Any = None
    new_block_ids_to_zero: list[int] | None = None
    kv_cache_block_copies: list[KVCacheBlockCopy] | None = None


# ---- vllm/v1/core/kv_cache_utils.py -------------------------------------------------------


class KVCacheBlockCopy(NamedTuple):
    src_block_id: int
    dst_block_id: int


# ---- vllm/v1/kv_cache_interface.py --------------------------------------------------------


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 8
    head_size: int = 64
    dtype: Any = "bfloat16"


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    cache_dtype_str: str | None = None


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 128


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int = 128


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    shapes: tuple[tuple[int, ...], ...] = ()
    mamba_cache_mode: str = "none"


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[Any]
    kv_cache_groups: list[KVCacheGroupSpec]
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None


# ---- vllm/config (the fields the gate reads) ----------------------------------------------


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_match_unit: int | None = None
    kv_sharing_fast_prefill: bool = False
    kv_offloading_size: float | None = None


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_kv_consumer(self) -> bool:  # as vLLM's: a connector is set and the role consumes
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    disable_hybrid_kv_cache_manager: bool = False
    async_scheduling: bool | None = None  # (None: vLLM resolves it, on by default)


@dataclass
class ModelConfig:
    max_model_len: int = 4096
    runner_type: str = "generate"
    is_diffusion: bool = False  # (vLLM's is a cached property of the HF config: a canvas_length)
    hidden_size: int = 64
    dtype: Any = "auto"  # (vLLM resolves "auto" to a torch dtype at engine start)

    def get_hidden_size(self) -> int:
        return self.hidden_size


@dataclass
class ParallelConfig:
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size_local: int = 1


@dataclass
class SpeculativeConfig:
    method: str | None = "ngram"
    num_speculative_tokens: int = 3
