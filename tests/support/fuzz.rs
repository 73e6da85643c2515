//! A small seeded mutation fuzzer for the readers of untrusted files (shared by the fuzz tests
//! of every crate, `#[path]`-included).
//!
//! Each input is a mutation of a valid seed (bit flips, byte overwrites with interesting values,
//! inserted, deleted, duplicated or spliced ranges, truncation) or plain random bytes. A target
//! must return `Ok` or an error message; a panic fails the run with the input written to
//! `target/fuzz-failures/` for replay, as does an input that takes longer than [`SLOW`]. An
//! allocation above [`ALLOCATION_LIMIT`] is refused by [`CountingAlloc`] (which every fuzz test
//! binary installs as its global allocator), which aborts the run: the readers must bound what
//! untrusted lengths make them allocate. `EMBERS_FUZZ_VERBOSE=1` prints each input's number
//! before it runs, to find the one that aborted.
//!
//! The time budget per reader is `EMBERS_FUZZ_SECS` (default 2 s, what CI runs); a longer run
//! for developers: `EMBERS_FUZZ_SECS=600 cargo test --release --test fuzz -- --nocapture`.
//! The seed is `EMBERS_FUZZ_SEED` (default fixed), printed with the number of inputs tried.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The largest single allocation an input may cause.
pub const ALLOCATION_LIMIT: usize = 1 << 30;
/// The longest an input may take.
pub const SLOW: Duration = Duration::from_secs(10);

static LARGEST: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, remembering the largest request since [`reset_largest`].
pub struct CountingAlloc;

// SAFETY: every call is forwarded unchanged to the system allocator.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if over(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if over(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if over(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Records `size`; whether it is over the limit (then refused: the process aborts with
/// "memory allocation of N bytes failed" instead of swapping the machine to death).
fn over(size: usize) -> bool {
    LARGEST.fetch_max(size, Ordering::Relaxed);
    size > ALLOCATION_LIMIT
}

fn reset_largest() {
    LARGEST.store(0, Ordering::Relaxed);
}

fn largest() -> usize {
    LARGEST.load(Ordering::Relaxed)
}

/// xorshift64*.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const INTERESTING: &[&[u8]] = &[
    b"0",
    b"-1",
    b"\t",
    b"\n",
    b"\r\n",
    b"::",
    b"|",
    b",",
    b"\"",
    b"=",
    b"[",
    b"{",
    b"}",
    b"]",
    b"nan",
    b"inf",
    b"1e308",
    b"18446744073709551615",
    b"9223372036854775808",
    b"4294967296",
    b"99999999999999999999999",
    b"\xff\xff\xff\xff",
    b"\x00\x00\x00\x00",
    b"\xff\xff\xff\xff\xff\xff\xff\x7f",
];

/// One mutation of `input` (`others`: the seeds, for splicing).
pub fn mutate(rng: &mut Rng, input: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = v.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                v[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                v[i] = rng.next() as u8;
            }
            2 => {
                let i = rng.below(len + 1);
                let word = INTERESTING[rng.below(INTERESTING.len())];
                v.splice(i..i, word.iter().copied());
            }
            3 if len > 0 => {
                let i = rng.below(len);
                let word = INTERESTING[rng.below(INTERESTING.len())];
                let end = (i + word.len()).min(len);
                v.splice(i..end, word.iter().copied());
            }
            4 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(64));
                v.drain(i..i + n);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(256));
                let piece: Vec<u8> = v[i..i + n].to_vec();
                let at = rng.below(len + 1);
                v.splice(at..at, piece);
            }
            6 => {
                v.truncate(rng.below(len + 1));
            }
            7 if !others.is_empty() => {
                let other = &others[rng.below(others.len())];
                if !other.is_empty() {
                    let i = rng.below(other.len());
                    let n = 1 + rng.below((other.len() - i).min(512));
                    let at = rng.below(len + 1);
                    v.splice(at..at, other[i..i + n].iter().copied());
                }
            }
            _ => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                v.splice(i..i, bytes);
            }
        }
    }
    v
}

/// What a fuzz run did.
#[derive(Debug, Clone, Copy)]
pub struct Report {
    /// Inputs tried.
    pub tried: usize,
    /// Of those, accepted (`Ok`).
    pub accepted: usize,
}

/// The time budget of one reader's run.
pub fn budget() -> Duration {
    let secs = std::env::var("EMBERS_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

/// Fuzzes `target` from `seeds` for [`budget`]; panics on a panic, a slow input or an
/// allocation over the limit, naming the input saved for replay. The seeds themselves are run
/// first and must all be accepted (they are the valid inputs mutated).
pub fn run(
    name: &str,
    seeds: &[Vec<u8>],
    mut target: impl FnMut(&[u8]) -> Result<(), String>,
) -> Report {
    let seed = std::env::var("EMBERS_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f00d_u64);
    let mut rng = Rng::new(
        seed ^ name
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31) ^ b as u64),
    );
    let deadline = Instant::now() + budget();
    let mut report = Report {
        tried: 0,
        accepted: 0,
    };
    let verbose = std::env::var("EMBERS_FUZZ_VERBOSE").is_ok_and(|v| v == "1");
    let mut check = |input: &[u8], report: &mut Report| {
        if verbose {
            eprintln!(
                "fuzz {name}: input #{} ({} bytes)",
                report.tried + 1,
                input.len()
            );
        }
        reset_largest();
        let start = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(|| target(input)));
        let took = start.elapsed();
        let biggest = largest();
        report.tried += 1;
        let n = report.tried;
        let fail = |why: String| -> ! {
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
            let _ = std::fs::create_dir_all(&dir);
            let path = dir.join(format!("{name}-{n}.bin"));
            let _ = std::fs::write(&path, input);
            panic!(
                "fuzz {name}: {why} on input #{n} (saved to {})",
                path.display()
            );
        };
        match outcome {
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                fail(format!("panic `{msg}`"))
            }
            Ok(Ok(())) => report.accepted += 1,
            Ok(Err(e)) => {
                if e.trim().is_empty() {
                    fail("an error without a message".into());
                }
            }
        }
        if took > SLOW {
            fail(format!("{took:?} for one input"));
        }
        if biggest > ALLOCATION_LIMIT {
            fail(format!("an allocation of {biggest} bytes"));
        }
    };
    for s in seeds {
        check(s, &mut report);
    }
    assert_eq!(
        report.accepted,
        seeds.len(),
        "fuzz {name}: a seed (a valid input) was rejected"
    );
    while Instant::now() < deadline {
        let input = if rng.below(10) == 0 {
            let n = rng.below(4096);
            (0..n).map(|_| rng.next() as u8).collect()
        } else {
            let s = &seeds[rng.below(seeds.len())];
            mutate(&mut rng, s, seeds)
        };
        check(&input, &mut report);
    }
    println!(
        "fuzz {name}: {} inputs tried ({} accepted) in {:?}, seed {seed:#x}",
        report.tried,
        report.accepted,
        budget()
    );
    report
}
