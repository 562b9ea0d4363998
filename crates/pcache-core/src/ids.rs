//! Newtypes for the integers that mean something: slots, keys, versions, tasks, steps, reads.

use std::fmt;

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub $inner);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }

        impl From<$inner> for $name {
            fn from(v: $inner) -> Self {
                Self(v)
            }
        }
    };
}

id_newtype!(
    /// An engine KV slot: `block_id * block_size + offset`.
    SlotId(u32), "slot#"
);
id_newtype!(
    /// A cached per-token tensor (hidden states or one mm key), as registered in the ledger.
    KeyId(u32), "key#"
);
id_newtype!(
    /// The write version of one (slot, key): the number of the ledger claim that wrote it.
    Version(u64), "v"
);
id_newtype!(
    /// One write task: the rows of one request in one step (or one deferred flush).
    TaskId(u64), "task#"
);
id_newtype!(
    /// One engine step's outputs; consumed exactly once by materialize or discard.
    StepId(u64), "step#"
);
id_newtype!(
    /// A pending read registered by [`crate::Ledger::plan_read`].
    ReadId(u64), "read#"
);

/// The first value (in sorted order) that appears more than once in `ids`, if any: how a batch
/// call refuses a task listed twice before it changes anything.
pub fn first_repeat<T: Ord + Copy>(ids: &[T]) -> Option<T> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted
        .windows(2)
        .find(|pair| pair[0] == pair[1])
        .map(|pair| pair[0])
}
