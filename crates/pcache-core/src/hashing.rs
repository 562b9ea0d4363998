//! Chained 128-bit block hashes over token ids, the identity of a full KV block.
//!
//! Block `i`'s hash covers its parent's hash (block `i-1`, or the caller's `parent` for the
//! first block), the block's token ids and its optional extra key bytes (multimodal content
//! hashes, LoRA names, cache salts). Only full blocks are hashed. The byte layout is fixed
//! and little-endian and the hash is xxh3-128 with a fixed seed, so hashes agree across
//! processes, runs and machines:
//!
//! ```text
//! [0 | 1, parent: u128 LE if 1] [block_size: u32 LE] [token ids: u32 LE × block_size]
//! [0 | 1, len: u64 LE, bytes if 1]
//! ```
//!
//! Every variable-length part carries its length, so no two (parent, tokens, extra key)
//! triples share their bytes: without the block size, a block of one token and an extra key
//! spelt the same bytes as a block of three tokens and none.

use std::fmt;

use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::error::{Error, Result};

/// Seed of the block hash ("omni_pca" in ASCII); changing it changes every hash.
pub const HASH_SEED: u64 = 0x6f6d_6e69_5f70_6361;

/// The hash of one full block, chained over every block before it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

/// A raw token id as the engine hands it over; validated to fit in `u32`.
pub trait RawToken: Copy + Send + Sync {
    /// The id, or `None` if it is negative or too large.
    fn to_u32(self) -> Option<u32>;
    /// The id as given, for error messages.
    fn to_i128(self) -> i128;
}

macro_rules! raw_token {
    ($($t:ty),*) => {$(
        impl RawToken for $t {
            fn to_u32(self) -> Option<u32> {
                u32::try_from(self).ok()
            }
            fn to_i128(self) -> i128 {
                self as i128
            }
        }
    )*};
}
raw_token!(i64, i32, u32, u64);

/// Hashes full blocks of a fixed size. Reuses one buffer; not shared between threads.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    block_size: usize,
    buf: Vec<u8>,
}

/// The largest block the hasher takes (tokens): far past any engine's KV block, and small
/// enough that a block's bytes (4 per token) never overflow or ask for an absurd buffer.
pub const MAX_BLOCK_SIZE: usize = 1 << 24;

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens, 1 to `MAX_BLOCK_SIZE`.
    pub fn new(block_size: usize) -> Result<Self> {
        if block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return Err(Error::InvalidInput {
                what: format!("block_size must be 1 to {MAX_BLOCK_SIZE} tokens, got {block_size}"),
            });
        }
        Ok(Self {
            block_size,
            buf: Vec::new(), // grows to one block's bytes at the first hash
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of one block from its parent, tokens (exactly `block_size`) and extra bytes.
    fn hash_one(
        &mut self,
        parent: Option<BlockHash>,
        token_bytes: &[u8],
        extra: Option<&[u8]>,
    ) -> BlockHash {
        let buf = &mut self.buf;
        buf.clear();
        match parent {
            None => buf.push(0),
            Some(p) => {
                buf.push(1);
                buf.extend_from_slice(&p.0.to_le_bytes());
            }
        }
        buf.extend_from_slice(&(self.block_size as u32).to_le_bytes()); // (<= MAX_BLOCK_SIZE)
        buf.extend_from_slice(token_bytes);
        match extra {
            None => buf.push(0),
            Some(bytes) => {
                buf.push(1);
                buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
                buf.extend_from_slice(bytes);
            }
        }
        BlockHash(xxh3_128_with_seed(buf, HASH_SEED))
    }

    /// Hashes every full block of `tokens`, chaining from `parent`. `extra_keys`, if given,
    /// has one entry per full block. The trailing partial block is not hashed (its ids are
    /// checked all the same). Refused as a whole for a token id outside `[0, 2^32)` or a wrong
    /// number of extra keys.
    pub fn hash_blocks<T: RawToken>(
        &mut self,
        tokens: &[T],
        parent: Option<BlockHash>,
        extra_keys: Option<&[Option<&[u8]>]>,
    ) -> Result<Vec<BlockHash>> {
        let num_blocks = tokens.len() / self.block_size;
        let hashed = &tokens[..num_blocks * self.block_size];
        if let Some(position) = tokens.iter().position(|t| t.to_u32().is_none()) {
            return Err(Error::InvalidInput {
                what: format!(
                    "token id {} at position {position} is outside [0, 2^32)",
                    tokens[position].to_i128()
                ),
            });
        }
        if let Some(extra) = extra_keys {
            if extra.len() != num_blocks {
                return Err(Error::InvalidInput {
                    what: format!(
                        "{} extra keys for {num_blocks} full blocks ({} tokens, block size {})",
                        extra.len(),
                        tokens.len(),
                        self.block_size
                    ),
                });
            }
        }
        // Every token as little-endian u32 bytes, converted once (validated above).
        let bytes: Vec<u8> = hashed
            .iter()
            .flat_map(|t| t.to_u32().unwrap_or(u32::MAX).to_le_bytes())
            .collect();
        let mut out = Vec::with_capacity(num_blocks);
        let mut prev = parent;
        for (i, block) in bytes.chunks_exact(4 * self.block_size).enumerate() {
            let extra = extra_keys.and_then(|e| e[i]);
            let h = self.hash_one(prev, block, extra);
            out.push(h);
            prev = Some(h);
        }
        Ok(out)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + 3).collect()
    }

    #[test]
    fn known_values_are_stable_across_machines() {
        // Golden values: a change here breaks every hash persisted or compared across
        // processes. Update only with a deliberate format change.
        let mut h = BlockHasher::new(4).unwrap();
        assert_eq!(h.block_size(), 4);
        let got = h.hash_blocks(&tokens(9), None, None).unwrap();
        assert_eq!(got.len(), 2, "the partial block is not hashed");
        let hex: Vec<String> = got.iter().map(|b| format!("{:032x}", b.0)).collect();
        assert_eq!(hex, GOLDEN.to_vec());
    }

    const GOLDEN: [&str; 2] = [
        "605b4737e6521cd9dc74a6d89153852f",
        "83e6865abf575d13846e86360faf0717",
    ];

    #[test]
    fn chaining_from_a_parent_equals_hashing_the_whole_prompt() {
        let mut h = BlockHasher::new(4).unwrap();
        let all = h.hash_blocks(&tokens(16), None, None).unwrap();
        let tail = h.hash_blocks(&tokens(16)[8..], Some(all[1]), None).unwrap();
        assert_eq!(&all[2..], &tail[..]);
    }

    #[test]
    fn a_changed_token_changes_its_block_and_every_later_block() {
        let mut h = BlockHasher::new(4).unwrap();
        let a = h.hash_blocks(&tokens(12), None, None).unwrap();
        let mut t = tokens(12);
        t[5] += 1;
        let b = h.hash_blocks(&t, None, None).unwrap();
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_ne!(a[2], b[2]);
    }

    #[test]
    fn extra_keys_and_parent_presence_are_part_of_the_hash() {
        let mut h = BlockHasher::new(2).unwrap();
        let t = tokens(4);
        let plain = h.hash_blocks(&t, None, None).unwrap();
        let none_extra = h.hash_blocks(&t, None, Some(&[None, None])).unwrap();
        assert_eq!(plain, none_extra);
        let img = h
            .hash_blocks(&t, None, Some(&[None, Some(b"img:42".as_slice())]))
            .unwrap();
        assert_eq!(plain[0], img[0]);
        assert_ne!(plain[1], img[1]);
        let zero_parent = h.hash_blocks(&t, Some(BlockHash(0)), None).unwrap();
        assert_ne!(
            plain[0], zero_parent[0],
            "no parent differs from a zero parent"
        );
    }

    #[test]
    fn int64_tokens_hash_like_u32_tokens() {
        let mut h = BlockHasher::new(4).unwrap();
        let t64: Vec<i64> = tokens(8).into_iter().map(i64::from).collect();
        assert_eq!(
            h.hash_blocks(&t64, None, None).unwrap(),
            h.hash_blocks(&tokens(8), None, None).unwrap()
        );
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(BlockHasher::new(0).is_err());
        let mut h = BlockHasher::new(2).unwrap();
        let err = h.hash_blocks(&[1i64, -5, 3, 4], None, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid input: token id -5 at position 1 is outside [0, 2^32)"
        );
        let err = h
            .hash_blocks(&[1i64, 2, 3, 4], None, Some(&[None]))
            .unwrap_err();
        assert!(
            err.to_string().contains("1 extra keys for 2 full blocks"),
            "{err}"
        );
        assert!(h.hash_blocks(&[1i64], None, None).unwrap().is_empty());
        let err = h.hash_blocks(&[1i64, 2, -1], None, None).unwrap_err();
        assert!(
            err.to_string().contains("token id -1 at position 2"),
            "{err}"
        );
    }

    #[test]
    fn blocks_of_different_sizes_never_share_their_bytes() {
        // One token and an empty extra key ([7], marker 1, length 0) against three tokens and
        // none ([7, 1, 0]): the same bytes but for the block size, which the layout includes.
        let one = BlockHasher::new(1)
            .unwrap()
            .hash_blocks(&[7u32], None, Some(&[Some(&b""[..])]))
            .unwrap();
        let three = BlockHasher::new(3)
            .unwrap()
            .hash_blocks(&[7u32, 1, 0], None, None)
            .unwrap();
        assert_ne!(one, three);
    }
}
