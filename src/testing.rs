//! Random graphs for tests and benchmarks (cargo feature `testing`).
//!
//! - [`graph_recipe`] / [`graph`]: proptest strategies for small random
//!   training-step graphs exercising every part of the model: zero and odd
//!   sizes, alignments, fan-in and fan-out, step inputs (persistent or not),
//!   persistent outputs, views (and views of views), in-place updates, reuse
//!   hints (equal-size ones the planner can take, smaller ones it cannot),
//!   `after` edges, unused tensors. A [`GraphRecipe`] is plain data, so
//!   proptest shrinks failures to small graphs; [`GraphRecipe::build`] always
//!   yields a valid graph.
//! - [`random_dag`] and [`synthetic_training_step`]: large deterministic
//!   graphs from a seed, for benchmarks (10,000 to 100,000 ops and more).
//!
//! Other crates' tests and benches enable it with
//! `memplan = { path = "..", features = ["testing"] }`.

use proptest::prelude::*;

use crate::graph::{Graph, GraphBuilder, OpId, OpKind, OpSpec, Role, TensorId, TensorSpec};

/// A step input to create before any op runs.
#[derive(Clone, Debug, PartialEq)]
pub struct InputRecipe {
    pub size: u64,
    pub align: u64,
    /// Parameter, optimizer state or input.
    pub role: Role,
    pub persistent: bool,
}

/// One output of an op.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputRecipe {
    pub size: u64,
    pub align: u64,
    /// Survives the step (an output of the step).
    pub persistent: bool,
    /// Make it a view of the op's input with this index (mod the number of
    /// inputs) instead of a tensor with bytes of its own.
    pub view_of_input: Option<usize>,
}

/// One op. Indices pick among what exists when the op is added, modulo
/// their number, so every recipe builds.
#[derive(Clone, Debug, PartialEq)]
pub struct OpRecipe {
    /// Tensors it reads (indices into the tensors created so far).
    pub reads: Vec<usize>,
    pub outputs: Vec<OutputRecipe>,
    /// Tensors it updates in place (indices into the tensors so far;
    /// skipped when also read).
    pub updates: Vec<usize>,
    /// Reuse hints `(output index, input index)`; `true`: make the output
    /// exactly as large as the input's root, so the planner may take it.
    pub reuse: Vec<(usize, usize, bool)>,
    /// Earlier ops it must run after (indices into the ops so far).
    pub after: Vec<usize>,
    pub kind: OpKind,
}

/// A whole random graph; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct GraphRecipe {
    pub inputs: Vec<InputRecipe>,
    pub ops: Vec<OpRecipe>,
}

impl GraphRecipe {
    /// Builds the graph the recipe describes. Panics only on a bug in this
    /// builder (the recipe is made valid by construction).
    pub fn build(&self) -> Graph {
        let mut b = GraphBuilder::new("random");
        let mut tensors: Vec<TensorId> = Vec::new();
        // Root of every tensor, and its size.
        let mut root: Vec<TensorId> = Vec::new();
        for (i, inp) in self.inputs.iter().enumerate() {
            let mut spec = TensorSpec::new(format!("in{i}"), inp.size)
                .role(inp.role)
                .align(inp.align.max(1));
            if inp.persistent {
                spec = spec.persistent();
            }
            let t = b.add_tensor(spec);
            tensors.push(t);
            root.push(t);
        }
        let mut ops: Vec<OpId> = Vec::new();
        for (k, o) in self.ops.iter().enumerate() {
            let mut reads: Vec<TensorId> = Vec::new();
            if !tensors.is_empty() {
                for &r in &o.reads {
                    let t = tensors[r % tensors.len()];
                    if !reads.contains(&t) {
                        reads.push(t);
                    }
                }
            }
            let mut updates: Vec<TensorId> = Vec::new();
            if !tensors.is_empty() {
                for &u in &o.updates {
                    let t = tensors[u % tensors.len()];
                    if !reads.contains(&t) && !updates.contains(&t) {
                        updates.push(t);
                    }
                }
            }
            let mut outs: Vec<TensorId> = Vec::new();
            for (j, out) in o.outputs.iter().enumerate() {
                let name = format!("op{k}.out{j}");
                let view_base = match (out.view_of_input, reads.is_empty()) {
                    (Some(i), false) => Some(reads[i % reads.len()]),
                    _ => None,
                };
                let t = match view_base {
                    Some(base) => {
                        let size = b.tensor_spec(root[base.index()]).size;
                        b.add_tensor(TensorSpec::new(name, size).view_of(base))
                    }
                    None => {
                        let mut spec = TensorSpec::new(name, out.size).align(out.align.max(1));
                        if out.persistent {
                            spec = spec.persistent().role(Role::Output);
                        }
                        b.add_tensor(spec)
                    }
                };
                root.push(view_base.map_or(t, |base| root[base.index()]));
                outs.push(t);
            }
            let mut reuse: Vec<(TensorId, TensorId)> = Vec::new();
            if !outs.is_empty() && !reads.is_empty() {
                for &(oi, ii, equal) in &o.reuse {
                    let out = outs[oi % outs.len()];
                    let inp = reads[ii % reads.len()];
                    if b.tensor_spec(out).view_of.is_some() || reuse.iter().any(|r| r.0 == out) {
                        continue;
                    }
                    let in_size = b.tensor_spec(root[inp.index()]).size;
                    let out_size = b.tensor_spec(out).size;
                    if equal {
                        b.tensor_spec_mut(out).size = in_size;
                    } else if out_size > in_size {
                        b.tensor_spec_mut(out).size = in_size / 2;
                    }
                    reuse.push((out, inp));
                }
            }
            let after: Vec<OpId> = if ops.is_empty() {
                Vec::new()
            } else {
                o.after.iter().map(|&a| ops[a % ops.len()]).collect()
            };
            let mut spec = OpSpec::new(format!("op{k}"), o.kind, "random")
                .inputs(reads)
                .outputs(outs.iter().copied())
                .updates(updates)
                .after(after);
            spec.reuse = reuse;
            ops.push(b.add_op(spec));
            tensors.extend(outs);
        }
        b.build().unwrap_or_else(|e| {
            panic!("testing::GraphRecipe built an invalid graph: {e}\n{self:?}")
        })
    }
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        6 => 1u64..300,
        2 => prop::sample::select(vec![256u64, 512, 1024, 4096]),
    ]
}

fn align() -> impl Strategy<Value = u64> {
    prop::sample::select(vec![1u64, 1, 1, 2, 8, 64, 256])
}

fn input_recipe() -> impl Strategy<Value = InputRecipe> {
    (
        size(),
        align(),
        prop::sample::select(vec![Role::Parameter, Role::OptimizerState, Role::Input]),
        prop::bool::weighted(0.7),
    )
        .prop_map(|(size, align, role, persistent)| InputRecipe {
            size,
            align,
            role,
            persistent,
        })
}

fn output_recipe() -> impl Strategy<Value = OutputRecipe> {
    (
        size(),
        align(),
        prop::bool::weighted(0.1),
        prop::option::weighted(0.12, 0usize..8),
    )
        .prop_map(|(size, align, persistent, view_of_input)| OutputRecipe {
            size,
            align,
            persistent,
            view_of_input,
        })
}

fn op_recipe() -> impl Strategy<Value = OpRecipe> {
    (
        prop::collection::vec(0usize..64, 0..4),
        prop::collection::vec(output_recipe(), 0..3),
        prop::collection::vec(0usize..64, 0..2).prop_map(|mut v| {
            // Updates are rarer than reads.
            v.truncate(if v.first().is_some_and(|x| x % 3 == 0) {
                1
            } else {
                0
            });
            v
        }),
        prop::collection::vec((0usize..4, 0usize..4, prop::bool::weighted(0.8)), 0..2),
        prop::collection::vec(0usize..64, 0..2).prop_map(|mut v| {
            v.truncate(if v.first().is_some_and(|x| x % 4 == 0) {
                1
            } else {
                0
            });
            v
        }),
        prop::sample::select(vec![
            OpKind::Forward,
            OpKind::Backward,
            OpKind::Optimizer,
            OpKind::Collective,
            OpKind::Other,
        ]),
    )
        .prop_map(|(reads, outputs, updates, reuse, after, kind)| OpRecipe {
            reads,
            outputs,
            updates,
            reuse,
            after,
            kind,
        })
}

/// Recipes of up to `max_inputs` step inputs and `max_ops` ops (zero
/// included).
pub fn graph_recipe(max_inputs: usize, max_ops: usize) -> impl Strategy<Value = GraphRecipe> {
    (
        prop::collection::vec(input_recipe(), 0..=max_inputs),
        prop::collection::vec(op_recipe(), 0..=max_ops),
    )
        .prop_map(|(inputs, ops)| GraphRecipe { inputs, ops })
}

/// Random graphs of up to `max_ops` ops; see the module docs.
pub fn graph(max_ops: usize) -> impl Strategy<Value = Graph> {
    graph_recipe(4, max_ops).prop_map(|r| r.build())
}

/// A small deterministic random number generator (SplitMix64, the
/// workspace's one: `rand_xoshiro`'s), so large graphs are the same on
/// every machine.
#[derive(Clone, Debug)]
pub struct SplitMix64(rand_xoshiro::SplitMix64);

impl SplitMix64 {
    /// The generator whose state starts at `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        use rand_xoshiro::rand_core::SeedableRng;
        SplitMix64(rand_xoshiro::SplitMix64::seed_from_u64(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        use rand_xoshiro::rand_core::Rng;
        self.0.next_u64()
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// A random DAG of `ops` ops: each op reads one to three tensors made by
/// the last `window` ops (and, rarely, one from anywhere before), and makes
/// one or two tensors of 1 KiB to 1 MiB (rounded to 256 B). A few persistent
/// parameters are read throughout. Deterministic in `seed`.
pub fn random_dag(ops: usize, window: usize, seed: u64) -> Graph {
    let mut rng = SplitMix64::new(seed);
    let mut b = GraphBuilder::new(format!("random-dag-{ops}"));
    let params: Vec<TensorId> = (0..16)
        .map(|i| {
            b.add_tensor(
                TensorSpec::new(format!("w{i}"), 256 * (1 + rng.below(4096)))
                    .role(Role::Parameter)
                    .persistent()
                    .align(256),
            )
        })
        .collect();
    let mut made: Vec<TensorId> = Vec::new();
    for k in 0..ops {
        let mut inputs = vec![params[rng.below(params.len() as u64) as usize]];
        if !made.is_empty() {
            let reads = 1 + rng.below(3);
            for _ in 0..reads {
                let lo = made.len().saturating_sub(window);
                let t = made[lo + rng.below((made.len() - lo) as u64) as usize];
                if !inputs.contains(&t) {
                    inputs.push(t);
                }
            }
            if rng.chance(0.03) {
                let t = made[rng.below(made.len() as u64) as usize];
                if !inputs.contains(&t) {
                    inputs.push(t);
                }
            }
        }
        let outs: Vec<TensorId> = (0..1 + rng.below(2))
            .map(|j| {
                b.add_tensor(
                    TensorSpec::new(format!("t{k}.{j}"), 256 * (4 + rng.below(4096))).align(256),
                )
            })
            .collect();
        b.add_op(
            OpSpec::new(format!("op{k}"), OpKind::Other, "random")
                .inputs(inputs)
                .outputs(outs.iter().copied()),
        );
        made.extend(outs);
    }
    b.build().expect("random_dag builds a valid graph")
}

/// One block of [`synthetic_training_step`]: its two weights (each followed
/// by its two moments) and the activations its backward reads.
struct SyntheticBlock {
    w: [TensorId; 2],
    saved: [TensorId; 4],
}

fn activation(b: &mut GraphBuilder, name: String, size: u64) -> TensorId {
    b.add_tensor(TensorSpec::new(name, size).align(256))
}

fn add_op<const I: usize, const O: usize>(
    b: &mut GraphBuilder,
    name: String,
    kind: OpKind,
    ty: &str,
    inputs: [TensorId; I],
    outputs: [TensorId; O],
) {
    b.add_op(OpSpec::new(name, kind, ty).inputs(inputs).outputs(outputs));
}

/// A training step with the shape of a deep network, `layers` blocks deep
/// (13 ops per layer): each block's forward is a small DAG (two
/// matmuls, an activation, a residual add, a side branch) whose activations
/// are saved for its backward; then a loss; then the backward in reverse
/// with a weight gradient per matmul and an in-place Adam-style update of
/// each weight and its two moments. Sizes vary per layer. Deterministic in
/// `seed`.
pub fn synthetic_training_step(layers: usize, seed: u64) -> Graph {
    let mut rng = SplitMix64::new(seed);
    let mut b = GraphBuilder::new(format!("synthetic-step-{layers}"));
    let x0 = b.add_tensor(
        TensorSpec::new("input", 4 << 20)
            .role(Role::Input)
            .persistent(),
    );
    let mut h = x0;
    let mut blocks = Vec::new();
    for l in 0..layers {
        let (blk, out) = synthetic_block_forward(&mut b, &mut rng, l, h);
        blocks.push(blk);
        h = out;
    }
    let loss = b.add_tensor(TensorSpec::new("loss", 4).role(Role::Output).persistent());
    let h_size = b.tensor_spec(h).size;
    let mut dh = activation(&mut b, "loss.grad".into(), h_size);
    add_op(&mut b, "loss".into(), OpKind::Forward, "loss", [h], [loss]);
    let bwd = OpKind::Backward;
    add_op(
        &mut b,
        "loss.backward".into(),
        bwd,
        "loss_backward",
        [h],
        [dh],
    );
    for (l, blk) in blocks.iter().enumerate().rev() {
        dh = synthetic_block_backward(&mut b, l, blk, dh);
    }
    b.build()
        .expect("synthetic_training_step builds a valid graph")
}

/// Block `l`'s weights and forward from `h`; returns the block and its
/// output.
fn synthetic_block_forward(
    b: &mut GraphBuilder,
    rng: &mut SplitMix64,
    l: usize,
    h: TensorId,
) -> (SyntheticBlock, TensorId) {
    let kib = |rng: &mut SplitMix64, lo: u64, hi: u64| 1024 * (lo + rng.below(hi - lo + 1));
    let width = kib(rng, 1024, 4096);
    let mut weight = |b: &mut GraphBuilder, j: usize| {
        let sz = kib(rng, 256, 2048);
        let w = b.add_tensor(
            TensorSpec::new(format!("l{l}.w{j}"), sz)
                .role(Role::Parameter)
                .persistent()
                .align(256),
        );
        for m in ["m", "v"] {
            b.add_tensor(
                TensorSpec::new(format!("l{l}.w{j}.{m}"), sz)
                    .role(Role::OptimizerState)
                    .persistent()
                    .align(256),
            );
        }
        w
    };
    let w = [weight(b, 0), weight(b, 1)];
    let a = activation(b, format!("l{l}.a"), 4 * width);
    let g = activation(b, format!("l{l}.g"), 4 * width);
    let c = activation(b, format!("l{l}.c"), width);
    let side = activation(b, format!("l{l}.side"), width / 4);
    let out = activation(b, format!("l{l}.out"), width);
    let fwd = OpKind::Forward;
    add_op(b, format!("l{l}.mm0"), fwd, "matmul", [h, w[0]], [a]);
    add_op(b, format!("l{l}.act"), fwd, "gelu", [a], [g]);
    add_op(b, format!("l{l}.mm1"), fwd, "matmul", [g, w[1]], [c]);
    add_op(b, format!("l{l}.stat"), fwd, "reduce", [h], [side]);
    add_op(b, format!("l{l}.add"), fwd, "add", [c, h, side], [out]);
    let blk = SyntheticBlock {
        w,
        saved: [h, a, g, side],
    };
    (blk, out)
}

/// Block `l`'s backward from its output's gradient `dh`, and the updates
/// of its weights; returns its input's gradient.
fn synthetic_block_backward(
    b: &mut GraphBuilder,
    l: usize,
    blk: &SyntheticBlock,
    dh: TensorId,
) -> TensorId {
    let [hin, a, g, side] = blk.saved;
    let sz = |b: &GraphBuilder, t: TensorId| b.tensor_spec(t).size;
    let (sg, sa, ss, sh) = (sz(b, g), sz(b, a), sz(b, side), sz(b, hin));
    let dg = activation(b, format!("l{l}.dg"), sg);
    let da = activation(b, format!("l{l}.da"), sa);
    let dside = activation(b, format!("l{l}.dside"), ss);
    let dhin = activation(b, format!("l{l}.dh"), sh);
    let dw: Vec<TensorId> = (0..2)
        .map(|j| {
            let s = sz(b, blk.w[j]);
            b.add_tensor(
                TensorSpec::new(format!("l{l}.w{j}.grad"), s)
                    .role(Role::Gradient)
                    .align(256),
            )
        })
        .collect();
    let bwd = OpKind::Backward;
    add_op(
        b,
        format!("l{l}.mm1.dx"),
        bwd,
        "matmul",
        [dh, blk.w[1]],
        [dg],
    );
    add_op(b, format!("l{l}.mm1.dw"), bwd, "matmul", [dh, g], [dw[1]]);
    b.add_op(
        OpSpec::new(format!("l{l}.act.bwd"), bwd, "gelu_backward")
            .inputs([dg, a])
            .outputs([da])
            .reuse(da, dg),
    );
    add_op(b, format!("l{l}.mm0.dw"), bwd, "matmul", [da, hin], [dw[0]]);
    let stat_bwd = format!("l{l}.stat.bwd");
    add_op(b, stat_bwd, bwd, "reduce_backward", [dh, side], [dside]);
    let mm0_inputs = [da, blk.w[0], dh, dside];
    add_op(b, format!("l{l}.mm0.dx"), bwd, "matmul", mm0_inputs, [dhin]);
    for (j, &dwj) in dw.iter().enumerate() {
        let w = blk.w[j];
        // The moments were made right after their weight.
        let (m, v) = (TensorId(w.0 + 1), TensorId(w.0 + 2));
        b.add_op(
            OpSpec::new(format!("l{l}.w{j}.adam"), OpKind::Optimizer, "adam")
                .inputs([dwj])
                .updates([w, m, v]),
        );
    }
    dhin
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same stream as the hand-written SplitMix64 this replaced, so
    /// the random graphs are unchanged.
    #[test]
    fn splitmix_stream_is_unchanged() {
        let mut r = SplitMix64::new(42);
        assert_eq!(r.next_u64(), 13679457532755275413);
        assert_eq!(r.next_u64(), 2949826092126892291);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn recipes_always_build(r in graph_recipe(4, 12)) {
            let g = r.build();
            prop_assert_eq!(g.num_ops(), r.ops.len());
        }
    }

    #[test]
    fn large_generators_are_deterministic() {
        let a = random_dag(500, 20, 7);
        let b = random_dag(500, 20, 7);
        assert_eq!(crate::io::json::to_file(&a), crate::io::json::to_file(&b));
        let s = synthetic_training_step(10, 3);
        assert_eq!(s.num_ops(), 10 * 5 + 2 + 10 * 8);
    }
}
