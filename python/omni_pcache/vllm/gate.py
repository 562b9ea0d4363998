"""The gate at KV-cache init: which vLLM configurations get a cache, which are refused.

`cache_config_from_vllm` reads vLLM's config objects by attribute only (duck typing, class
names for KV-cache specs), so it works with vLLM's real configs and with plain stand-ins, and
never imports vLLM. Contract:

- ``None`` (no cache, nothing to do) when prefix caching is off or the stage is a pooling one:
  every token is computed, so the engine's own outputs are already the full sequence.
- `ConfigError` naming the option to change when prefix caching is on but the cache could
  return wrong rows; the reason for each refusal is in `REFUSALS`.
- Otherwise a `CacheConfig` sized like the engine's KV cache: ``num_blocks`` and the
  full-attention group's ``block_size``, ``staging_capacity_tokens`` =
  ``scheduler_config.max_num_batched_tokens`` (the most tokens one step can save), and a
  ``staging_depth`` of at least one more than the steps vLLM runs ahead (`steps_in_flight`).
  With several data-parallel replicas on the node (`local_replicas`), each replica's cache
  gets an even share of the host's memory as its ``host_budget_bytes`` unless one is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from omni_pcache.config import CacheConfig
from omni_pcache.errors import ConfigError
from omni_pcache.host_memory import host_memory_limit

REFUSALS: dict[str, str] = {
    "kv_consumer": (
        "a KV connector loads KV computed by another instance into this one's blocks and counts it in "
        "num_computed_tokens; the rows of those tokens were never saved here, so their hits are unservable"
    ),
    "kv_connector": (
        "besides sending KV, this connector may load KV computed elsewhere (an offloading tier, another "
        "instance) into this instance's blocks and count it in num_computed_tokens, whatever its kv_role; the "
        "rows of those tokens were never saved here, so their hits would serve another tenant's rows; only "
        "connectors known to load nothing in the kv_producer role are accepted"
    ),
    "kv_bidirectional": (
        "with bidirectional transfer (kv_connector_extra_config bidirectional_kv_xfer) the decode node sends KV "
        "back, and this prefill node loads it into its own blocks and counts it in num_computed_tokens; the rows "
        "of those tokens were never saved here, so their hits would serve another tenant's rows"
    ),
    "kv_load": (
        "the KV connector is loading KV computed elsewhere into this instance's blocks (a request whose "
        "kv_transfer_params ask for a remote prefill, sent to a prefill node), and vLLM counts it in the "
        "request's num_computed_tokens; the rows of those tokens were never saved here, so its hits would serve "
        "another tenant's rows"
    ),
    "kv_delivery": (
        "a KV-producer connector makes vLLM drop the output of a step still in flight when its request is "
        "preempted (drop_stale_output), which happens when more than one step is in flight (async scheduling, or "
        "pipeline parallelism's batch queue); the cache counts those rows as delivered, so the consumer would "
        "never get them"
    ),
    "speculative": (
        "draft tokens are computed and then partly rejected; rows saved for rejected positions would be "
        "served as if they were the sequence's"
    ),
    "diffusion": (
        "a diffusion LM computes a canvas of tokens per step and rejects part of it (num_computed_tokens moves "
        "back); rows saved for rejected positions would be served as if they were the sequence's"
    ),
    "fast_prefill": (
        "with KV-sharing fast prefill (YOCO models such as Gemma3n) the last layers run only for the rows that "
        "are sampled from, so a prompt row's output depends on where its step's chunk ended: a row saved in one "
        "request's step differs from what another request's cache-off run computes at that position"
    ),
    "kv_groups": (
        "the cache mirrors one full-attention block table; with several KV-cache groups (hybrid models) or "
        "sliding-window/Mamba groups, blocks are dropped or reused while a prefix still hits"
    ),
    "decode_context_parallel": (
        "decode context parallelism shards each block's tokens across ranks; no single rank holds a "
        "request's whole sequence of slots"
    ),
    "prefill_context_parallel": (
        "prefill context parallelism shards each prompt's tokens across ranks; no single rank holds a "
        "request's whole sequence of slots"
    ),
    "sub_block_matching": (
        "prefix hits that end inside a block (and the block copies the scheduler issues for them) are not "
        "mirrored: the cache serves whole blocks only"
    ),
}
"""Why each refused configuration is refused (keyed by refusal, used in the error messages)."""


def _spec_kind(spec: Any) -> str:
    """``"full"`` when ``spec`` is full attention (a ``FullAttentionSpec`` or subclass of it:
    MLA, sink-full, RSWA, hidden-state-cache), else the spec's class name. A
    ``UniformTypeKVCacheSpecs`` (one group, per-layer specs) is full when every layer's is."""
    layer_specs = getattr(spec, "kv_cache_specs", None)
    if isinstance(layer_specs, dict) and layer_specs:
        kinds = {_spec_kind(s) for s in layer_specs.values()}
        return "full" if kinds == {"full"} else ", ".join(sorted(kinds - {"full"}))
    if any(cls.__name__ == "FullAttentionSpec" for cls in type(spec).__mro__):
        return "full"
    return type(spec).__name__


def _layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a ``UniformTypeKVCacheSpecs``, else ``[spec]``."""
    layer_specs = getattr(spec, "kv_cache_specs", None)
    if isinstance(layer_specs, dict) and layer_specs:
        return list(layer_specs.values())
    return [spec]


def _group_change(specs: list[Any]) -> str:
    """What a refused set of KV-cache groups can change: turning the hybrid manager off helps
    only where full-attention layers sit beside sliding-window or chunked-local ones (vLLM then
    keeps the local layers as full attention); any other kind of layer stays as it is."""
    layers = [layer for spec in specs for layer in _layer_specs(spec)]
    full = [layer for layer in layers if _spec_kind(layer) == "full"]
    local = [layer for layer in layers if {c.__name__ for c in type(layer).__mro__} & LOCAL_ATTENTION_SPECS]
    if full and local and len(full) + len(local) == len(layers):
        return (
            "scheduler_config.disable_hybrid_kv_cache_manager=True (--disable-hybrid-kv-cache-manager) so the "
            "sliding-window and chunked-local layers are kept as full attention in one group, or "
            "enable_prefix_caching=False"
        )
    return "enable_prefix_caching=False for this stage (no vLLM option makes these layers one full-attention group)"


def _is_non_causal(kv_cache_config: Any) -> bool:
    """Whether a layer attends non-causally (``non_causal=True`` on its spec): vLLM's engine core
    then turns prefix caching off in its own process, while multiprocess workers, started
    before, still read it as on."""
    for group in getattr(kv_cache_config, "kv_cache_groups", ()):
        spec = group.kv_cache_spec
        if any(getattr(layer, "non_causal", False) is True for layer in [spec, *_layer_specs(spec)]):
            return True
    return False


def kv_loads(scheduler_output: Any) -> dict[str, int]:
    """Requests whose KV the step's connector metadata loads into this instance's blocks, with
    how many blocks: a NIXL connector's ``reqs_to_recv`` entries with local blocks (an entry
    without any only tells the remote to free its blocks). Read by attribute; ``{}`` without a
    connector."""
    metadata = getattr(scheduler_output, "kv_connector_metadata", None)
    receiving = getattr(metadata, "reqs_to_recv", None)
    if not isinstance(receiving, dict):
        return {}
    loads = {}
    for req_id, meta in receiving.items():
        groups = getattr(meta, "local_block_ids", None) or ()  # (vLLM's BlockIds: one list per KV-cache group)
        blocks = sum(len(group) if isinstance(group, list | tuple) else 1 for group in groups)
        if blocks:
            loads[req_id] = blocks
    return loads


def refuse_kv_loads(scheduler_output: Any) -> None:
    """Raises `ConfigError` when the step's KV connector loads KV into this instance's blocks
    (`kv_loads`), before anything of the step is registered: the cache would otherwise serve
    those blocks' earlier rows as the loaded tokens' outputs."""
    loads = kv_loads(scheduler_output)
    if loads:
        shown = ", ".join(f"{req!r} ({n} block{'s' * (n != 1)})" for req, n in sorted(loads.items())[:4])
        more = f" and {len(loads) - 4} more" if len(loads) > 4 else ""
        raise _refuse(
            f"KV loaded by the KV connector (kv_connector_metadata.reqs_to_recv: {shown}{more})",
            "route only requests that compute their prompt here (do_remote_decode) to this kv_producer instance, "
            "or enable_prefix_caching=False",
            "kv_load",
        )


def _spec_block_sizes(spec: Any) -> set[int]:
    layer_specs = getattr(spec, "kv_cache_specs", None)
    if isinstance(layer_specs, dict) and layer_specs:
        return {int(s.block_size) for s in layer_specs.values()}
    return {int(spec.block_size)}


def _is_kv_consumer(kv_transfer_config: Any) -> bool:
    if kv_transfer_config is None:
        return False
    consumer = getattr(kv_transfer_config, "is_kv_consumer", None)
    if isinstance(consumer, bool):  # vLLM's property: a connector is set and the role consumes
        return consumer
    return getattr(kv_transfer_config, "kv_role", None) in ("kv_consumer", "kv_both")


NIXL_PULL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector"})
"""vLLM's pull-based NIXL connector, under both of its names (``NixlConnector`` is an alias)."""

PRODUCER_ONLY_CONNECTORS = NIXL_PULL_CONNECTORS | {"MooncakeConnector"}
"""KV connectors that, in the ``kv_producer`` role (a P/D prefill node), send this instance's KV
and load none into it unless a request asks them to; any other connector is refused
(``REFUSALS["kv_connector"]``). Mooncake's asserts when asked to load in that role; NIXL's pulls
for a request whose ``kv_transfer_params`` ask for a remote prefill (a request routed to the
wrong node), which `kv_loads` finds in the step's connector metadata, and with bidirectional
transfer, which is refused (``REFUSALS["kv_bidirectional"]``)."""

LOCAL_ATTENTION_SPECS = frozenset({"SlidingWindowSpec", "ChunkedLocalAttentionSpec"})
"""KV-cache specs (and their subclasses) that vLLM turns into full attention when the hybrid
manager is off, provided the model has full-attention layers too."""


def steps_in_flight(scheduler_config: Any, parallel_config: Any) -> int:
    """The most SchedulerOutputs vLLM's engine has scheduled before taking their outputs (its
    batch queue, ``VllmConfig.max_concurrent_batches``): the pipeline depth, plus one with async
    scheduling (the V2 runner's count, the larger), and 2 for async scheduling alone."""
    async_scheduling = getattr(scheduler_config, "async_scheduling", None) is not False  # (None: on)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        return pp + async_scheduling
    return 2 if async_scheduling else 1


def _refuse(what: str, change: str, reason: str) -> ConfigError:
    return ConfigError(f"omni_pcache cannot serve {what}: {REFUSALS[reason]}. Change: {change}.")


def hidden_pool_bytes(config: CacheConfig, model_config: Any) -> int | None:
    """The host pool the hidden states will take: a row of the model's hidden size
    (``model_config.get_hidden_size()``) in its dtype per KV slot; ``None`` where the model
    config does not say (no model config, a dtype not yet resolved)."""
    get_hidden_size = getattr(model_config, "get_hidden_size", None)
    dtype = getattr(model_config, "dtype", None)
    if get_hidden_size is None or not isinstance(dtype, torch.dtype):
        return None
    return config.num_slots * int(get_hidden_size()) * dtype.itemsize


def local_replicas(parallel_config: Any) -> int:
    """The data-parallel replicas vLLM runs on this node (``data_parallel_size_local``; its 0,
    data parallelism launched from outside, and a config without the field count as one)."""
    return max(1, int(getattr(parallel_config, "data_parallel_size_local", 1) or 1))


def cache_config_from_vllm(
    *,
    cache_config: Any,
    kv_cache_config: Any,
    kv_transfer_config: Any,
    scheduler_config: Any,
    model_config: Any,
    speculative_config: Any,
    parallel_config: Any,
    is_pooling: bool,
    kernel_block_sizes: Sequence[int] | None = None,
    **cache_options: Any,
) -> CacheConfig | None:
    """The `CacheConfig` for one vLLM stage, ``None`` when it needs no cache; raises
    `ConfigError` for configurations the cache cannot serve (see the module doc).

    Arguments are vLLM's ``CacheConfig``, ``KVCacheConfig`` (``num_blocks``,
    ``kv_cache_groups[*].kv_cache_spec``), ``KVTransferConfig`` or None, ``SchedulerConfig``,
    ``ModelConfig`` (``runner_type``; may be None), ``SpeculativeConfig`` or None,
    ``ParallelConfig``, and whether the stage pools. ``kernel_block_sizes`` (the runner's, as
    earlier versions asked for) is accepted and not needed: an attention backend that splits
    each KV block into kernel blocks changes only its own block table, while the cache
    addresses rows by the scheduler's blocks, whose slot numbers kernel blocks share
    (kernel block ``b * k + j`` of size ``B / k`` starts at slot ``b * B + j * B / k``).
    ``cache_options`` are passed on to `CacheConfig` (``staging_depth``, ``claim_timeout_s``...;
    ``staging_capacity_tokens`` may raise the scheduler's step size, never lower it; the block
    geometry is vLLM's).
    """
    if not getattr(cache_config, "enable_prefix_caching", False):
        return None
    if is_pooling or getattr(model_config, "runner_type", None) == "pooling":
        return None
    if _is_non_causal(kv_cache_config):  # (vLLM's scheduler never hits: every token is computed)
        return None

    offloading = getattr(cache_config, "kv_offloading_size", None)
    if offloading is not None:  # (vLLM makes it an offloading connector in the kv_both role)
        raise _refuse(
            f"KV offloading (cache_config.kv_offloading_size={offloading!r}, which adds an offloading KV connector)",
            "unset cache_config.kv_offloading_size (no --kv-offloading-size), or enable_prefix_caching=False",
            "kv_connector",
        )

    if _is_kv_consumer(kv_transfer_config):
        role = getattr(kv_transfer_config, "kv_role", None)
        raise _refuse(
            f"a KV-consumer stage (kv_transfer_config.kv_role={role!r})",
            "set kv_transfer_config.kv_role='kv_producer' (or no KV connector), or enable_prefix_caching=False",
            "kv_consumer",
        )
    connector = None if kv_transfer_config is None else getattr(kv_transfer_config, "kv_connector", None)
    if connector is not None:
        if connector not in PRODUCER_ONLY_CONNECTORS:
            raise _refuse(
                f"KV connector {connector!r} (kv_transfer_config.kv_connector)",
                f"no KV connector, or one of {sorted(PRODUCER_ONLY_CONNECTORS)} as kv_producer, or "
                "enable_prefix_caching=False",
                "kv_connector",
            )
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None)
        if connector in NIXL_PULL_CONNECTORS and isinstance(extra, dict) and extra.get("bidirectional_kv_xfer"):
            raise _refuse(
                f"KV connector {connector!r} with bidirectional transfer (kv_connector_extra_config "
                f"bidirectional_kv_xfer={extra['bidirectional_kv_xfer']!r})",
                "drop bidirectional_kv_xfer from kv_connector_extra_config, or enable_prefix_caching=False",
                "kv_bidirectional",
            )
        async_scheduling = getattr(scheduler_config, "async_scheduling", None)
        pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
        if steps_in_flight(scheduler_config, parallel_config) > 1:
            raise _refuse(
                f"KV connector {connector!r} with more than one step in flight "
                f"(scheduler_config.async_scheduling={async_scheduling!r}, pipeline_parallel_size={pp})",
                "scheduler_config.async_scheduling=False (--no-async-scheduling) and pipeline_parallel_size=1, or "
                "no KV connector, or enable_prefix_caching=False",
                "kv_delivery",
            )
    if getattr(model_config, "is_diffusion", False) is True:
        raise _refuse(
            "a diffusion LM (model_config.is_diffusion)",
            "enable_prefix_caching=False for this stage",
            "diffusion",
        )
    if speculative_config is not None:
        method = getattr(speculative_config, "method", None)
        raise _refuse(
            f"speculative decoding (speculative_config, method={method!r})",
            "drop speculative_config (no --speculative-config), or enable_prefix_caching=False",
            "speculative",
        )

    if getattr(cache_config, "kv_sharing_fast_prefill", False) is True:
        raise _refuse(
            "KV-sharing fast prefill (cache_config.kv_sharing_fast_prefill=True)",
            "cache_config.kv_sharing_fast_prefill=False (no --kv-sharing-fast-prefill), or enable_prefix_caching=False",
            "fast_prefill",
        )

    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()))
    if len(groups) != 1:
        kinds = [_spec_kind(g.kv_cache_spec) for g in groups]
        raise _refuse(
            f"{len(groups)} KV-cache groups (kv_cache_config.kv_cache_groups: {kinds})",
            _group_change([g.kv_cache_spec for g in groups]),
            "kv_groups",
        )
    spec = groups[0].kv_cache_spec
    kind = _spec_kind(spec)
    if kind != "full":
        raise _refuse(
            f"a KV-cache group that is not full attention (kv_cache_config.kv_cache_groups[0] is {kind})",
            _group_change([spec]),
            "kv_groups",
        )

    dcp = int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        kind = "decode" if dcp > 1 else "prefill"
        name, value = f"{kind}_context_parallel_size", dcp if dcp > 1 else pcp
        raise _refuse(
            f"context parallelism (parallel_config.{name}={value})",
            f"parallel_config.{name}=1, or enable_prefix_caching=False",
            f"{kind}_context_parallel",
        )

    sizes = _spec_block_sizes(spec)
    if len(sizes) != 1:
        raise _refuse(
            f"layers with different block sizes in one KV-cache group ({sorted(sizes)})",
            "one cache_config.block_size (--block-size) for every layer, or enable_prefix_caching=False",
            "kv_groups",
        )
    block_size = sizes.pop()

    # Sub-block prefix matching: hashes (and so hits) finer than a block.
    for owner, obj in (("cache_config", cache_config), ("kv_cache_config", kv_cache_config)):
        for name in ("prefix_match_unit", "hash_block_size", "cache_hit_alignment_tokens"):
            value = getattr(obj, name, None)
            if value is None or not int(value) % block_size:
                continue
            raise _refuse(
                f"sub-block prefix matching ({owner}.{name}={int(value)} with block size {block_size})",
                f"unset cache_config.prefix_match_unit (or set it to {block_size}), or enable_prefix_caching=False",
                "sub_block_matching",
            )

    max_tokens = getattr(scheduler_config, "max_num_batched_tokens", None)
    if max_tokens is None:
        raise ConfigError("scheduler_config.max_num_batched_tokens is not set; the cache sizes staging from it")
    from_vllm = sorted(cache_options.keys() & {"num_blocks", "block_size"})
    if from_vllm:
        raise ConfigError(
            f"cache options {from_vllm} are set from vLLM's KV cache config (the cache mirrors its blocks); drop them"
        )
    options = {f.name for f in dataclasses.fields(CacheConfig) if f.init} - {"num_blocks", "block_size"}
    unknown = sorted(cache_options.keys() - options)
    if unknown:
        raise ConfigError(f"unknown cache options {unknown}; the cache takes {sorted(options)}")
    staging = cache_options.pop("staging_capacity_tokens", int(max_tokens))
    if not isinstance(staging, int) or staging < int(max_tokens):
        raise ConfigError(
            f"staging_capacity_tokens={staging!r} must hold a whole step: at least "
            f"scheduler_config.max_num_batched_tokens={int(max_tokens)}"
        )
    # (every step vLLM runs ahead holds a staging page until its output is built: with a deep
    # batch queue the default depth would make a save wait for one)
    default_depth = next(f.default for f in dataclasses.fields(CacheConfig) if f.name == "staging_depth")
    cache_options.setdefault(
        "staging_depth", max(default_depth, steps_in_flight(scheduler_config, parallel_config) + 1)
    )
    # (each data-parallel replica on this node builds a cache of its own, all of the same size:
    # by default they share the host's memory, so together they cannot pass it)
    replicas = local_replicas(parallel_config)
    if replicas > 1 and cache_options.get("host_budget_bytes") is None:
        limit = host_memory_limit()
        if limit is not None:
            cache_options["host_budget_bytes"] = limit // replicas
    return CacheConfig(
        num_blocks=int(kv_cache_config.num_blocks),
        block_size=block_size,
        staging_capacity_tokens=staging,
        **cache_options,
    )
