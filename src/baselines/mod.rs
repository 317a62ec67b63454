//! What a user gets without memplan, measured on the same graph:
//! - `pytorch-reserved`: program order through a simulation of PyTorch's
//!   CUDA caching allocator ([`caching`]): the reserved memory a PyTorch eager
//!   user sees (`max_memory_reserved`), with the scratch PyTorch's eager ops
//!   allocate inside the graph's fused ones ([`eager_scratch_bytes`]);
//! - `pytorch-expandable-segments`: the same with
//!   `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (reserved), which
//!   torchtitan sets;
//! - `eager-optimizer-in-backward` and
//!   `eager-optimizer-in-backward-expandable-segments`: program order with
//!   each parameter's update moved to right after its gradient is complete
//!   ([`optimizer_in_backward_order`]), as torchtune's optimizer-in-backward
//!   runs it through `register_post_accumulate_grad_hook`, through the
//!   simulated allocator with default settings and with expandable
//!   segments (reserved);
//! - `program-order`: the max live bytes of program order, no reuse
//!   (PyTorch's `max_memory_allocated` without the 512-byte rounding);
//! - `program-order+greedy`: program order laid out by greedy-by-size
//!   offsets, no reuse: a static arena for the eager order;
//! - for every extra order the graph carries (e.g. `xla-order`): that order
//!   with reuses and memplan's layout, named `<order>+memplan-layout`;
//! - every peak another tool reported for the step (e.g. `xla`), as is.
//!
//! "Program order" is the eager order: the graph's own, except for a
//! sharded step captured by `memplan.torch`, whose collectives sit where
//! capture met them; there every baseline above runs FSDP2 eager's order
//! ([`fsdp_eager`]).

pub mod caching;
pub mod fsdp_eager;
pub mod xla_estimate;

use std::time::Instant;

use memplan_allocator as alloc;
use memplan_solver as solver;
use serde::Serialize;

use crate::graph::{Graph, Lifetime, OpId, OpKind};
use crate::lower::{self, Lowered};
use crate::plan::{Plan, PlanStats};

/// One baseline's figure.
#[derive(Clone, Debug, PartialEq)]
pub struct Baseline {
    pub name: String,
    /// The memory the configuration holds at its worst: an arena for a
    /// layout, a caching allocator's reserved (or allocated) bytes, max
    /// live bytes for an order alone. Not "peak", which means max live.
    pub footprint_bytes: u64,
    pub description: String,
}

impl Baseline {
    /// The old name of [`Baseline::footprint_bytes`].
    #[deprecated(since = "0.1.0", note = "use `footprint_bytes`")]
    pub fn peak_bytes(&self) -> u64 {
        self.footprint_bytes
    }
}

/// `{"name", "footprint_bytes", "peak_bytes", "description"}`:
/// `peak_bytes`, the old name of `footprint_bytes`, is written for one more
/// release.
impl Serialize for Baseline {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut m = s.serialize_struct("Baseline", 4)?;
        m.serialize_field("name", &self.name)?;
        m.serialize_field("footprint_bytes", &self.footprint_bytes)?;
        m.serialize_field("peak_bytes", &self.footprint_bytes)?;
        m.serialize_field("description", &self.description)?;
        m.end()
    }
}

/// Program order without reuse, laid out greedily by size.
pub fn program_order_greedy(g: &Graph) -> Plan {
    order_greedy(g, g.program_order())
}

/// [`program_order_greedy`], given up (`None`) once `deadline` passes:
/// its greedy layout is quadratic in the buffers in the worst case (ten
/// minutes at 200,000).
pub fn program_order_greedy_until(g: &Graph, deadline: Option<Instant>) -> Option<Plan> {
    order_greedy_until(g, g.program_order(), deadline)
}

/// `order` without reuse, laid out greedily by size.
pub fn order_greedy(g: &Graph, order: &[OpId]) -> Plan {
    order_greedy_until(g, order, None).expect("no deadline")
}

/// [`order_greedy`] within `deadline`.
fn order_greedy_until(g: &Graph, order: &[OpId], deadline: Option<Instant>) -> Option<Plan> {
    let low = lower::lower(g, false);
    let order = Lowered::from_op_ids(order);
    let ev = solver::evaluate(&low.problem, &order);
    let lp = lower::layout_problem(g, &low, &ev);
    let sol = alloc::greedy_by_size_until(&lp.problem, deadline)?;
    Some(lower::assemble(
        g,
        &low,
        &order,
        &ev,
        &lp,
        &sol,
        PlanStats {
            order_source: "program-order".into(),
            layout_source: "greedy-by-size".into(),
            ..Default::default()
        },
    ))
}

/// Max live bytes of program order, without reuse.
pub fn program_order_max_live(g: &Graph) -> u64 {
    order_max_live(g, g.program_order())
}

/// Max live bytes of `order`, without reuse.
pub fn order_max_live(g: &Graph, order: &[OpId]) -> u64 {
    order_max_live_holding(g, order, &[])
}

/// Max live bytes of `order`, without reuse, with the bytes of `held`
/// (buffers outside the graph, e.g. FSDP2's flat ones) on top.
pub fn order_max_live_holding(g: &Graph, order: &[OpId], held: &[fsdp_eager::Held]) -> u64 {
    let low = lower::lower(g, false);
    let p = &low.problem;
    let lowered = Lowered::from_op_ids(order);
    let ev = solver::evaluate(p, &lowered);
    if held.is_empty() || order.is_empty() {
        return ev.peak;
    }
    // Live bytes at each half-step: before op i's outputs, after them.
    let mut extra = vec![0i128; 2 * order.len() + 1];
    // A span past the order's end is cut at it (spans come from
    // `fsdp_eager::flat_buffers`, which stays inside).
    let last = 2 * order.len() - 1;
    for h in held.iter().filter(|h| h.from <= h.to && h.from <= last) {
        extra[h.from] += i128::from(h.bytes);
        extra[h.to.min(last) + 1] -= i128::from(h.bytes);
    }
    let mut on_top = 0i128;
    let mut peak = 0u64;
    for (i, &op) in lowered.iter().enumerate() {
        let born: u64 = p.outputs(op).map(|b| p.size(b)).sum();
        for (half, live) in [(2 * i, ev.curve[i] - born), (2 * i + 1, ev.curve[i])] {
            on_top += extra[half];
            peak = peak.max(live + u64::try_from(on_top).unwrap_or(0));
        }
    }
    peak
}

/// The order an eager user runs `g` in, and its name: FSDP2 eager's
/// ([`fsdp_eager::eager_order`], all-gathers issued as `prefetch` says)
/// for a captured sharded step, else the program order.
pub fn eager_order(
    g: &Graph,
    prefetch: fsdp_eager::Prefetch,
) -> (std::borrow::Cow<'_, [OpId]>, String) {
    match fsdp_eager::eager_order(g, prefetch) {
        Some(o) => (
            o.into(),
            format!(
                "FSDP2 eager order (gathers {} unit(s) ahead in the forward, {} in the backward)",
                prefetch.forward, prefetch.backward
            ),
        ),
        None => (g.program_order().into(), "program order".into()),
    }
}

/// The baselines that are a configuration of PyTorch eager a user can run
/// (reserved memory, simulated): the strongest of them is the one memplan
/// is measured against ([`best_eager`]).
pub const EAGER: [&str; 4] = [
    "pytorch-reserved",
    "pytorch-expandable-segments",
    "eager-optimizer-in-backward",
    "eager-optimizer-in-backward-expandable-segments",
];

/// The eager configuration ([`EAGER`]) that needs the least, if `base` has
/// any; the first listed wins a tie.
pub fn best_eager(base: &[Baseline]) -> Option<&Baseline> {
    EAGER
        .iter()
        .filter_map(|n| base.iter().find(|b| b.name == *n))
        .min_by_key(|b| b.footprint_bytes)
}

/// Runs program order through the caching-allocator simulation (default
/// settings).
pub fn pytorch_caching(g: &Graph) -> caching::CachingStats {
    eager_caching(g, g.program_order(), false)
}

/// Program order with every optimizer op moved to right after its last
/// dependency: each parameter's update runs as soon as its gradient is
/// complete (and, in a sharded step, reduced), as torchtune's
/// optimizer-in-backward runs it from `register_post_accumulate_grad_hook`.
/// Every other op keeps its place; optimizer ops ready at the same point
/// keep their program order. Where the updates read a global value, such
/// as the gradient norm for clipping, they wait for it, which leaves them
/// at the end of the backward (torchtune refuses clipping with
/// optimizer-in-backward for that reason).
pub fn optimizer_in_backward_order(g: &Graph) -> Vec<OpId> {
    optimizer_in_backward_of(g, g.program_order())
}

/// [`optimizer_in_backward_order`] starting from `program` (a valid order
/// of `g`) instead of the program order.
pub fn optimizer_in_backward_of(g: &Graph, program: &[OpId]) -> Vec<OpId> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let n = g.num_ops();
    let mut position = vec![0usize; n];
    for (i, &o) in program.iter().enumerate() {
        position[o.index()] = i;
    }
    let moved = |o: OpId| g.op(o).kind == OpKind::Optimizer;
    // Unfinished dependencies of each optimizer op, and who waits on whom.
    let mut missing = vec![0usize; n];
    let mut waiting: Vec<Vec<OpId>> = vec![Vec::new(); n];
    let mut ready = BinaryHeap::new();
    for o in g.op_ids().filter(|&o| moved(o)) {
        missing[o.index()] = g.deps(o).len();
        for &d in g.deps(o) {
            waiting[d.index()].push(o);
        }
        if missing[o.index()] == 0 {
            ready.push(Reverse(position[o.index()]));
        }
    }
    // An optimizer op as soon as it is ready, else the next other op in
    // program order. Every optimizer op before an op in program order is
    // out by the time that op comes: its dependencies precede it there.
    let mut rest = program.iter().copied().filter(|&o| !moved(o));
    let mut order = Vec::with_capacity(n);
    loop {
        let o = match ready.pop() {
            Some(Reverse(i)) => program[i],
            None => match rest.next() {
                Some(o) => o,
                None => break,
            },
        };
        order.push(o);
        for &w in &waiting[o.index()] {
            missing[w.index()] -= 1;
            if missing[w.index()] == 0 {
                ready.push(Reverse(position[w.index()]));
            }
        }
    }
    debug_assert_eq!(order.len(), n);
    order
}

/// Runs `order` (a valid order of `g`) through the caching-allocator
/// simulation, with expandable segments or PyTorch's default settings.
pub fn eager_caching(g: &Graph, order: &[OpId], expandable: bool) -> caching::CachingStats {
    eager_caching_holding(g, order, expandable, &[])
}

/// [`eager_caching`] with the buffers of `held` (outside the graph, e.g.
/// FSDP2's flat ones) allocated over their spans, on the default stream.
pub fn eager_caching_holding(
    g: &Graph,
    order: &[OpId],
    expandable: bool,
    held: &[fsdp_eager::Held],
) -> caching::CachingStats {
    let low = lower::lower(g, false);
    let p = &low.problem;
    let order = Lowered::from_op_ids(order);
    let ev = solver::evaluate(p, &order);
    let mut a = if expandable {
        caching::CachingAllocator::expandable()
    } else {
        caching::CachingAllocator::new()
    };
    let mut handle = vec![None; p.num_bufs()];
    // Step inputs exist before the step: allocate them first, in order.
    for b in p.buf_ids() {
        if p.buf(b).producer.is_none() {
            handle[b.index()] = Some(a.malloc(p.size(b)));
        }
    }
    // Frees per step.
    let mut dies_at: Vec<Vec<solver::BufIdx>> = vec![Vec::new(); order.len()];
    for b in p.buf_ids() {
        let t = g.tensor(low.tensor_of_buf[b.index()]);
        if t.lifetime != Lifetime::Persistent {
            dies_at[ev.death[b.index()] as usize].push(b);
        }
    }
    // Held buffers starting and ending at each half-step.
    let mut starts: Vec<Vec<usize>> = vec![Vec::new(); 2 * order.len()];
    let mut ends: Vec<Vec<usize>> = vec![Vec::new(); 2 * order.len()];
    let halves = ends.len();
    for (j, h) in held.iter().enumerate() {
        if h.from <= h.to && h.from < halves {
            starts[h.from].push(j);
            ends[h.to.min(halves - 1)].push(j);
        }
    }
    let mut held_handle = vec![None; held.len()];
    let mut half_step = |a: &mut caching::CachingAllocator, half: usize| {
        for &j in &starts[half] {
            held_handle[j] = Some(a.malloc(held[j].bytes));
        }
        for &j in &ends[half] {
            if let Some(h) = held_handle[j].take() {
                a.free(h);
            }
        }
    };
    for (i, &op) in order.iter().enumerate() {
        // Blocks are cached per stream: an op's outputs come from its own.
        let o = g.op(OpId(op.0));
        let stream = o.stream;
        half_step(&mut a, 2 * i);
        let scratch = eager_scratch_bytes(o).map(|n| a.malloc_on(n, stream));
        for b in p.outputs(op) {
            handle[b.index()] = Some(a.malloc_on(p.size(b), stream));
        }
        half_step(&mut a, 2 * i + 1);
        if let Some(h) = scratch {
            a.free(h);
        }
        for &b in &dies_at[i] {
            if let Some(h) = handle[b.index()].take() {
                a.free(h);
            }
        }
    }
    a.stats
}

/// Bytes PyTorch eager allocates inside one of the built-in graphs' fused
/// ops beyond the op's outputs, held while the op runs and freed after it.
///
/// `F.cross_entropy` is `log_softmax` then `nll_loss`, in float32 (also
/// under autocast): the forward makes the `[rows, classes]` log-probabilities
/// while the logits are still alive (they replace the logits as what the
/// backward reads), and the backward makes `nll_loss_backward`'s
/// `[rows, classes]` gradient, alive while `_log_softmax_backward_data`
/// writes the logits' gradient. The graph's `cross_entropy` /
/// `cross_entropy_backward` ops hold neither. Measured against the real
/// step on the CPU (tools/torch_eager_llama.py --allocator-peak): at the
/// loss backward, where llama-tiny's eager peak is, PyTorch holds three
/// `[rows, classes]` float32 tensors and the graph two.
pub fn eager_scratch_bytes(op: &crate::graph::Op) -> Option<u64> {
    match op.op_type.as_str() {
        "cross_entropy" | "cross_entropy_backward" => {
            let rows = op.attrs.get("rows")?.as_u64()?;
            let classes = op.attrs.get("classes")?.as_u64()?;
            Some(rows * classes * 4)
        }
        _ => None,
    }
}

/// Every baseline for `g`, with its figure (a captured sharded step run
/// by FSDP2 eager as on CUDA).
pub fn all(g: &Graph) -> Vec<Baseline> {
    all_with(g, fsdp_eager::Device::CUDA)
}

/// [`all`], a captured sharded step run by FSDP2 eager as on `device`:
/// its order prefetching as the device does, with FSDP2's flat buffers
/// ([`fsdp_eager::flat_buffers`]) in every eager figure but
/// `program-order+greedy` (a layout of the graph's own tensors).
pub fn all_with(g: &Graph, device: fsdp_eager::Device) -> Vec<Baseline> {
    let run = EagerRun::new(g, device);
    let mut out = run.configurations();
    let (eager, what, held) = (&run.order, &run.what, &run.held);
    out.extend([
        Baseline {
            name: "program-order".into(),
            footprint_bytes: order_max_live_holding(g, eager, held),
            description: format!("{what}, max live bytes (no layout loss)"),
        },
        Baseline {
            name: "program-order+greedy".into(),
            footprint_bytes: order_greedy(g, eager).arena_bytes,
            description: format!("{what} + greedy-by-size offsets"),
        },
    ]);
    for (name, order) in &g.extra_orders {
        out.push(Baseline {
            name: format!("{name}+memplan-layout"),
            footprint_bytes: order_with_layout(g, order, name).arena_bytes,
            description: format!("the graph's {name} order, laid out by memplan"),
        });
        // An HLO module imported with XLA's allocations: what XLA's buffer
        // assignment is estimated to need for that order.
        if let Some(e) = xla_estimate::estimate(g, order) {
            out.push(Baseline {
                name: format!("{name}, xla-estimate"),
                footprint_bytes: e.total,
                description: format!(
                    "the graph's {name} order, XLA's total bytes as memplan estimates them"
                ),
            });
        }
    }
    for (name, bytes) in &g.reference_peaks {
        out.push(Baseline {
            name: name.clone(),
            footprint_bytes: *bytes,
            description: format!("{name}: as reported by the tool that made the graph"),
        });
    }
    out
}

/// PyTorch eager's configurations of `g` ([`EAGER`], and
/// `pytorch-allocated`), as [`all`] figures them, without the other
/// baselines: what [`crate::batch::max_batch`] probes at every batch.
pub fn eager_configurations(g: &Graph) -> Vec<Baseline> {
    EagerRun::new(g, fsdp_eager::Device::CUDA).configurations()
}

/// The order eager runs a step in, its description and the buffers held
/// outside the graph (FSDP2's flat ones) along it.
struct EagerRun<'g> {
    g: &'g Graph,
    device: fsdp_eager::Device,
    order: std::borrow::Cow<'g, [OpId]>,
    what: String,
    held: Vec<fsdp_eager::Held>,
}

impl<'g> EagerRun<'g> {
    fn new(g: &'g Graph, device: fsdp_eager::Device) -> Self {
        let (order, mut what) = eager_order(g, device.prefetch);
        let held = fsdp_eager::flat_buffers(g, &order, device);
        if !held.is_empty() {
            what.push_str(&format!(
                " with FSDP2's flat buffers{}",
                if device.gloo { " and gloo's" } else { "" }
            ));
        }
        EagerRun {
            g,
            device,
            order,
            what,
            held,
        }
    }

    /// The caching allocator's figures over the eager order and over the
    /// same with the optimizer in the backward, with and without
    /// expandable segments.
    fn configurations(&self) -> Vec<Baseline> {
        let (g, what, held) = (self.g, &self.what, &self.held);
        let cs = eager_caching_holding(g, &self.order, false, held);
        let expandable = eager_caching_holding(g, &self.order, true, held);
        let in_backward = optimizer_in_backward_of(g, &self.order);
        // The updates moved between ops: the flat buffers keep their ops.
        let held_in_backward = fsdp_eager::flat_buffers(g, &in_backward, self.device);
        vec![
            Baseline {
                name: "pytorch-reserved".into(),
                footprint_bytes: cs.max_reserved,
                description: format!("{what} + simulated PyTorch caching allocator (reserved)"),
            },
            Baseline {
                name: "pytorch-allocated".into(),
                footprint_bytes: cs.max_allocated,
                description: format!("{what} + simulated PyTorch caching allocator (allocated)"),
            },
            Baseline {
                name: "pytorch-expandable-segments".into(),
                footprint_bytes: expandable.max_reserved,
                description: format!(
                    "{what} + simulated PyTorch caching allocator with expandable_segments:True (reserved)"
                ),
            },
            Baseline {
                name: "eager-optimizer-in-backward".into(),
                footprint_bytes: eager_caching_holding(g, &in_backward, false, &held_in_backward)
                    .max_reserved,
                description: format!(
                    "{what}, each update right after its gradient + simulated PyTorch caching allocator (reserved)"
                ),
            },
            Baseline {
                name: "eager-optimizer-in-backward-expandable-segments".into(),
                footprint_bytes: eager_caching_holding(g, &in_backward, true, &held_in_backward)
                    .max_reserved,
                description: format!(
                    "{what}, each update right after its gradient + simulated PyTorch caching allocator with expandable_segments:True (reserved)"
                ),
            },
        ]
    }
}

/// A given order with reuses, laid out by memplan's allocator.
pub fn order_with_layout(g: &Graph, order: &[OpId], source: &str) -> Plan {
    let low = lower::lower(g, true);
    let order = Lowered::from_op_ids(order);
    let ev = solver::evaluate(&low.problem, &order);
    crate::layout::layout(g, &low, &order, &ev, source)
}
