//! A seeded generator for the tests' own random faults and picks: xorshift64, shared across tasks,
//! so a failing run repeats from its seed.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug)]
pub struct Seeded(AtomicU64);

impl Default for Seeded {
    fn default() -> Self {
        Seeded::new(1)
    }
}

impl Seeded {
    /// Any seed will do (zero, the one xorshift cannot leave, is made odd).
    pub fn new(seed: u64) -> Self {
        Seeded(AtomicU64::new(seed | 1))
    }

    pub fn next(&self) -> u64 {
        let step = |mut x: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // One step per caller, however many tasks draw at once.
        let before = self.0.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |x| Some(step(x))).unwrap_or_default();
        step(before)
    }

    /// A number in `0..n` (0 when `n` is).
    pub fn below(&self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}
