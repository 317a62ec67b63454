//! Offload chosen with recomputation: the step is first fitted by
//! recomputation to a few budgets between the plan without either and
//! recomputation's floor (or, for a slowdown, within a few shares of it),
//! then offloaded to the target; the best of these and of offload alone
//! wins: the least modeled time within a budget, the smallest arena
//! within a slowdown. Every candidate's modeled time counts the
//! recomputed ops, and its slowdown is measured against the step as
//! given.

use std::time::{Duration, Instant};

use crate::error::Error;
use crate::fit::{self, FitOptions};
use crate::graph::Graph;
use crate::pipeline;

use super::{Offloaded, Options, Target, offload, simulate};

/// The best of offload alone and offload after recomputation (module
/// docs), within `time_limit`.
pub fn fit_offload(g: &Graph, opts: &Options, time_limit: Duration) -> Result<Offloaded, Error> {
    let start = Instant::now();
    // Recomputation copies ops: it leaves the largest working set as it is.
    if let Target::Budget(b) = opts.target {
        let bound = super::bound::at_any_time(g);
        if b < bound.bytes {
            return Err(Error::DoesNotFit(format!(
                "nothing fits {} even with everything else on the host or recomputed: {} (the bound at any link speed)",
                crate::timeline::human(b),
                bound.why
            )));
        }
    }
    let base = pipeline::plan(
        g,
        &pipeline::Options {
            time_limit: time_limit / 6,
            ..Default::default()
        },
    )?;
    let reference = simulate(g, &base.order, &opts.device);
    let mut own = opts.clone();
    own.compute_seconds = Some(reference.compute_seconds);
    own.reference_seconds = Some(reference.seconds);
    // The searches stop early enough to leave the last layout and the
    // checker their time.
    let searches = start + time_limit.mul_f64(0.85);
    own.deadline = Some(searches);
    let alone = offload(g, &base, &own);
    let mut best: Option<Offloaded> = None;
    let mut last_err = None;
    let better = |a: &Offloaded, b: &Offloaded| match opts.target {
        Target::Budget(_) => a.timing.seconds < b.timing.seconds,
        Target::MaxSlowdown(_) => a.plan.arena_bytes < b.plan.arena_bytes,
    };
    match alone {
        Ok(r) => best = Some(r),
        Err(e @ Error::DoesNotFit(_)) => last_err = Some(e),
        Err(e) => return Err(e),
    }
    let fits: Vec<FitOptions> = match opts.target {
        Target::Budget(b) => {
            let (floor, _) = fit::fit_floor(g);
            let low = b.max(floor + floor / 50);
            [0.0, 0.35]
                .iter()
                .map(|f| low + ((base.arena_bytes.saturating_sub(low)) as f64 * f) as u64)
                .filter(|&r| r < base.arena_bytes)
                .map(|r| FitOptions {
                    budget: r,
                    ..FitOptions::default()
                })
                .collect()
        }
        Target::MaxSlowdown(_) => vec![FitOptions::default()],
    };
    let n = fits.len().max(1) as u32;
    for (i, mut f) in fits.into_iter().enumerate() {
        // A fit and its offload in what is left of the searches' time,
        // if a fair share is.
        let left = searches.saturating_duration_since(Instant::now());
        if left < time_limit.mul_f64(0.15) {
            break;
        }
        f.time_limit = left / (n - i as u32 + 1).max(1);
        let fitted = match opts.target {
            Target::Budget(_) => fit::fit(g, &f),
            Target::MaxSlowdown(s) => fit::fit_within(g, s / 2.0, &f),
        };
        let fitted = match fitted {
            Ok(x) => x,
            Err(Error::DoesNotFit(_)) => continue,
            Err(e) => return Err(e),
        };
        if fitted.recomputed.is_empty() {
            continue;
        }
        match offload(&fitted.graph, &fitted.plan, &own) {
            Ok(mut r) => {
                if let Target::MaxSlowdown(s) = opts.target
                    && r.timing.seconds > reference.seconds * (1.0 + s) * (1.0 + 1e-9)
                {
                    continue;
                }
                r.recomputed = fitted.recomputed.clone();
                r.arena_without_offload = base.arena_bytes;
                if best.as_ref().is_none_or(|b| better(&r, b)) {
                    best = Some(r);
                }
            }
            Err(e @ Error::DoesNotFit(_)) => last_err = Some(e),
            Err(e) => return Err(e),
        }
    }
    best.ok_or_else(|| last_err.unwrap_or_else(|| Error::DoesNotFit("nothing fits".into())))
}
