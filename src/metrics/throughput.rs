//! Training throughput in examples per second, with warm-up steps excluded.
//!
//! An embers definition, not TorchRec's `ThroughputMetric`: its window is the last
//! `window_steps` steps (TorchRec's: the last `window_seconds`), it counts this process's
//! examples (TorchRec multiplies a batch by the world size; add the ranks' rates for a
//! job's), and a warm-up of 0 steps is allowed (TorchRec asks for at least 1).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Examples/s over the whole run after warm-up (lifetime) and over the last few steps (window).
#[derive(Clone, Debug)]
pub struct Throughput {
    warmup_steps: usize,
    window_steps: usize,
    steps: usize,
    start: Option<Instant>,
    examples_since_start: u64,
    recent: VecDeque<(Instant, u64)>,
}

impl Throughput {
    /// Ignores the first `warmup_steps` steps; the window covers the last `window_steps` (at
    /// least 1: a window of none is an error, as in TorchRec).
    pub fn new(warmup_steps: usize, window_steps: usize) -> crate::Result<Self> {
        if window_steps == 0 {
            return Err(crate::Error::invalid(
                "Throughput::new",
                "a window of 0 steps measures nothing: give at least 1",
            ));
        }
        Ok(Throughput {
            warmup_steps,
            window_steps,
            steps: 0,
            start: None,
            examples_since_start: 0,
            recent: VecDeque::new(),
        })
    }

    /// Records that a step that processed `examples` examples just finished.
    pub fn step(&mut self, examples: u64) {
        self.step_at(examples, Instant::now());
    }

    /// [`step`](Self::step) with an explicit clock reading (for tests and replay).
    pub fn step_at(&mut self, examples: u64, now: Instant) {
        self.steps += 1;
        if self.steps <= self.warmup_steps {
            // The end of warm-up is where timing starts.
            if self.steps == self.warmup_steps {
                self.start = Some(now);
                self.recent.push_back((now, 0));
            }
            return;
        }
        if self.start.is_none() {
            // No warm-up: the first step only starts the clock.
            self.start = Some(now);
            self.recent.push_back((now, 0));
            return;
        }
        self.examples_since_start += examples;
        self.recent.push_back((now, examples));
        while self.recent.len() > self.window_steps + 1 {
            self.recent.pop_front();
        }
    }

    /// Leaves `pause` out of the rates: time spent since the last step on other work than
    /// training (a validation, a checkpoint), which the next step's interval would hold.
    pub fn exclude(&mut self, pause: Duration) {
        if let Some(s) = &mut self.start {
            *s += pause;
        }
        for r in &mut self.recent {
            r.0 += pause;
        }
    }

    /// Examples per second since warm-up ended (0 before two timed steps).
    pub fn lifetime(&self) -> f64 {
        let last = self.recent.back().map(|r| r.0);
        match (self.start, last) {
            (Some(s), Some(l)) => rate(self.examples_since_start, l - s),
            _ => 0.0,
        }
    }

    /// Examples per second over the last `window_steps` steps.
    pub fn window(&self) -> f64 {
        if self.recent.len() < 2 {
            return 0.0;
        }
        let first = self.recent.front().expect("non-empty").0;
        let last = self.recent.back().expect("non-empty").0;
        let examples: u64 = self.recent.iter().skip(1).map(|r| r.1).sum();
        rate(examples, last - first)
    }
}

fn rate(examples: u64, elapsed: Duration) -> f64 {
    let s = elapsed.as_secs_f64();
    if s > 0.0 {
        examples as f64 / s
    } else {
        0.0
    }
}
