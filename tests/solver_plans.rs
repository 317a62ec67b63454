//! The ordering solver through the whole pipeline: every plan passes the
//! checker, lower bound ≤ peak ≤ program-order baseline, weight updates stay
//! after their gradient and the parameter's last read, recomputation runs in
//! the backward pass, and results are deterministic.

use std::time::Duration;

use memplan::graph::{Graph, GraphBuilder, OpKind, OpSpec, Role, TensorId, TensorSpec};
use memplan::models::{ExampleOptions, example};
use memplan::{Options, baselines, checker};
use memplan_solver::random::Rng;
use proptest::prelude::*;

/// A random training-step-like graph: parameters read by forward ops, a
/// chain of activations with side branches and views, a backward chain that
/// produces one gradient per parameter, optional gradient-norm clipping, and
/// one in-place optimizer update per parameter with a working buffer.
fn random_graph(seed: u64, layers: usize, clip: bool) -> Graph {
    let mut r = Rng::new(seed);
    let mut b = GraphBuilder::new(format!("random-{seed}"));
    let size = |r: &mut Rng| [0u64, 16, 64, 100, 256, 1000][r.below(6) as usize];
    let x0 = b.add_tensor(TensorSpec::new("x", 64).role(Role::Input).persistent());
    let mut params = Vec::new();
    let mut acts = vec![x0];
    let mut cur = x0;
    for l in 0..layers {
        let w = b.add_tensor(
            TensorSpec::new(format!("w{l}"), 16 + r.below(200))
                .role(Role::Parameter)
                .persistent(),
        );
        params.push(w);
        let h = b.add_tensor(TensorSpec::new(format!("h{l}"), size(&mut r)));
        let mut spec = OpSpec::new(format!("fwd{l}"), OpKind::Forward, "f")
            .inputs([cur, w])
            .outputs([h]);
        if r.chance(0.3) && b.tensor_spec(cur).size == b.tensor_spec(h).size && l > 0 {
            spec = spec.reuse(h, cur);
        }
        b.add_op(spec);
        if r.chance(0.3) {
            let v = b.add_tensor(TensorSpec::new(format!("v{l}"), 0).view_of(h));
            let side = b.add_tensor(TensorSpec::new(format!("s{l}"), size(&mut r)));
            b.add_op(
                OpSpec::new(format!("side{l}"), OpKind::Forward, "f")
                    .inputs([v])
                    .outputs([side]),
            );
            acts.push(side);
        }
        acts.push(h);
        cur = h;
    }
    let loss = b.add_tensor(TensorSpec::new("loss", 4));
    b.add_op(
        OpSpec::new("loss", OpKind::Forward, "f")
            .inputs([cur])
            .outputs([loss]),
    );
    let mut dy = loss;
    let mut grads: Vec<TensorId> = Vec::new();
    for l in (0..layers).rev() {
        let w = params[l];
        let g = b.add_tensor(
            TensorSpec::new(format!("dw{l}"), b.tensor_spec(w).size).role(Role::Gradient),
        );
        let a = acts[r.below(acts.len() as u64) as usize];
        b.add_op(
            OpSpec::new(format!("bwd_w{l}"), OpKind::Backward, "f")
                .inputs([dy, a])
                .outputs([g]),
        );
        let dx = b.add_tensor(TensorSpec::new(format!("dx{l}"), size(&mut r)));
        b.add_op(
            OpSpec::new(format!("bwd_x{l}"), OpKind::Backward, "f")
                .inputs([dy, w, acts[l.min(acts.len() - 1)]])
                .outputs([dx]),
        );
        grads.push(g);
        dy = dx;
    }
    let norm = clip.then(|| {
        let n = b.add_tensor(TensorSpec::new("norm", 4).role(Role::Temporary));
        b.add_op(
            OpSpec::new("clip_grad_norm", OpKind::Optimizer, "grad_norm")
                .inputs(grads.clone())
                .outputs([n]),
        );
        n
    });
    for (i, &g) in grads.iter().enumerate() {
        let l = layers - 1 - i;
        let w = params[l];
        let m = b.add_tensor(
            TensorSpec::new(format!("m{l}"), b.tensor_spec(w).size)
                .role(Role::OptimizerState)
                .persistent(),
        );
        let tmp = b.add_tensor(
            TensorSpec::new(format!("denom{l}"), b.tensor_spec(w).size).role(Role::Temporary),
        );
        let mut inputs = vec![g];
        inputs.extend(norm);
        b.add_op(
            OpSpec::new(format!("update{l}"), OpKind::Optimizer, "adam")
                .inputs(inputs)
                .outputs([tmp])
                .updates([w, m]),
        );
    }
    b.build().expect("random graphs are valid")
}

fn options() -> Options {
    Options {
        time_limit: Duration::from_secs(30),
        ..Options::default()
    }
}

/// Every optimizer op runs after everything that produces what it reads and
/// after every earlier reader of what it updates.
fn updates_respect_semantics(g: &Graph, order: &[memplan::OpId]) -> Result<(), String> {
    let mut pos = vec![0usize; g.num_ops()];
    for (i, o) in order.iter().enumerate() {
        pos[o.index()] = i;
    }
    for o in g.op_ids() {
        let op = g.op(o);
        if op.kind != OpKind::Optimizer {
            continue;
        }
        for &t in &op.inputs {
            if let Some(p) = g.tensor(g.root(t)).producer
                && pos[p.index()] > pos[o.index()]
            {
                return Err(format!("{} runs before its input's producer", op.name));
            }
        }
        for &t in &op.updates {
            for &u in g.users_of_root(g.root(t)) {
                let user = g.op(u);
                if u != o
                    && user.kind != OpKind::Optimizer
                    && user.inputs.iter().any(|&i| g.root(i) == g.root(t))
                    && pos[u.index()] > pos[o.index()]
                {
                    return Err(format!(
                        "{} updates {} before {} reads it",
                        op.name,
                        g.tensor(t).name,
                        user.name
                    ));
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn plans_are_checked_bounded_and_never_worse(seed in any::<u64>(), layers in 1usize..7, clip in any::<bool>()) {
        let g = random_graph(seed, layers, clip);
        let plan = memplan::plan(&g, &options()).unwrap();
        prop_assert!(checker::check(&g, &plan).is_ok(), "{:?}", checker::check(&g, &plan).err());
        let s = &plan.stats;
        prop_assert!(s.lower_bound_bytes <= s.max_live_bytes);
        prop_assert!(s.max_live_bytes <= plan.arena_bytes);
        prop_assert!(s.max_live_bytes <= baselines::program_order_max_live(&g));
        prop_assert!(plan.arena_bytes <= baselines::program_order_greedy(&g).arena_bytes);
        prop_assert!(updates_respect_semantics(&g, &plan.order).is_ok(), "{:?}", updates_respect_semantics(&g, &plan.order));
    }
}

fn gpt2_tiny(checkpoint: bool, clip: bool) -> Graph {
    example(
        "gpt2-tiny",
        &ExampleOptions {
            checkpoint,
            clip_grad_norm: clip.then_some(1.0),
            ..ExampleOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn gpt2_tiny_plans_pass_the_checker_and_keep_update_semantics() {
    for (ckpt, clip) in [(false, false), (true, false), (false, true), (true, true)] {
        let g = gpt2_tiny(ckpt, clip);
        let (plan, report) = memplan::pipeline::plan_with_report(&g, &options()).unwrap();
        checker::check(&g, &plan).unwrap();
        updates_respect_semantics(&g, &plan.order).unwrap();
        assert!(plan.stats.max_live_bytes <= baselines::program_order_max_live(&g));
        assert!(report.solver.lower_bound <= report.solver.peak);
        if clip {
            // Every update waits for the global norm.
            let norm = g.op_by_name("clip_grad_norm").unwrap();
            let steps = plan.steps(&g);
            for o in g.op_ids() {
                if g.op(o).name.ends_with(".update") {
                    assert!(steps[o.index()] > steps[norm.index()]);
                }
            }
        }
    }
}

/// Recomputed forward ops run in the backward pass, after the loss.
#[test]
fn recomputation_runs_in_the_backward_pass() {
    let g = gpt2_tiny(true, false);
    let plan = memplan::plan(&g, &options()).unwrap();
    let steps = plan.steps(&g);
    let loss = g
        .op_ids()
        .filter(|&o| g.op(o).kind == OpKind::Forward && !g.op(o).name.starts_with("recompute."))
        .map(|o| steps[o.index()])
        .max()
        .unwrap();
    for o in g.op_ids() {
        if g.op(o).name.starts_with("recompute.") {
            assert!(
                steps[o.index()] > loss,
                "{} runs before the end of the forward pass",
                g.op(o).name
            );
        }
    }
}

#[test]
fn plans_are_deterministic() {
    let g = gpt2_tiny(false, true);
    let a = memplan::plan(&g, &options()).unwrap();
    let b = memplan::plan(&g, &options()).unwrap();
    assert_eq!(a.order, b.order);
    assert_eq!(a.arena_bytes, b.arena_bytes);
}

/// With activation checkpointing, a weight-gradient op and the recomputed
/// value it reads (`recompute.hN.mlp.gelu` → `hN.mlp.c_proj.backward_weight`)
/// can be deferred together to the end of the backward pass by the sink and
/// placement passes, holding one recomputed activation per block live at
/// once; hoisting either op alone frees nothing. The chain-hoist pass moves
/// the group (with the updates that free its gradient) back next to its
/// inputs' last use, which brings the plan to within 1% of the min-cut
/// floor; without it the same configuration is several percent above.
#[test]
fn checkpointed_gpt2_is_planned_near_the_floor() {
    let g = example(
        "gpt2-medium",
        &ExampleOptions {
            layers: Some(8),
            checkpoint: true,
            ..ExampleOptions::default()
        },
    )
    .unwrap();
    let (plan, _) = memplan::pipeline::plan_with_report(&g, &options()).unwrap();
    checker::check(&g, &plan).unwrap();
    let floor = plan.stats.lower_bound_bytes as f64;
    let on = plan.stats.max_live_bytes as f64 / floor;
    // Measured: 1.0019 with the pass, 1.0500 without (the floor is the same).
    assert!(on <= 1.005, "peak {on:.4} x the floor");
    let mut off = options();
    assert!(off.solver.disable("chain_hoist"));
    let (plan_off, report) = memplan::pipeline::plan_with_report(&g, &off).unwrap();
    checker::check(&g, &plan_off).unwrap();
    // The solver's own order: the pipeline's candidates include the
    // optimizer-in-backward order, which is below it here (1.0167).
    let without = report.solver.peak as f64 / floor;
    assert!(
        without >= 1.03,
        "without chain-hoist: {without:.4} x the floor"
    );
}
