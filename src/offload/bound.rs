//! Lower bounds on the device bytes of any plan with offload.
//!
//! - **At any time** (unlimited link time): each op must find every tensor
//!   it reads, writes or updates on the device while it runs, less what
//!   its reuse hints let an output share with an input. The largest such
//!   working set bounds every order, recomputation aside.
//! - **Within a time** `T`: every order of the step has a place where the
//!   live bytes reach the no-offload floor `L` (the planner's lower bound,
//!   which holds for every order). Of the tensors live there, those away
//!   from the device crossed the link at least once (a step input used in
//!   the step is copied in; anything produced is copied out), and the link
//!   moves at most `(to_host + to_device) · T` bytes in `T`. Persistent
//!   inputs no op touches may sit on the host for free. So the device
//!   holds at least `L - unused - (to_host + to_device) · T` there.
//!
//! The bound is the larger of the two.

use crate::graph::{Graph, Lifetime, OpId};

use super::device::Device;

/// A bound and the op or reason that sets it.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound {
    pub bytes: u64,
    pub why: String,
}

/// The largest working set of one op (module docs), and the op.
pub fn working_set(g: &Graph) -> (u64, Option<OpId>) {
    let mut best = (0u64, None);
    for o in g.op_ids() {
        let (_, bytes) = crate::fit::working_set_where(g, o, |_| true);
        if bytes > best.0 {
            best = (bytes, Some(o));
        }
    }
    best
}

/// The bound with unlimited link time.
pub fn at_any_time(g: &Graph) -> Bound {
    let (bytes, op) = working_set(g);
    Bound {
        bytes,
        why: match op {
            Some(o) => format!(
                "op {:?} needs {} on the device for its inputs and outputs",
                g.op(o).name,
                crate::timeline::human(bytes)
            ),
            None => "the step has no op that touches memory".into(),
        },
    }
}

/// The bound within `seconds` of modeled time, given `floor`, the
/// no-offload lower bound of `g` (module docs).
pub fn within(g: &Graph, floor: u64, seconds: f64, dev: &Device) -> Bound {
    let any = at_any_time(g);
    let unused: u64 = g
        .tensor_ids()
        .filter(|&t| g.occupies_memory(t))
        .filter(|&t| {
            let x = g.tensor(t);
            x.lifetime == Lifetime::Persistent
                && x.producer.is_none()
                && g.users_of_root(t).is_empty()
        })
        .map(|t| g.tensor(t).size)
        .sum();
    let moved = (dev.to_host_bytes_per_s + dev.to_device_bytes_per_s) * seconds.max(0.0);
    let by_time = (floor.saturating_sub(unused) as f64 - moved).max(0.0) as u64;
    if by_time > any.bytes {
        Bound {
            bytes: by_time,
            why: format!(
                "at the no-offload floor's place ({}) the link moves at most {} in {:.3} s",
                crate::timeline::human(floor),
                crate::timeline::human(moved as u64),
                seconds
            ),
        }
    } else {
        any
    }
}
