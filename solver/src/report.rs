//! What a solve did: where the time went and, for every part, its size,
//! bound, result and gap. Also the live progress counters a front end can
//! poll from another thread.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::partition::PartKind;

/// One part's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct PartReport {
    /// Position of the part in execution order.
    pub index: usize,
    pub kind: PartKind,
    /// Ops in the part.
    pub ops: usize,
    /// Bytes live across the whole part.
    pub base: u64,
    /// Lower bound on the part's peak (base included).
    pub bound: u64,
    /// Best heuristic peak before improvement (base included).
    pub first_peak: u64,
    /// Final peak (base included).
    pub peak: u64,
    /// Which technique produced the final order.
    pub method: String,
    /// The peak is proven optimal for the part.
    pub proven: bool,
    /// Seconds spent on the part (heuristics and improvement).
    pub seconds: f64,
    /// States created by exact searches on the part.
    pub states: usize,
}

impl PartReport {
    /// `peak / bound - 1`.
    pub fn gap(&self) -> f64 {
        if self.bound == 0 {
            0.0
        } else {
            self.peak as f64 / self.bound as f64 - 1.0
        }
    }
}

/// The whole solve.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SolveReport {
    /// Every part, in execution order.
    pub parts: Vec<PartReport>,
    /// `(phase, seconds)` in the order they ran.
    pub phases: Vec<(String, f64)>,
    /// Peak of the returned order.
    pub peak: u64,
    /// Best lower bound the solver proved (max over parts).
    pub lower_bound: u64,
    /// The returned order is proven optimal.
    pub proven: bool,
    /// The time limit cut a search short (the result may then depend on the
    /// machine's speed).
    pub time_limit_hit: bool,
    /// Worker threads used.
    pub threads: usize,
}

impl SolveReport {
    /// `peak / lower bound - 1`.
    pub fn gap(&self) -> f64 {
        if self.lower_bound == 0 {
            0.0
        } else {
            self.peak as f64 / self.lower_bound as f64 - 1.0
        }
    }
}

/// Counters a solve updates as it goes; read them from another thread to
/// show progress.
#[derive(Debug, Default)]
pub struct Progress {
    /// Parts to work on in the current phase.
    pub total: AtomicUsize,
    /// Parts done in the current phase.
    pub done: AtomicUsize,
    /// Best peak so far (0: none yet).
    pub best_peak: AtomicU64,
    phase: Mutex<String>,
}

impl Progress {
    pub fn new() -> Progress {
        Progress::default()
    }
    /// Starts a phase of `total` parts.
    pub fn start_phase(&self, name: &str, total: usize) {
        if let Ok(mut p) = self.phase.lock() {
            *p = name.to_string();
        }
        self.done.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }
    pub fn part_done(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }
    pub fn phase(&self) -> String {
        self.phase.lock().map(|p| p.clone()).unwrap_or_default()
    }
}
