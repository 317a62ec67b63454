//! From memplan's graph to the solver's and the allocator's problems, and
//! back to a [`Plan`].
//!
//! - [`lower`]: graph → [`memplan_solver::Problem`]. Ops keep their indices;
//!   every tensor that occupies memory becomes a buffer; views fold into their
//!   root; all of [`Graph::deps`] become edges; reuse hints are passed when
//!   the output and the input's root have the same size (so taking one never
//!   costs bytes).
//! - [`layout_problem`]: an evaluated order → [`memplan_allocator::Problem`],
//!   one allocator buffer per reuse group (a chain of tensors sharing bytes).
//! - [`assemble`]: a layout → a [`Plan`].

use memplan_allocator as alloc;
use memplan_solver::{self as solver, BufIdx, Evaluation, OpClass, OpIdx};

use crate::graph::{Graph, Lifetime, OpId, OpKind, TensorId};
use crate::plan::{Plan, PlanStats};

/// The solver's view of a graph, with the maps between the two.
#[derive(Clone, Debug)]
pub struct Lowered {
    pub problem: solver::Problem,
    /// The buffer of each tensor's root (`None`: it owns no bytes).
    pub buf_of_tensor: Vec<Option<BufIdx>>,
    /// The tensor behind each buffer.
    pub tensor_of_buf: Vec<TensorId>,
}

impl Lowered {
    /// Converts a solver order to graph op ids (indices are shared).
    pub fn to_op_ids(order: &[OpIdx]) -> Vec<OpId> {
        order.iter().map(|o| OpId(o.0)).collect()
    }
    pub fn from_op_ids(order: &[OpId]) -> Vec<OpIdx> {
        order.iter().map(|o| OpIdx(o.0)).collect()
    }
}

pub fn op_class(k: OpKind) -> OpClass {
    match k {
        OpKind::Forward => OpClass::Forward,
        OpKind::Backward => OpClass::Backward,
        OpKind::Optimizer => OpClass::Optimizer,
        OpKind::Collective => OpClass::Collective,
        OpKind::Other => OpClass::Other,
    }
}

/// Lowers `g` for the solver; `with_reuse: false` drops every reuse hint
/// (what an eager framework's allocator would see).
pub fn lower(g: &Graph, with_reuse: bool) -> Lowered {
    let mut b = solver::ProblemBuilder::new();
    for op in g.ops() {
        b.add_op(op_class(op.kind));
    }
    let mut buf_of_root = vec![None; g.num_tensors()];
    let mut tensor_of_buf = Vec::new();
    for t in g.tensor_ids() {
        if g.occupies_memory(t) {
            let x = g.tensor(t);
            let buf = b.add_buf(
                x.size,
                x.producer.map(|p| OpIdx(p.0)),
                x.lifetime == Lifetime::Persistent,
            );
            buf_of_root[t.index()] = Some(buf);
            tensor_of_buf.push(t);
        }
    }
    for t in g.tensor_ids() {
        let Some(buf) = buf_of_root[t.index()] else {
            continue;
        };
        let producer = g.tensor(t).producer;
        for &u in g.users_of_root(t) {
            if Some(u) != producer {
                b.add_use(OpIdx(u.0), buf);
            }
        }
    }
    for o in g.op_ids() {
        for &d in g.deps(o) {
            b.add_edge(OpIdx(d.0), OpIdx(o.0));
        }
    }
    if with_reuse {
        for o in g.op_ids() {
            for &(out, inp) in &g.op(o).reuse {
                let (Some(ob), Some(ib)) =
                    (buf_of_root[out.index()], buf_of_root[g.root(inp).index()])
                else {
                    continue;
                };
                if g.tensor(out).size == g.tensor(g.root(inp)).size
                    && g.tensor(g.root(inp)).producer != Some(o)
                {
                    b.add_reuse(OpIdx(o.0), ob, ib);
                }
            }
        }
    }
    let buf_of_tensor = g
        .tensor_ids()
        .map(|t| buf_of_root[g.root(t).index()])
        .collect();
    let problem = b
        .build()
        .expect("a validated graph always lowers to a valid problem");
    Lowered {
        problem,
        buf_of_tensor,
        tensor_of_buf,
    }
}

/// One allocator buffer per reuse group, and which group each solver buffer
/// belongs to.
pub struct LayoutProblem {
    pub problem: alloc::Problem,
    /// Allocator buffer index of each solver buffer.
    pub group_of_buf: Vec<usize>,
}

fn lcm(a: u64, b: u64) -> u64 {
    fn gcd(mut a: u64, mut b: u64) -> u64 {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    }
    if a == 0 || b == 0 {
        return a.max(b);
    }
    (a / gcd(a, b)).saturating_mul(b)
}

/// The allocator's problem for one evaluated order of `low`.
pub fn layout_problem(g: &Graph, low: &Lowered, ev: &Evaluation) -> LayoutProblem {
    let p = &low.problem;
    let groups = solver::simulate::reuse_groups(p, &ev.taken);
    let mut group_of_buf = vec![usize::MAX; p.num_bufs()];
    let mut buffers: Vec<alloc::Buffer> = Vec::new();
    // Heads first: a reuse chain's head may have a larger index than its
    // members (recomputed copies are added after the tensors that reuse
    // their bytes).
    let (heads, members): (Vec<_>, Vec<_>) = p.buf_ids().partition(|&b| groups[b.index()] == b);
    for b in heads {
        let t = g.tensor(low.tensor_of_buf[b.index()]);
        buffers.push(alloc::Buffer {
            id: t.name.clone(),
            lower: ev.birth[b.index()] as u64,
            upper: ev.death[b.index()] as u64 + 1,
            size: t.size,
            align: t.align.max(1),
            pinned: None,
        });
        group_of_buf[b.index()] = buffers.len() - 1;
    }
    for b in members {
        let gi = group_of_buf[groups[b.index()].index()];
        debug_assert!(gi != usize::MAX);
        let t = g.tensor(low.tensor_of_buf[b.index()]);
        let x = &mut buffers[gi];
        x.lower = x.lower.min(ev.birth[b.index()] as u64);
        x.upper = x.upper.max(ev.death[b.index()] as u64 + 1);
        x.size = x.size.max(t.size);
        x.align = lcm(x.align, t.align.max(1));
        group_of_buf[b.index()] = gi;
    }
    LayoutProblem {
        problem: alloc::Problem::new(buffers),
        group_of_buf,
    }
}

/// Builds the plan for `order` laid out by `solution` of `lp`.
pub fn assemble(
    g: &Graph,
    low: &Lowered,
    order: &[OpIdx],
    ev: &Evaluation,
    lp: &LayoutProblem,
    solution: &alloc::Solution,
    stats: PlanStats,
) -> Plan {
    let mut offsets = vec![None; g.num_tensors()];
    for (b, &t) in low.tensor_of_buf.iter().enumerate() {
        offsets[t.index()] = Some(solution.offsets[lp.group_of_buf[b]]);
    }
    let reuses = ev
        .taken
        .iter()
        .map(|r| {
            (
                low.tensor_of_buf[r.out.index()],
                low.tensor_of_buf[r.inp.index()],
            )
        })
        .collect();
    Plan {
        order: Lowered::to_op_ids(order),
        offsets,
        arena_bytes: solution.height,
        reuses,
        #[allow(deprecated)] // the arena's old copy, written for one release
        stats: PlanStats {
            peak_bytes: solution.height,
            max_live_bytes: ev.peak,
            ..stats
        },
    }
}
