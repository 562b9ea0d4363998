"""Block hashing: an independent Python reference of the byte layout, chaining, and
determinism across processes."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omni_pcache import HASH_SEED, block_hashes, hash_blocks

# (the reference's hasher: a dev requirement, absent from the GPU image, whose `gpu-check` runs
# the default suite from a bare environment)
xxhash = pytest.importorskip("xxhash")


def reference(tokens: list[int], block_size: int, parent: int | None, extra: list[bytes | None] | None):
    """The documented layout, hashed with the `xxhash` package (a separate implementation)."""
    out = []
    for i in range(len(tokens) // block_size):
        buf = b"\x00" if parent is None else b"\x01" + parent.to_bytes(16, "little")
        buf += struct.pack("<I", block_size)
        buf += struct.pack(f"<{block_size}I", *tokens[i * block_size : (i + 1) * block_size])
        key = None if extra is None else extra[i]
        buf += b"\x00" if key is None else b"\x01" + struct.pack("<Q", len(key)) + key
        parent = xxhash.xxh3_128_intdigest(buf, seed=HASH_SEED)
        out.append(parent)
    return out


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    block_size=st.integers(1, 17),
    parent=st.none() | st.integers(0, 2**128 - 1),
    data=st.data(),
)
def test_matches_an_independent_reference(tokens, block_size, parent, data) -> None:
    num_blocks = len(tokens) // block_size
    extra = data.draw(st.none() | st.lists(st.none() | st.binary(max_size=9), min_size=num_blocks, max_size=num_blocks))
    assert hash_blocks(np.array(tokens, dtype=np.int64), block_size, parent, extra) == reference(
        tokens, block_size, parent, extra
    )


def test_chaining_and_prefix_property() -> None:
    tokens = list(range(1000, 1100))
    whole = hash_blocks(tokens, 16)
    assert len(whole) == 6, "the trailing partial block is not hashed"
    assert hash_blocks(tokens[:40], 16) == whole[:2], "a prefix hashes to a prefix"
    assert hash_blocks(tokens[32:], 16, parent=whole[1]) == whole[2:]
    changed = tokens.copy()
    changed[20] += 1
    other = hash_blocks(changed, 16)
    assert other[0] == whole[0]
    assert all(a != b for a, b in zip(other[1:], whole[1:], strict=True))


def test_array_form_matches_int_form() -> None:
    tokens = np.arange(64, dtype=np.int32)
    halves = block_hashes(tokens, 16)
    assert halves.shape == (4, 2) and halves.dtype == np.uint64
    assert [int(lo) | int(hi) << 64 for lo, hi in halves.tolist()] == hash_blocks(tokens, 16)


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_same_hash_in_another_process(seed: str) -> None:
    tokens = list(range(7, 7 + 48))
    code = (
        "from omni_pcache import hash_blocks; print(hash_blocks(list(range(7, 55)), 16, extra_keys=[b'a', None, b'b']))"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == str(hash_blocks(tokens, 16, extra_keys=[b"a", None, b"b"]))


def test_the_array_form_takes_extra_keys_as_a_list_or_a_tuple() -> None:
    tokens = np.arange(48, dtype=np.int64)
    keys = [b"a", None, bytearray(b"b")]
    listed = block_hashes(tokens, 16, extra_keys=keys)
    np.testing.assert_array_equal(block_hashes(tokens, 16, extra_keys=tuple(keys)), listed)
    assert [int(lo) | int(hi) << 64 for lo, hi in listed.tolist()] == reference(
        list(range(48)), 16, None, [b"a", None, b"b"]
    )
