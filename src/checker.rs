//! The plan checker: an independent judge of any plan against its graph.
//!
//! It shares no code with the planners (solver, allocator, pipeline): it
//! recomputes every lifetime from the graph and the plan's order with its own
//! simple rules, then verifies
//! 1. the order holds every op exactly once and respects every dependency
//!    ([`Graph::deps`]: data, views, `after`, in-place ordering);
//! 2. every tensor that occupies memory has an offset at its alignment, inside
//!    the arena, and no other tensor has one;
//! 3. every claimed reuse is legal: the op that produces the output declared
//!    the hint, it is the input's last use, the input is not persistent, the
//!    output lies within the input's bytes, and each tensor takes part in at
//!    most one reuse on each side;
//! 4. no two tensors live at the same step share a byte, unless they are a
//!    claimed reuse pair meeting at the reusing op's step. Persistent tensors
//!    are live to the end of the step, so nothing may take their bytes.
//! 5. host memory (offload) is reached by copies alone: a tensor in host
//!    memory has no offset in the arena; every op that names one is a copy
//!    to the host (one device input, one host output or update of its
//!    size) or to the device (one host input, one device output of its
//!    size); a host tensor a copy reads was written before it (or is a step
//!    input). The host pool's max live bytes is reported beside the
//!    arena's.
//!
//! Lifetimes, in steps (closed intervals): birth = producer's step or 0;
//! death = last step of any op that reads, updates, or reads/makes a view of
//! the tensor's bytes; the final step if persistent; the birth if unused.
//! The sweep works in half-steps so a reuse pair can meet inside one step: a
//! reused input ends in the first half of the reusing op's step and the output
//! starts in the second half.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet};
use std::fmt;

// The error type lives with the crate's other errors (`crate::error`), so
// `Error` wraps it without depending on the checker.
pub use crate::error::CheckError;
use crate::graph::{COPY_TO_DEVICE, COPY_TO_HOST, Graph, Lifetime, OpId, Space, TensorId};
use crate::plan::Plan;

/// A summary of a plan that passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckReport {
    /// The most bytes live at one step, recomputed by the checker.
    pub max_live_bytes: u64,
    /// The highest byte any tensor reaches (≤ the arena).
    pub used_bytes: u64,
    /// The most bytes of host memory (offloaded tensors) live at one step.
    pub host_max_live_bytes: u64,
    pub ops: usize,
    pub tensors_placed: usize,
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "plan is valid: {} ops, {} tensors placed, max live {} bytes, highest byte used {}",
            self.ops, self.tensors_placed, self.max_live_bytes, self.used_bytes
        )?;
        if self.host_max_live_bytes > 0 {
            write!(
                f,
                ", host memory {} bytes at most",
                self.host_max_live_bytes
            )?;
        }
        Ok(())
    }
}

/// Checks `plan` against `graph`; see the module docs for every rule.
pub fn check(graph: &Graph, plan: &Plan) -> Result<CheckReport, CheckError> {
    let c = Checker { graph, plan };
    let step = c.steps()?;
    let (used_bytes, tensors_placed) = c.offsets()?;
    let life = c.lifetimes(&step);
    let reuses = c.reuses(&step, &life)?;
    let max_live_bytes = c.sweep(&life, &reuses)?;
    let host_max_live_bytes = c.host(&step, &life)?;
    Ok(CheckReport {
        max_live_bytes,
        used_bytes,
        host_max_live_bytes,
        ops: graph.num_ops(),
        tensors_placed,
    })
}

/// A plan under check, and each rule of the module docs as a method.
struct Checker<'a> {
    graph: &'a Graph,
    plan: &'a Plan,
}

/// Closed lifetimes in steps, per tensor (roots carry their views' uses).
struct Lifetimes {
    birth: Vec<usize>,
    death: Vec<usize>,
}

/// The claimed reuses that passed: inputs that end early, outputs that
/// start late (each tensor at most once on each side).
struct Reuses {
    inputs: HashSet<TensorId>,
    outputs: HashSet<TensorId>,
}

impl Checker<'_> {
    fn name(&self, t: TensorId) -> String {
        self.graph.tensor(t).name.clone()
    }
    fn op_name(&self, o: OpId) -> String {
        self.graph.op(o).name.clone()
    }
    /// The root of `t`'s view chain, walked here rather than taken from
    /// the graph.
    fn root_of(&self, mut t: TensorId) -> TensorId {
        while let Some(b) = self.graph.tensor(t).view_of {
            t = b;
        }
        t
    }
    /// Whether `t` occupies arena memory: not a view, not empty, not in
    /// host memory.
    fn owns(&self, t: TensorId) -> bool {
        let x = self.graph.tensor(t);
        x.view_of.is_none() && x.size > 0 && x.space == Space::Device
    }
    /// Whether `t`'s bytes are in host memory (its root's space).
    fn in_host(&self, t: TensorId) -> bool {
        self.graph.tensor(self.root_of(t)).space == Space::Host
    }

    /// Rule 1: every op once, after every op it depends on. The step of
    /// each op.
    fn steps(&self) -> Result<Vec<usize>, CheckError> {
        let (graph, order) = (self.graph, &self.plan.order);
        let n = graph.num_ops();
        if order.len() != n {
            return Err(CheckError::OrderLength {
                got: order.len(),
                want: n,
            });
        }
        let mut step = vec![usize::MAX; n];
        for (i, &o) in order.iter().enumerate() {
            if o.index() >= n {
                return Err(CheckError::UnknownOp(o.0));
            }
            if step[o.index()] != usize::MAX {
                return Err(CheckError::DuplicateOp(self.op_name(o)));
            }
            step[o.index()] = i;
        }
        for o in graph.op_ids() {
            if let Some(&d) = graph
                .deps(o)
                .iter()
                .find(|d| step[d.index()] >= step[o.index()])
            {
                return Err(CheckError::Dependency {
                    op: self.op_name(o),
                    dep: self.op_name(d),
                    op_step: step[o.index()],
                    dep_step: step[d.index()],
                });
            }
        }
        Ok(step)
    }

    /// Rule 2: an aligned offset inside the arena for exactly the tensors
    /// that own bytes. The highest byte used and the number placed.
    fn offsets(&self) -> Result<(u64, usize), CheckError> {
        let (graph, plan) = (self.graph, self.plan);
        if plan.offsets.len() != graph.num_tensors() {
            return Err(CheckError::OffsetsLength {
                got: plan.offsets.len(),
                want: graph.num_tensors(),
            });
        }
        let mut used = 0u64;
        let mut placed = 0;
        for t in graph.tensor_ids() {
            let x = graph.tensor(t);
            let off = match (self.owns(t), plan.offsets[t.index()]) {
                (true, None) => return Err(CheckError::MissingOffset(self.name(t))),
                (false, Some(_)) => return Err(CheckError::NeedlessOffset(self.name(t))),
                (false, None) => continue,
                (true, Some(off)) => off,
            };
            if off % x.align.max(1) != 0 {
                return Err(CheckError::Misaligned {
                    tensor: self.name(t),
                    offset: off,
                    align: x.align,
                });
            }
            let end = off as u128 + x.size as u128;
            if end > plan.arena_bytes as u128 {
                return Err(CheckError::OutsideArena {
                    tensor: self.name(t),
                    offset: off,
                    end,
                    arena: plan.arena_bytes,
                });
            }
            used = used.max(end as u64);
            placed += 1;
        }
        Ok((used, placed))
    }

    /// Lifetimes from the graph's ops directly (module docs).
    fn lifetimes(&self, step: &[usize]) -> Lifetimes {
        let graph = self.graph;
        let nt = graph.num_tensors();
        let last = graph.num_ops().saturating_sub(1);
        let mut birth = vec![0usize; nt];
        let mut death = vec![0usize; nt];
        let mut seen_use = vec![false; nt];
        let mut touch = |t: TensorId, s: usize| {
            let r = self.root_of(t).index();
            death[r] = death[r].max(s);
            seen_use[r] = true;
        };
        for o in graph.op_ids() {
            let s = step[o.index()];
            let op = graph.op(o);
            for &t in &op.outputs {
                if graph.tensor(t).view_of.is_none() {
                    birth[t.index()] = s;
                } else {
                    touch(t, s);
                }
            }
            for &t in op.inputs.iter().chain(&op.updates) {
                touch(t, s);
            }
        }
        for t in graph.tensor_ids() {
            let i = t.index();
            if graph.tensor(t).lifetime == Lifetime::Persistent {
                death[i] = last;
            } else if !seen_use[i] || death[i] < birth[i] {
                death[i] = birth[i];
            }
        }
        Lifetimes { birth, death }
    }

    /// Rule 3: every claimed reuse is declared, at the input's last use, of
    /// a transient input, inside its bytes, and each tensor in one at most.
    fn reuses(&self, step: &[usize], life: &Lifetimes) -> Result<Reuses, CheckError> {
        let (graph, plan) = (self.graph, self.plan);
        let nt = graph.num_tensors();
        let mut r = Reuses {
            inputs: HashSet::new(),
            outputs: HashSet::new(),
        };
        let label = |t: TensorId| {
            if t.index() < nt {
                self.name(t)
            } else {
                t.to_string()
            }
        };
        for &(out, inp) in &plan.reuses {
            let bad = |why: &str| CheckError::BadReuse {
                output: label(out),
                input: label(inp),
                why: why.to_string(),
            };
            if out.index() >= nt || inp.index() >= nt {
                return Err(bad("unknown tensor"));
            }
            if !self.owns(out) || !self.owns(inp) {
                return Err(bad("both tensors must own bytes"));
            }
            let Some(op) = graph.tensor(out).producer else {
                return Err(bad("the output has no producer"));
            };
            let declared = graph
                .op(op)
                .reuse
                .iter()
                .any(|&(o, i)| o == out && self.root_of(i) == inp);
            if !declared {
                return Err(bad("its producer declares no such reuse hint"));
            }
            if graph.tensor(inp).lifetime == Lifetime::Persistent {
                return Err(bad("the input is persistent"));
            }
            if life.death[inp.index()] != step[op.index()] {
                return Err(bad(&format!(
                    "the input's last use is at step {}, not at the reusing op's step {}",
                    life.death[inp.index()],
                    step[op.index()]
                )));
            }
            let oo = plan.offsets[out.index()].unwrap_or(0);
            let io = plan.offsets[inp.index()].unwrap_or(0);
            if oo < io || oo + graph.tensor(out).size > io + graph.tensor(inp).size {
                return Err(bad("the output does not lie within the input's bytes"));
            }
            if !r.inputs.insert(inp) || !r.outputs.insert(out) {
                return Err(bad("a tensor takes part in two reuses"));
            }
        }
        Ok(r)
    }

    /// Rule 5: only copies reach host memory, each between the two spaces
    /// with equal sizes, reading host bytes written earlier. The host
    /// pool's max live bytes.
    fn host(&self, step: &[usize], life: &Lifetimes) -> Result<u64, CheckError> {
        let graph = self.graph;
        let bad = |o: OpId, why: String| CheckError::BadCopy {
            op: self.op_name(o),
            why,
        };
        let mut written = vec![usize::MAX; graph.num_tensors()];
        for o in graph.op_ids() {
            for &t in graph.op(o).outputs.iter().chain(&graph.op(o).updates) {
                let w = &mut written[self.root_of(t).index()];
                *w = (*w).min(step[o.index()]);
            }
        }
        for o in graph.op_ids() {
            let op = graph.op(o);
            let size = |t: TensorId| graph.tensor(t).size;
            let named: Vec<TensorId> = op
                .inputs
                .iter()
                .chain(&op.outputs)
                .chain(&op.updates)
                .copied()
                .collect();
            match op.op_type.as_str() {
                COPY_TO_HOST => {
                    let dst: Vec<TensorId> =
                        op.outputs.iter().chain(&op.updates).copied().collect();
                    let [src] = op.inputs[..] else {
                        return Err(bad(
                            o,
                            format!("reads {} tensors, not one", op.inputs.len()),
                        ));
                    };
                    let [dst] = dst[..] else {
                        return Err(bad(o, format!("writes {} tensors, not one", dst.len())));
                    };
                    if self.in_host(src) || !self.in_host(dst) || size(src) != size(dst) {
                        return Err(bad(
                            o,
                            "does not copy a device tensor into a host tensor of its size".into(),
                        ));
                    }
                }
                COPY_TO_DEVICE => {
                    let ([src], [dst], []) = (&op.inputs[..], &op.outputs[..], &op.updates[..])
                    else {
                        return Err(bad(o, "does not read one tensor and write one".into()));
                    };
                    if !self.in_host(*src) || self.in_host(*dst) || size(*src) != size(*dst) {
                        return Err(bad(
                            o,
                            "does not copy a host tensor into a device tensor of its size".into(),
                        ));
                    }
                    let r = self.root_of(*src);
                    let from_start = graph.tensor(r).producer.is_none();
                    if !from_start && written[r.index()] >= step[o.index()] {
                        return Err(bad(
                            o,
                            format!(
                                "reads host tensor {:?} before anything writes it",
                                self.name(r)
                            ),
                        ));
                    }
                }
                _ => {
                    if let Some(&t) = named.iter().find(|&&t| self.in_host(t)) {
                        return Err(bad(
                            o,
                            format!(
                                "names host tensor {:?}; only copies reach host memory",
                                self.name(t)
                            ),
                        ));
                    }
                }
            }
        }
        let mut delta = vec![0i128; graph.num_ops().max(1) + 1];
        for t in graph.tensor_ids() {
            let x = graph.tensor(t);
            if x.space == Space::Host && x.view_of.is_none() {
                delta[life.birth[t.index()]] += x.size as i128;
                delta[life.death[t.index()] + 1] -= x.size as i128;
            }
        }
        let (mut cur, mut max) = (0i128, 0i128);
        for d in delta {
            cur += d;
            max = max.max(cur);
        }
        Ok(max as u64)
    }

    /// Rule 4: a sweep in half-steps over the intervals
    /// `[2·birth, 2·death + 2)`, a reused input ending one half early and
    /// its output starting one half late, with the live tensors kept by
    /// address; a newcomer may not touch its neighbours. Returns the max
    /// live bytes (a reuse pair counts once in each half).
    fn sweep(&self, life: &Lifetimes, reuses: &Reuses) -> Result<u64, CheckError> {
        let (graph, plan) = (self.graph, self.plan);
        let mut iv: Vec<(u64, u64, TensorId)> = graph
            .tensor_ids()
            .filter(|&t| self.owns(t))
            .map(|t| {
                let lo = 2 * life.birth[t.index()] as u64 + reuses.outputs.contains(&t) as u64;
                let hi = 2 * life.death[t.index()] as u64 + 2 - reuses.inputs.contains(&t) as u64;
                (lo, hi, t)
            })
            .collect();
        iv.sort_unstable();
        let mut by_addr: BTreeMap<(u64, u32), TensorId> = BTreeMap::new();
        let mut ends: BinaryHeap<Reverse<(u64, u64, u32)>> = BinaryHeap::new();
        let mut delta = vec![0i128; 2 * graph.num_ops().max(1) + 3];
        for &(lo, hi, t) in &iv {
            while let Some(&Reverse((h, off, id))) = ends.peek()
                && h <= lo
            {
                ends.pop();
                by_addr.remove(&(off, id));
            }
            let off = plan.offsets[t.index()].unwrap_or(0);
            let size = graph.tensor(t).size;
            let end = off + size;
            let clash = |other: TensorId| {
                let oo = plan.offsets[other.index()].unwrap_or(0);
                CheckError::Overlap {
                    a: self.name(other),
                    a_off: oo,
                    a_end: oo + graph.tensor(other).size,
                    b: self.name(t),
                    b_off: off,
                    b_end: end,
                    step: (lo / 2) as usize,
                }
            };
            if let Some((&(o, _), &other)) = by_addr.range(..=(off, u32::MAX)).next_back()
                && o + graph.tensor(other).size > off
            {
                return Err(clash(other));
            }
            if let Some((&(o, _), &other)) = by_addr.range((off, 0)..).next()
                && o < end
            {
                return Err(clash(other));
            }
            by_addr.insert((off, t.0), t);
            ends.push(Reverse((hi, off, t.0)));
            delta[lo as usize] += size as i128;
            delta[hi as usize] -= size as i128;
        }
        let mut cur = 0i128;
        let mut max_live = 0i128;
        for d in delta {
            cur += d;
            max_live = max_live.max(cur);
        }
        Ok(max_live as u64)
    }
}
