"""Block hashing: omni_pcache's Rust hasher vs a Python reference of vLLM's default scheme.

vLLM's default (``prefix_caching_hash_algo="sha256"``) hashes each full block as
``sha256(pickle.dumps((parent_hash, tuple(block_token_ids), extra_keys), HIGHEST_PROTOCOL))``,
chained from a seed hash, one Python call per block (``hash_block_tokens`` in
``vllm/v1/core/kv_cache_utils.py``). The reference below does exactly that on the same
prompts; omni_pcache's side is ``block_hashes`` (the native call, a (blocks, 2) uint64 array,
from a numpy token array, and from a Python list) and ``hash_blocks`` (the same from a Python list, returning
128-bit Python ints). Prompts of 32,768 tokens, block 16 (2,048 blocks each), no extra keys.

Run: ``.venv/bin/python benches/hashing.py`` (``--quick``: 2,048-token prompts). Writes
benches/results/hashing.json. Medians; nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omni_pcache import block_hashes, hash_blocks

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, command, machine, write

BLOCK = 16
NONE_HASH = hashlib.sha256(pickle.dumps(b"vllm-none-hash-seed", pickle.HIGHEST_PROTOCOL)).digest()


def vllm_sha256(obj: Any) -> bytes:
    """vllm.utils.hashing.sha256: pickle, then SHA-256."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_reference(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Python reference of vLLM's request block hasher with the default hash function."""
    hashes: list[bytes] = []
    parent = NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = vllm_sha256((parent, tuple(block), None))
        hashes.append(parent)
    return hashes


def median_s(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,048-token prompts, few repeats (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hashing.json")
    args = parser.parse_args(argv)
    tokens = 2048 if args.quick else 32768
    prompts = 2 if args.quick else 8
    rep_py, rep_rust = (3, 10) if args.quick else (5, 100)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 151_936, size=tokens, dtype=np.int64) for _ in range(prompts)]
    lists = [a.tolist() for a in arrays]
    blocks = tokens // BLOCK

    # Same chaining: both produce one hash per full block, each depending on all before it.
    assert len(vllm_reference(lists[0], BLOCK)) == blocks == len(block_hashes(arrays[0], BLOCK))

    def per_block_ns(fn: Callable[[Any], Any], inputs: list[Any], repeat: int) -> float:
        return statistics.median(median_s(lambda x=x: fn(x), repeat) for x in inputs) / blocks * 1e9

    ref_ns = per_block_ns(lambda t: vllm_reference(t, BLOCK), lists, rep_py)
    native_ns = per_block_ns(lambda a: block_hashes(a, BLOCK), arrays, rep_rust)
    native_list_ns = per_block_ns(lambda t: block_hashes(t, BLOCK), lists, rep_rust)
    list_ns = per_block_ns(lambda t: hash_blocks(t, BLOCK), lists, rep_rust)
    results = {
        "prompt_tokens": tokens,
        "block_size": BLOCK,
        "blocks_per_prompt": blocks,
        "prompts": prompts,
        "vllm_sha256_pickle_python_ns_per_block": ref_ns,
        "omni_pcache_block_hashes_numpy_ns_per_block": native_ns,
        "omni_pcache_block_hashes_list_ns_per_block": native_list_ns,
        "omni_pcache_hash_blocks_list_ns_per_block": list_ns,
        "speedup_block_hashes": ref_ns / native_ns,
        "speedup_block_hashes_list": ref_ns / native_list_ns,
        "speedup_hash_blocks": ref_ns / list_ns,
        "prompt_us": {
            "vllm_sha256_pickle_python": ref_ns * blocks / 1e3,
            "omni_pcache_block_hashes_numpy": native_ns * blocks / 1e3,
            "omni_pcache_block_hashes_list": native_list_ns * blocks / 1e3,
            "omni_pcache_hash_blocks_list": list_ns * blocks / 1e3,
        },
    }
    print(
        f"{tokens}-token prompt, block {BLOCK}: vLLM sha256(pickle) reference {ref_ns:.0f} ns/block; "
        f"omni_pcache block_hashes {native_ns:.1f} ns/block ({ref_ns / native_ns:.0f}x; "
        f"from a list {native_list_ns:.0f} ns/block, {ref_ns / native_list_ns:.1f}x), "
        f"hash_blocks from a list {list_ns:.1f} ns/block ({ref_ns / list_ns:.0f}x)"
    )
    write(
        args.out,
        {"bench": "hashing", "machine": machine(), "command": command(), "quick": args.quick, "results": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
