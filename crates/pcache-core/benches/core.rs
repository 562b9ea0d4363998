//! Criterion benchmarks of the hot paths of `pcache-core`.
//!
//! Run with `cargo bench -p pcache-core --bench core`. Every group reports
//! `Throughput::Elements`, so criterion prints per-element rates (slots, transitions, tasks,
//! blocks) next to the per-iteration times. The configuration keeps the whole run well under
//! two minutes on a 2-core machine.
//!
//! - `ledger/claim_commit_16k`: claim 16,384 slots of one key for a fresh task, then commit.
//! - `ledger/plan_read_16k`: plan a read of 16,384 committed slots, then release it.
//! - `ledger/claim_plus_plan_16k`: claim + commit + plan_read + release of 16,384 slots.
//! - `task_state/transition`: PENDING → QUEUED → COPYING → HOST_READY → WRITTEN on a fresh
//!   cell (4 transitions).
//! - `queues/push_pop_2threads`: a producer thread pushes 10,000 pre-created tasks while the
//!   measuring thread pops them all.
//! - `hashing/32k_tokens_block16`: chained hashes of a 32,768-token prompt in 16-token blocks.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pcache_core::{BlockHasher, CopyQueues, KeyId, Ledger, Priority, Task, TaskId, TaskStateCell};

/// Slots in the ledger: 4,096 blocks of 16.
const NUM_SLOTS: u32 = 65_536;
/// Tokens per KV block.
const BLOCK_SIZE: usize = 16;
/// Slots claimed / read per ledger operation: 1,024 blocks of 16.
const SLOTS_PER_OP: usize = 16_384;
/// Tasks pushed and popped per `queues/push_pop_2threads` iteration.
const QUEUE_TASKS: usize = 10_000;
/// Prompt length of the hashing benchmark.
const PROMPT_TOKENS: usize = 32_768;

/// SplitMix64: a tiny deterministic generator, so every run sees the same inputs.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A realistic slot layout: 1,024 distinct blocks of 16 consecutive slots, the blocks drawn
/// from the ledger's 4,096 in a pseudo-random order (fixed seed), as a paged-KV allocator
/// hands them out after some churn.
fn block_layout_slots() -> Vec<i64> {
    let num_blocks = NUM_SLOTS as usize / BLOCK_SIZE;
    let mut blocks: Vec<usize> = (0..num_blocks).collect();
    let mut rng = SplitMix64(0x5eed_0000_b10c);
    // Fisher–Yates shuffle.
    for i in (1..blocks.len()).rev() {
        blocks.swap(i, rng.below(i + 1));
    }
    let wanted = SLOTS_PER_OP / BLOCK_SIZE;
    let slots: Vec<i64> = blocks[..wanted]
        .iter()
        .flat_map(|&b| (0..BLOCK_SIZE).map(move |o| (b * BLOCK_SIZE + o) as i64))
        .collect();
    assert_eq!(slots.len(), SLOTS_PER_OP);
    slots
}

/// A ledger of `NUM_SLOTS` slots with one key.
fn ledger_with_key() -> (Ledger, KeyId) {
    let mut ledger = Ledger::new(NUM_SLOTS, 16).expect("non-empty ledger");
    let key = ledger.add_key();
    (ledger, key)
}

fn bench_ledger(c: &mut Criterion) {
    let slots = block_layout_slots();
    let mut group = c.benchmark_group("ledger");
    group.throughput(Throughput::Elements(SLOTS_PER_OP as u64));

    // The ledger is kept across iterations and every iteration uses the next task id, as the
    // cache does. After the first iteration the slots are committed with no pending reader,
    // so each claim takes the common path: whole blocks taken over at a new version, nothing
    // stolen and nothing to preserve. The task's row list is allocated by the claim and freed
    // by the commit, inside the measurement.
    group.bench_function("claim_commit_16k", |b| {
        let (mut ledger, key) = ledger_with_key();
        let mut next_task = 0u64;
        b.iter(|| {
            let task = TaskId(next_task);
            next_task += 1;
            let outcome = ledger
                .claim(black_box(&slots[..]), key, task)
                .expect("claim");
            let committed = ledger.commit(task).expect("commit");
            debug_assert_eq!(committed, SLOTS_PER_OP);
            black_box((outcome, committed))
        });
    });

    // Reads of committed rows; the release keeps the reader counts and the pending-read table
    // bounded.
    group.bench_function("plan_read_16k", |b| {
        let (mut ledger, key) = ledger_with_key();
        ledger.claim(&slots[..], key, TaskId(0)).expect("claim");
        ledger.commit(TaskId(0)).expect("commit");
        b.iter(|| {
            let plan = ledger
                .plan_read(black_box(&slots[..]), key)
                .expect("plan_read");
            ledger.release(plan.read).expect("release");
            black_box(plan)
        });
    });

    // The full "claim + plan" path of 16k slots: a write lands, then its rows are read.
    group.bench_function("claim_plus_plan_16k", |b| {
        let (mut ledger, key) = ledger_with_key();
        let mut next_task = 0u64;
        b.iter(|| {
            let task = TaskId(next_task);
            next_task += 1;
            let outcome = ledger
                .claim(black_box(&slots[..]), key, task)
                .expect("claim");
            ledger.commit(task).expect("commit");
            let plan = ledger
                .plan_read(black_box(&slots[..]), key)
                .expect("plan_read");
            ledger.release(plan.read).expect("release");
            black_box((outcome, plan))
        });
    });
    group.finish();
}

fn bench_task_state(c: &mut Criterion) {
    let mut group = c.benchmark_group("task_state");
    // One full happy-path cycle is 4 compare-and-swap transitions; the per-element rate is
    // the cost of one transition.
    group.throughput(Throughput::Elements(4));
    group.bench_function("transition", |b| {
        let mut id = 0u64;
        b.iter(|| {
            id += 1;
            let cell = black_box(TaskStateCell::new(TaskId(id)));
            cell.enqueue().expect("enqueue");
            cell.start_copy().expect("start_copy");
            cell.copy_done().expect("copy_done");
            black_box(cell.written().expect("written"))
        });
    });
    group.finish();
}

fn bench_queues(c: &mut Criterion) {
    let mut group = c.benchmark_group("queues");
    group.throughput(Throughput::Elements(QUEUE_TASKS as u64));
    group.bench_function("push_pop_2threads", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                // Outside the measurement: task allocation, thread start, and freeing the
                // popped tasks afterwards.
                let queues = Arc::new(CopyQueues::new());
                let tasks: Vec<Arc<Task>> = (0..QUEUE_TASKS as u64)
                    .map(|i| Arc::new(Task::new(TaskId(i))))
                    .collect();
                let mut popped = Vec::with_capacity(QUEUE_TASKS);
                let start_line = Arc::new(Barrier::new(2));
                let producer = {
                    let queues = queues.clone();
                    let start_line = start_line.clone();
                    std::thread::spawn(move || {
                        start_line.wait();
                        for (i, task) in tasks.into_iter().enumerate() {
                            let priority = if i % 2 == 0 {
                                Priority::High
                            } else {
                                Priority::Low
                            };
                            queues.push(task, priority).expect("push");
                        }
                    })
                };
                start_line.wait();
                let start = Instant::now();
                while popped.len() < QUEUE_TASKS {
                    match queues.pop() {
                        Some(task) => popped.push(task),
                        None => std::hint::spin_loop(),
                    }
                }
                total += start.elapsed();
                producer.join().expect("producer thread");
                assert!(queues.pop().is_none());
                black_box(popped);
            }
            total
        });
    });
    group.finish();
}

fn bench_hashing(c: &mut Criterion) {
    let mut rng = SplitMix64(0x70_6b65_6e73);
    // Token ids below a 152k vocabulary, like a modern LLM tokenizer's.
    let tokens: Vec<u32> = (0..PROMPT_TOKENS)
        .map(|_| rng.below(152_064) as u32)
        .collect();
    let num_blocks = PROMPT_TOKENS / BLOCK_SIZE;
    let mut hasher = BlockHasher::new(BLOCK_SIZE).expect("block size");
    let mut group = c.benchmark_group("hashing");
    group.throughput(Throughput::Elements(num_blocks as u64));
    group.bench_function("32k_tokens_block16", |b| {
        b.iter(|| {
            let hashes = hasher
                .hash_blocks(black_box(&tokens[..]), None, None)
                .expect("hash");
            debug_assert_eq!(hashes.len(), num_blocks);
            black_box(hashes)
        });
    });
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_ledger, bench_task_state, bench_queues, bench_hashing
}
criterion_main!(benches);
