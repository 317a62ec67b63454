//! Time budgets: one deadline shared by every search of a solve.
//!
//! Searches poll [`Budget::expired`] between units of work and return the
//! best they have when it fires. Work limits (states, rounds) are what make
//! results deterministic; the deadline is the user's hard cap, and a solve
//! stopped by it says so in its report.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A deadline, shareable across threads.
#[derive(Clone, Debug)]
pub struct Budget {
    deadline: Option<Instant>,
    hit: Arc<AtomicBool>,
}

impl Budget {
    /// A budget of `limit` from now.
    pub fn new(limit: Duration) -> Budget {
        Budget {
            deadline: Instant::now().checked_add(limit),
            hit: Arc::new(AtomicBool::new(false)),
        }
    }
    /// No deadline.
    pub fn unlimited() -> Budget {
        Budget {
            deadline: None,
            hit: Arc::new(AtomicBool::new(false)),
        }
    }
    /// Whether the deadline has passed (and records that it did).
    pub fn expired(&self) -> bool {
        if self.hit.load(Ordering::Relaxed) {
            return true;
        }
        match self.deadline {
            Some(d) if Instant::now() >= d => {
                self.hit.store(true, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }
    /// Whether any search saw the deadline pass.
    pub fn was_hit(&self) -> bool {
        self.hit.load(Ordering::Relaxed)
    }
    /// Time left (`None`: unlimited).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_budget_expires_and_records_it_across_clones() {
        let b = Budget::new(Duration::ZERO);
        let c = b.clone();
        assert!(!c.was_hit(), "not hit until someone looks");
        assert!(b.expired());
        assert!(c.was_hit(), "clones share the flag");
        assert!(c.expired());
        assert_eq!(b.remaining(), Some(Duration::ZERO));
    }

    #[test]
    fn unlimited_and_distant_budgets_never_expire() {
        let u = Budget::unlimited();
        assert!(!u.expired() && !u.was_hit());
        assert_eq!(u.remaining(), None);
        let far = Budget::new(Duration::from_secs(3600));
        assert!(!far.expired() && !far.was_hit());
        assert!(
            far.remaining()
                .is_some_and(|r| r > Duration::from_secs(3500))
        );
        // Too far for the clock: no deadline.
        assert!(!Budget::new(Duration::MAX).expired());
    }
}
