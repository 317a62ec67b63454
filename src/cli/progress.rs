//! A progress bar on stderr for solves that take longer than a second.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use memplan_solver::Progress;

use super::format::human_bytes;

/// Shows the solve's progress after a second; stops when dropped.
pub struct ProgressGuard {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

/// Starts watching a solve's `progress` (parts of a phase) from a
/// background thread.
pub fn watch(progress: Arc<Progress>) -> ProgressGuard {
    watch_with(
        progress,
        "{spinner} {elapsed_precise} {msg} [{bar:30}] {pos}/{len} parts",
        |phase, _| phase,
    )
}

/// Starts watching a fit's `progress`: the plans it has made and the best
/// peak so far.
pub fn watch_fit(progress: Arc<Progress>) -> ProgressGuard {
    watch_with(
        progress,
        "{spinner} {elapsed_precise} {msg}",
        |phase, done| format!("{phase}: {done} plans"),
    )
}

fn watch_with(
    progress: Arc<Progress>,
    template: &'static str,
    message: fn(String, usize) -> String,
) -> ProgressGuard {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    // The bar is a nicety: where no thread can start (the system's limit
    // on threads, or on memory for their stacks) the solve runs without it.
    let handle = std::thread::Builder::new().spawn(move || {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(1) {
            if flag.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        while !flag.load(Ordering::Relaxed) {
            let done = progress.done.load(Ordering::Relaxed);
            bar.set_length(progress.total.load(Ordering::Relaxed) as u64);
            bar.set_position(done as u64);
            let best = progress.best_peak.load(Ordering::Relaxed);
            let msg = message(progress.phase(), done);
            if best > 0 {
                bar.set_message(format!("{msg} (best peak so far {})", human_bytes(best)));
            } else {
                bar.set_message(msg);
            }
            bar.tick();
            std::thread::sleep(Duration::from_millis(100));
        }
        bar.finish_and_clear();
    });
    ProgressGuard {
        stop,
        handle: handle.ok(),
    }
}

impl Drop for ProgressGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
