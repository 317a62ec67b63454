//! Host memory as a lever: which tensors leave the device for pinned host
//! memory, and when they come back, so a step fits a budget at the least
//! modeled time, or gets smallest within a share of added time.
//!
//! # The model
//! A device with its arithmetic and memory rates and a link to host memory
//! with a bandwidth each way and a latency ([`Device`], presets for H100
//! and H200 over PCIe 5, GH200 over NVLink-C2C, and the project's
//! development CPU). Ops take their roofline time; copies run on one
//! stream each way, overlapped with compute ([`timing`]'s rules). Every
//! result gives the device arena, the host pool, the modeled step time,
//! the compute time and the same figures without offload.
//!
//! # The decisions
//! On the order of a plan (the planner's, which places every update where
//! it frees memory soonest), [`choose`](self) picks which tensors go to the
//! host over which gaps between their uses: saved activations between the
//! forward and the backward pass, parameters and optimizer state (step
//! inputs, then homed on the host: copied in before each residency, the
//! last write copied back), anything idle long enough. The step with its
//! copies is a graph like any other ([`Offloaded::graph`]: copies are ops
//! `copy_to_host` / `copy_to_device`, host tensors have space `host`), laid
//! out by the allocator and checked by the independent checker, which
//! also checks that only copies touch host memory. The math is unchanged:
//! every value a compute op reads is the one it read before, copied out
//! and back.
//!
//! # Bounds
//! [`bound`]: no plan with offload needs fewer device bytes than the
//! largest op's working set (at any time), nor, within a modeled time,
//! than the no-offload floor less what the link can move in that time.
//!
//! # What it does not do yet
//! The order is not re-chosen around the copies; recomputation and
//! splitting are chosen before, not with, offload; the host optimizer
//! update (ZeRO-Offload's) is not a choice.

pub mod bound;
mod choose;
mod combine;
pub mod device;
mod rewrite;
pub mod timing;

use std::time::Instant;

use serde_json::json;

pub use bound::Bound;
pub use combine::fit_offload;
pub use device::{Device, PRESETS};
pub use timing::{Timing, simulate};

use crate::checker::{self, CheckReport};
use crate::error::Error;
use crate::graph::{COPY_TO_DEVICE, COPY_TO_HOST, Graph, OpId};
use crate::plan::Plan;
use crate::timeline::human;

use choose::{Chooser, Limits};

/// What to offload for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// The least modeled time with an arena of at most this many bytes.
    Budget(u64),
    /// The smallest arena whose modeled time is at most `1 + share` times
    /// the step's without offload.
    MaxSlowdown(f64),
}

/// How to offload.
#[derive(Clone, Debug)]
pub struct Options {
    pub device: Device,
    /// The most host memory the offloaded tensors may take at once.
    pub host_memory: Option<u64>,
    pub target: Target,
    /// Wall-clock deadline of the search (the best plan so far is kept).
    pub deadline: Option<Instant>,
    /// Seconds of the step's ops as captured (no recomputation, no
    /// copies), when the graph given is already rewritten (recomputed);
    /// else the graph's own compute time.
    pub compute_seconds: Option<f64>,
    /// The modeled time a slowdown is measured against (the step as
    /// given, before recomputation), if not the graph's own.
    pub reference_seconds: Option<f64>,
}

/// A plan with offload.
#[derive(Clone, Debug)]
pub struct Offloaded {
    /// The step with its copies; the plan's graph.
    pub graph: Graph,
    pub plan: Plan,
    pub check: CheckReport,
    pub device: String,
    /// The host pool: the most offloaded bytes live at once.
    pub host_bytes: u64,
    pub offloaded_tensors: usize,
    pub copies: usize,
    pub timing: Timing,
    /// The step's compute as captured.
    pub compute_seconds: f64,
    /// The plan without offload: its modeled time and arena.
    pub seconds_without_offload: f64,
    pub arena_without_offload: u64,
    /// No plan with offload (within the target's time, for a share) holds
    /// fewer device bytes.
    pub bound: Bound,
    /// The ops recomputed before offloading ([`fit_offload`]; names in
    /// the step as given).
    pub recomputed: Vec<String>,
}

impl Offloaded {
    /// The figures, as `memplan fit --offload --json` writes them under
    /// `"offload"`.
    pub fn summary_json(&self) -> serde_json::Value {
        json!({
            "device": self.device,
            "arena_bytes": self.plan.arena_bytes,
            "host_bytes": self.host_bytes,
            "offloaded_tensors": self.offloaded_tensors,
            "copies": self.copies,
            "to_host_bytes": self.timing.to_host_bytes,
            "to_device_bytes": self.timing.to_device_bytes,
            "modeled_seconds": self.timing.seconds,
            "compute_seconds": self.compute_seconds,
            "modeled_seconds_without_offload": self.seconds_without_offload,
            "arena_bytes_without_offload": self.arena_without_offload,
            "lower_bound_bytes": self.bound.bytes,
            "lower_bound_why": self.bound.why,
            "gap": self.plan.gap(),
            "recomputed_ops": self.recomputed.len(),
        })
    }
}

/// Offloads `g`, planned without offload as `base`, for `opts.target`
/// (module docs). A budget below the bound, or one the search cannot
/// reach, is [`Error::DoesNotFit`] with the bound.
pub fn offload(g: &Graph, base: &Plan, opts: &Options) -> Result<Offloaded, Error> {
    let t0 = simulate(g, &base.order, &opts.device);
    let run = Run {
        g,
        base,
        opts,
        compute: opts.compute_seconds.unwrap_or(t0.compute_seconds),
        without: opts.reference_seconds.unwrap_or(t0.seconds),
    };
    match opts.target {
        Target::Budget(b) => run.to_budget(b),
        Target::MaxSlowdown(share) => run.within(share),
    }
}

/// One offload of a planned step.
struct Run<'a> {
    g: &'a Graph,
    base: &'a Plan,
    opts: &'a Options,
    /// The step's compute as captured.
    compute: f64,
    /// The modeled time without offload a slowdown is measured against.
    without: f64,
}

impl Run<'_> {
    fn past(&self) -> bool {
        self.opts.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The least modeled time within `b` bytes of arena.
    fn to_budget(&self, b: u64) -> Result<Offloaded, Error> {
        let (g, base) = (self.g, self.base);
        let bound = bound::at_any_time(g);
        if b < bound.bytes {
            return Err(Error::DoesNotFit(format!(
                "nothing fits {} even with everything else on the host: {} (the bound at any link speed)",
                human(b),
                bound.why
            )));
        }
        if base.arena_bytes <= b {
            return self.finish((g.clone(), base.order.clone()), base.clone(), 0, bound);
        }
        let mut ch = Chooser::new(g, &base.order, &self.opts.device);
        let mut target = b;
        for _ in 0..8 {
            let lim = Limits {
                target,
                stall: None,
                host_bytes: self.opts.host_memory,
            };
            while ch.improve_many(&lim) && !self.past() {}
            let (peak, _) = ch.peak();
            let cut = if self.past() {
                " (the time limit cut the search short)"
            } else {
                ""
            };
            if peak > b {
                let host = self
                    .opts
                    .host_memory
                    .map(|h| format!(" with at most {} of host memory", human(h)))
                    .unwrap_or_default();
                return Err(Error::DoesNotFit(format!(
                    "no offload found{host} fits {}: the best reaches {} live on the device{cut}; the bound is {} ({})",
                    human(b),
                    human(peak),
                    human(bound.bytes),
                    bound.why
                )));
            }
            let rewritten = rewrite::rewrite(g, &base.order, &ch.cands, &ch.decisions, &ch.plans)?;
            let plan = crate::baselines::order_with_layout(&rewritten.0, &rewritten.1, "offload");
            if plan.arena_bytes <= b {
                return self.finish(rewritten, plan, ch.offloaded(), bound);
            }
            if self.past() {
                return Err(Error::DoesNotFit(format!(
                    "no offload found fits {}: the best needs {} live on the device, but its layout takes {}{cut}; the bound is {} ({})",
                    human(b),
                    human(peak),
                    human(plan.arena_bytes),
                    human(bound.bytes),
                    bound.why
                )));
            }
            // The layout needs more than max live: ask for less.
            target = target.saturating_sub(plan.arena_bytes - b);
        }
        Err(Error::DoesNotFit(format!(
            "no layout of the offloaded step fits {}; the bound is {} ({})",
            human(b),
            human(bound.bytes),
            bound.why
        )))
    }

    /// The smallest arena within `1 + share` of the modeled time without
    /// offload.
    fn within(&self, share: f64) -> Result<Offloaded, Error> {
        let (g, base) = (self.g, self.base);
        if !(share.is_finite() && share >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "the slowdown must be a share of at least 0, got {share}"
            )));
        }
        let allowed = self.without * (1.0 + share);
        let bound = bound::within(g, base.stats.lower_bound_bytes, allowed, &self.opts.device);
        let mut ch = Chooser::new(g, &base.order, &self.opts.device);
        // The estimate's stall may exceed the share (it does not know the
        // copy streams' queues); the simulation decides.
        let lim = Limits {
            target: 0,
            stall: Some(2.0 * share * self.without),
            host_bytes: self.opts.host_memory,
        };
        while ch.improve_within(&lim, allowed * (1.0 + 1e-9)) && !self.past() {}
        if ch.offloaded() > 0 {
            let rewritten = rewrite::rewrite(g, &base.order, &ch.cands, &ch.decisions, &ch.plans)?;
            let plan = crate::baselines::order_with_layout(&rewritten.0, &rewritten.1, "offload");
            if plan.arena_bytes < base.arena_bytes {
                return self.finish(rewritten, plan, ch.offloaded(), bound);
            }
        }
        self.finish((g.clone(), base.order.clone()), base.clone(), 0, bound)
    }

    /// The result: checked, timed, with the figures without offload.
    fn finish(
        &self,
        (graph, order): (Graph, Vec<OpId>),
        mut plan: Plan,
        offloaded_tensors: usize,
        bound: Bound,
    ) -> Result<Offloaded, Error> {
        plan.stats.lower_bound_bytes = bound.bytes;
        plan.stats.lower_bound_kind = match self.opts.target {
            Target::Budget(_) => "offload-working-set".into(),
            Target::MaxSlowdown(_) => "offload-within-time".into(),
        };
        let check = checker::check(&graph, &plan)
            .map_err(|e| Error::Internal(format!("the offloaded plan fails the checker: {e}")))?;
        let timing = simulate(&graph, &order, &self.opts.device);
        let copies = graph
            .ops()
            .iter()
            .filter(|o| o.op_type == COPY_TO_HOST || o.op_type == COPY_TO_DEVICE)
            .count();
        Ok(Offloaded {
            device: self.opts.device.name.clone(),
            host_bytes: check.host_max_live_bytes,
            check,
            graph,
            plan,
            offloaded_tensors,
            copies,
            timing,
            compute_seconds: self.compute,
            seconds_without_offload: self.without,
            arena_without_offload: self.base.arena_bytes,
            bound,
            recomputed: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests;
