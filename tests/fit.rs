//! `memplan::fit`: recomputation that fits a step into a budget.
//!
//! - Fitted GPT-2, Llama and MLP steps pass the checker, stay within the
//!   budget, and run on the CPU executor to the same losses and final state
//!   as the unplanned reference of the original step.
//! - On small random forward/backward graphs the exact search's cost equals
//!   a brute force over every recomputation set and every order (a dynamic
//!   program over scheduled sets, independent of the planner).
//! - A budget below the bound is refused with the bound and the op that
//!   sets it.
//! - The floor within a share is never above that brute force, on those
//!   steps and on random graphs with views, in-place updates and reuse.

use std::time::Duration;

use memplan::cost::OpCost;
use memplan::fit::{
    COPY_OF, FitOptions, Fitted, Objective, candidates, fit, fit_floor, fit_within, recompute,
};
use memplan::graph::{Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, TensorSpec};
use memplan::models::gpt2::{self, Gpt2Config};
use memplan::models::llama::{self, LlamaConfig};
use memplan::models::mlp::{self, MlpConfig};
use memplan::{Error, checker, exec};
use memplan_runtime::runner::{RunConfig, RunReport, run_cpu};

fn run(g: &Graph, plan: &memplan::Plan) -> RunReport {
    let p = exec::program(g, plan).unwrap();
    let cfg = RunConfig {
        steps: 2,
        keep_state: true,
        ..RunConfig::default()
    };
    run_cpu(&p, &cfg).unwrap()
}

fn opts(budget: u64) -> FitOptions {
    FitOptions {
        budget,
        time_limit: Duration::from_secs(30),
        probe_time: Duration::from_millis(500),
        ..FitOptions::default()
    }
}

/// Fits `g` into `share` of the way from its floor to its plan without
/// recomputation, checks the plan, and runs it against the reference.
fn fits_and_runs_like_the_reference(g: &Graph, share: f64) {
    let base = memplan::plan(g, &memplan::Options::default())
        .unwrap()
        .arena_bytes;
    let (floor, _) = fit_floor(g);
    assert!(floor < base, "{}: nothing to win", g.name);
    let budget = floor + ((base - floor) as f64 * share) as u64;
    let f = fit(g, &opts(budget)).unwrap();
    checker::check(&f.graph, &f.plan).unwrap();
    assert!(
        f.plan.arena_bytes <= budget,
        "{} > {budget}",
        f.plan.arena_bytes
    );
    assert!(
        !f.recomputed.is_empty(),
        "{}: fits without recomputation?",
        g.name
    );
    assert_eq!(f.base_arena, base);
    assert!(f.added.flops > 0.0 && f.added.flops < f.step.flops);
    runs_like_the_reference(g, &f);
}

/// The fitted step has a copy of every recomputed op, and runs to the
/// unplanned reference's losses and state.
fn runs_like_the_reference(g: &Graph, f: &Fitted) {
    // Every recomputed op has its copy, which the backward reads.
    for name in &f.recomputed {
        let copy = f.graph.op_by_name(&format!("recompute.{name}")).unwrap();
        assert_eq!(
            f.graph.op(copy).op_type,
            g.op(g.op_by_name(name).unwrap()).op_type
        );
    }
    let a = run(&f.graph, &f.plan);
    let b = run(g, &exec::unplanned_plan(g));
    assert_eq!(a.arena_bytes, f.plan.arena_bytes);
    for (x, y) in a.steps.iter().zip(&b.steps) {
        assert!(
            (x.loss - y.loss).abs() <= 1e-6 * (1.0 + y.loss.abs()),
            "{} vs {}",
            x.loss,
            y.loss
        );
    }
    for (ra, rb) in a.state.iter().zip(&b.state) {
        assert_eq!(ra.len(), rb.len());
        for ((na, va), (nb, vb)) in ra.iter().zip(rb) {
            assert_eq!(na, nb);
            for (p, q) in va.iter().zip(vb) {
                assert!((p - q).abs() <= 1e-7 + 1e-5 * q.abs(), "{na}: {p} vs {q}");
            }
        }
    }
}

#[test]
fn fitted_gpt2_runs_like_the_reference() {
    // A small vocabulary: activations, not the head, set the peak.
    let g = gpt2::build(&Gpt2Config::small_config(3, 32, 2, 16, 2, 64)).unwrap();
    fits_and_runs_like_the_reference(&g, 0.5);
}

#[test]
fn fitted_llama_runs_like_the_reference() {
    let cfg = LlamaConfig {
        layers: 3,
        width: 32,
        heads: 4,
        kv_heads: 2,
        ffn: 48,
        vocab: 32,
        seq: 64,
        batch: 2,
        ..LlamaConfig::preset("llama-tiny").unwrap()
    };
    fits_and_runs_like_the_reference(&llama::build(&cfg).unwrap(), 0.5);
}

/// Within 1% more FLOPs the GPT-2 step gets smaller, spends no more than
/// allowed, and runs like the reference; with nothing allowed it adds no
/// FLOPs.
#[test]
fn fitted_within_a_flops_share_runs_like_the_reference() {
    let g = gpt2::build(&Gpt2Config::small_config(3, 32, 2, 16, 2, 64)).unwrap();
    let progress = std::sync::Arc::new(memplan_solver::Progress::new());
    let o = FitOptions {
        objective: Objective::Flops,
        time_limit: Duration::from_secs(8),
        progress: Some(progress.clone()),
        ..opts(0)
    };
    let f = fit_within(&g, 0.01, &o).unwrap();
    // The progress counters saw every plan and end at the answer.
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    assert_eq!(progress.done.load(relaxed), f.probes);
    assert_eq!(progress.best_peak.load(relaxed), f.plan.arena_bytes);
    checker::check(&f.graph, &f.plan).unwrap();
    assert!(!f.recomputed.is_empty());
    assert!(f.added.flops > 0.0 && f.added.flops <= 0.01 * f.step.flops);
    assert!(
        f.plan.arena_bytes < f.base_arena,
        "{} vs {}",
        f.plan.arena_bytes,
        f.base_arena
    );
    assert_eq!((f.budget, f.max_added), (f.plan.arena_bytes, Some(0.01)));
    runs_like_the_reference(&g, &f);
    // Nothing allowed: only ops of no FLOPs (copies, layout changes) may
    // be recomputed.
    let free = fit_within(&g, 0.0, &o).unwrap();
    assert_eq!(free.added.flops, 0.0);
    assert!(free.plan.arena_bytes <= free.base_arena);
    for bad in [-0.1, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            fit_within(&g, bad, &o),
            Err(Error::InvalidArgument(_))
        ));
    }
}

/// Probes cut short (1 ms each) leave the answer planned far from what
/// the planner finds with time; the fit plans its answer again with the
/// time it held back, so the arena is what a full plan of the fitted step
/// gets.
#[test]
fn the_answer_is_planned_again_after_short_probes() {
    let g = gpt2::build(&Gpt2Config::small_config(6, 64, 4, 16, 2, 128)).unwrap();
    let o = FitOptions {
        objective: Objective::Flops,
        time_limit: Duration::from_secs(20),
        probe_time: Duration::from_millis(1),
        ..opts(0)
    };
    let f = fit_within(&g, 0.01, &o).unwrap();
    checker::check(&f.graph, &f.plan).unwrap();
    let full = memplan::plan(&f.graph, &memplan::Options::default()).unwrap();
    let short = memplan::plan(
        &f.graph,
        &memplan::Options {
            time_limit: Duration::from_millis(1),
            layouts: 1,
            ..memplan::Options::default()
        },
    )
    .unwrap();
    assert!(
        short.arena_bytes > full.arena_bytes,
        "the test needs a step whose short plan is worse: {} vs {}",
        short.arena_bytes,
        full.arena_bytes
    );
    assert!(
        f.plan.arena_bytes <= full.arena_bytes,
        "{} > {}",
        f.plan.arena_bytes,
        full.arena_bytes
    );
    assert!(f.added.flops <= 0.01 * f.step.flops);
}

/// A graph that already adds FLOPs to the step it was made from (a split
/// made outside the core): the share is of that step, those FLOPs count
/// against it, and a share they alone exceed is refused (`does_not_fit`).
#[test]
fn a_share_after_what_a_graph_already_adds() {
    let g = gpt2::build(&Gpt2Config::small_config(3, 32, 2, 16, 2, 64)).unwrap();
    let o = FitOptions {
        objective: Objective::Flops,
        time_limit: Duration::from_secs(4),
        ..opts(0)
    };
    let total = o.cost_model.checked_total(&g).unwrap().flops;
    // Nothing added already: the share itself.
    assert_eq!(
        memplan::fit::share_after(&g, 0.01, 0.0, &o).unwrap(),
        Some(0.01)
    );
    // Of a step of `total − a` FLOPs, 1% less the `a` already added,
    // as a share of this graph's `total`.
    let a = 0.004 * total;
    let share = memplan::fit::share_after(&g, 0.01, a, &o).unwrap().unwrap();
    let want = (0.01 * (total - a) - a) / total;
    assert!((share - want).abs() <= 1e-12, "{share} vs {want}");
    let f = memplan::fit::fit_within_after(&g, 0.01, a, &o).unwrap();
    assert!(f.added.flops + a <= 0.01 * (total - a) * (1.0 + 1e-9));
    assert_eq!(f.max_added, Some(0.01));
    checker::check(&f.graph, &f.plan).unwrap();
    // More already added than the share allows.
    assert_eq!(
        memplan::fit::share_after(&g, 0.01, 0.02 * total, &o).unwrap(),
        None
    );
    let e = memplan::fit::fit_within_after(&g, 0.01, 0.02 * total, &o).unwrap_err();
    assert!(matches!(e, Error::DoesNotFit(_)), "{e}");
    assert!(e.to_string().contains("more than max_added=0.01"), "{e}");
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        assert!(matches!(
            memplan::fit::share_after(&g, 0.01, bad, &o),
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[test]
fn fitted_mlp_runs_like_the_reference() {
    let cfg = MlpConfig {
        batch: 64,
        layers: 4,
        ..MlpConfig::default()
    };
    fits_and_runs_like_the_reference(&mlp::build(&cfg).unwrap(), 0.6);
}

#[test]
fn a_budget_below_the_floor_is_refused_with_its_reason() {
    let g = gpt2::build(&Gpt2Config::small_config(2, 32, 2, 16, 2, 64)).unwrap();
    let (floor, why) = fit_floor(&g);
    let e = fit(&g, &opts(floor - 1)).unwrap_err();
    assert!(matches!(e, Error::DoesNotFit(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("needs at least") && msg.contains(&floor.to_string()),
        "{msg}"
    );
    assert!(msg.contains(&why), "{msg}");
    // The floor is a true bound: the cheapest plan with everything that
    // can be recomputed recomputed is not below it.
    let all: Vec<OpId> = candidates(&g, &Default::default())
        .iter()
        .map(|c| c.op)
        .collect();
    let r = recompute(&g, &all).unwrap();
    let p = memplan::plan(&r, &memplan::Options::default()).unwrap();
    checker::check(&r, &p).unwrap();
    assert!(p.stats.max_live_bytes >= floor);
}

/// A random chain of `layers` forward ops with skips, a loss and the
/// backward pass reading the saved activations; every tensor 1 KiB.
fn random_step(seed: u64, layers: usize) -> Graph {
    let mut rng = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut next = |m: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % m
    };
    const S: u64 = 1024;
    let mut b = GraphBuilder::new(format!("random-{seed}"));
    let x = b.add_tensor(TensorSpec::new("x", S).role(Role::Input).persistent());
    let mut acts = vec![x];
    for i in 0..layers {
        let a = b.add_tensor(TensorSpec::new(format!("a{i}"), S));
        let mut ins = vec![*acts.last().unwrap()];
        if acts.len() > 1 && next(3) == 0 {
            ins.push(acts[next(acts.len() as u64 - 1) as usize]);
        }
        let cost = 1.0 + next(9) as f64;
        b.add_op(
            OpSpec::new(format!("f{i}"), OpKind::Forward, "f")
                .inputs(ins)
                .outputs([a])
                .cost(cost),
        );
        acts.push(a);
    }
    let mut grad = b.add_tensor(TensorSpec::new("loss.grad", S));
    b.add_op(
        OpSpec::new("loss", OpKind::Forward, "loss")
            .inputs([acts[layers]])
            .outputs([grad])
            .cost(1.0),
    );
    for i in (0..layers).rev() {
        let g = b.add_tensor(
            TensorSpec::new(format!("g{i}"), S)
                .role(if i == 0 { Role::Output } else { Role::Gradient })
                .lifetime(if i == 0 {
                    Lifetime::Persistent
                } else {
                    Lifetime::Transient
                }),
        );
        b.add_op(
            OpSpec::new(format!("b{i}"), OpKind::Backward, "b")
                .inputs([grad, acts[i]])
                .outputs([g])
                .cost(1.0),
        );
        grad = g;
    }
    b.build().unwrap()
}

/// The least max live bytes over every order of `g` (a dynamic program
/// over sets of scheduled ops).
fn brute_min_peak(g: &Graph) -> u64 {
    let n = g.num_ops();
    assert!(n <= 20);
    let deps: Vec<u32> = g
        .op_ids()
        .map(|o| g.deps(o).iter().fold(0u32, |m, d| m | 1 << d.index()))
        .collect();
    // Live bytes while op `o` runs after the ops in `done`.
    let live = |done: u32, o: usize| -> u64 {
        let with = done | 1 << o;
        g.tensor_ids()
            .filter(|&t| g.occupies_memory(t))
            .filter(|&t| {
                let x = g.tensor(t);
                let born = x.producer.is_none_or(|p| with >> p.index() & 1 == 1);
                let users = g.users_of_root(t);
                let needed = x.lifetime == Lifetime::Persistent
                    || x.producer == Some(OpId(o as u32))
                    || users
                        .iter()
                        .any(|u| with >> u.index() & 1 == 0 || u.index() == o);
                born && needed
            })
            .map(|t| g.tensor(t).size)
            .sum()
    };
    let mut best = vec![u64::MAX; 1 << n];
    best[0] = 0;
    for done in 0..(1u32 << n) {
        if best[done as usize] == u64::MAX {
            continue;
        }
        for o in 0..n {
            if done >> o & 1 == 0 && deps[o] & !done == 0 {
                let v = best[done as usize].max(live(done, o));
                let w = &mut best[(done | 1 << o) as usize];
                *w = (*w).min(v);
            }
        }
    }
    best[(1usize << n) - 1]
}

/// Every set of recomputation candidates of `g`: its summed price (`price`
/// of each candidate's cost) and its least max live bytes over every order.
fn every_set(g: &Graph, price: impl Fn(&OpCost) -> f64) -> Vec<(f64, u64)> {
    let cands = candidates(g, &Default::default());
    (0..1u32 << cands.len())
        .map(|m| {
            let pick = |i: &usize| m >> i & 1 == 1;
            let chosen: Vec<OpId> = (0..cands.len()).filter(pick).map(|i| cands[i].op).collect();
            let total = (0..cands.len())
                .filter(pick)
                .map(|i| price(&cands[i].cost))
                .sum();
            (total, brute_min_peak(&recompute(g, &chosen).unwrap()))
        })
        .collect()
}

#[test]
fn exact_fit_equals_brute_force_on_random_steps() {
    let mut checked = 0;
    for seed in 0..30 {
        let g = random_step(seed, 2 + (seed % 3) as usize);
        let sets = every_set(&g, |c| c.seconds);
        let lowest = sets.iter().map(|s| s.1).min().unwrap();
        let highest = sets.iter().map(|s| s.1).max().unwrap();
        for budget in [lowest, (lowest + highest) / 2, lowest - 1] {
            let want = sets
                .iter()
                .filter(|s| s.1 <= budget)
                .map(|s| s.0)
                .min_by(f64::total_cmp);
            match (fit(&g, &opts(budget)), want) {
                (Ok(f), Some(w)) => {
                    checker::check(&f.graph, &f.plan).unwrap();
                    assert!(f.plan.arena_bytes <= budget);
                    assert!(
                        (f.added.seconds - w).abs() < 1e-9,
                        "seed {seed} budget {budget}: {} vs {w}",
                        f.added.seconds
                    );
                    assert!(f.optimal, "seed {seed}: not proven");
                    checked += 1;
                }
                (Err(Error::DoesNotFit(_)), None) => {}
                (got, want) => panic!("seed {seed} budget {budget}: {got:?} vs {want:?}"),
            }
        }
    }
    assert!(checked >= 40, "{checked}");
}

/// Within a cost, the exact search's arena is the least max live bytes of
/// any recomputation set that costs no more, over every order (brute
/// force), and it spends no more than allowed. The floor within the cost
/// is never above it, and equal to it on at least half the caps.
#[test]
fn exact_fit_within_a_cost_equals_brute_force_on_random_steps() {
    let (mut checked, mut tight) = (0, 0);
    for seed in 0..30 {
        let g = random_step(seed, 2 + (seed % 3) as usize);
        let sets = every_set(&g, |c| c.seconds);
        let step = memplan::cost::CostModel::default().total(&g).seconds;
        let mut costs: Vec<f64> = sets.iter().map(|s| s.0).collect();
        costs.sort_by(f64::total_cmp);
        costs.dedup();
        // Caps between two set costs, so rounding cannot move a set across.
        let caps = [0, costs.len() / 3, 2 * costs.len() / 3, costs.len() - 1].map(|i| match costs
            .get(i + 1)
        {
            Some(next) => (costs[i] + next) / 2.0,
            None => costs[i] * 1.5 + 1.0,
        });
        for cap in caps {
            let want = sets
                .iter()
                .filter(|s| s.0 <= cap)
                .map(|s| s.1)
                .min()
                .unwrap();
            let f = fit_within(&g, cap / step, &opts(0)).unwrap();
            checker::check(&f.graph, &f.plan).unwrap();
            assert_eq!(f.plan.arena_bytes, want, "seed {seed} cap {cap}");
            assert!(f.added.seconds <= cap * (1.0 + 1e-12), "seed {seed}");
            assert!(f.optimal, "seed {seed}: not proven");
            // The floor within the share holds for every set and order.
            let floor = f.share_floor.as_ref().unwrap();
            assert!(floor.finished);
            assert!(
                floor.bytes <= want,
                "seed {seed} cap {cap}: {floor:?} > {want}"
            );
            tight += usize::from(floor.bytes == want);
            checked += 1;
        }
    }
    assert!(checked >= 100, "{checked}");
    eprintln!("floor within the share tight on {tight} of {checked}");
    assert!(tight * 2 >= checked, "tight on only {tight} of {checked}");
}

/// With `Objective::Flops` the exact search minimises added FLOPs, which
/// here run against the time estimate (an op's FLOPs are 11 − its cost), so
/// the two objectives choose differently.
#[test]
fn exact_fit_minimises_flops_when_asked() {
    let mut differ = 0;
    for seed in 0..20 {
        let mut g = random_step(seed, 3 + (seed % 2) as usize);
        let flops: Vec<f64> = g.ops().iter().map(|o| 11.0 - o.cost.unwrap()).collect();
        g.set_flops(&flops);
        let sets = every_set(&g, |c| c.flops);
        let lowest = sets.iter().map(|s| s.1).min().unwrap();
        let highest = sets.iter().map(|s| s.1).max().unwrap();
        let budget = (lowest + highest) / 2;
        let Some(want) = sets
            .iter()
            .filter(|s| s.1 <= budget)
            .map(|s| s.0)
            .min_by(f64::total_cmp)
        else {
            continue;
        };
        let by = |objective| {
            fit(
                &g,
                &FitOptions {
                    objective,
                    ..opts(budget)
                },
            )
            .unwrap()
        };
        let f = by(Objective::Flops);
        checker::check(&f.graph, &f.plan).unwrap();
        assert!(f.plan.arena_bytes <= budget && f.optimal);
        assert!(
            (f.added.flops - want).abs() < 1e-9,
            "seed {seed}: {} vs {want}",
            f.added.flops
        );
        let t = by(Objective::Time);
        assert!(t.added.seconds <= f.added.seconds + 1e-9, "seed {seed}");
        if f.added.flops < t.added.flops - 1e-9 {
            differ += 1;
        }
    }
    assert!(differ > 0, "the objectives never chose differently");
}

/// A view that a backward op makes of a recomputed tensor is a view of the
/// copy, so the original dies at its last forward use (AOTAutograd's
/// backward graphs `detach` saved tensors before reading them).
#[test]
fn backward_views_of_recomputed_tensors_follow_the_copy() {
    let mut b = GraphBuilder::new("views");
    let x = b.add_tensor(TensorSpec::new("x", 8).role(Role::Input).persistent());
    let a = b.add_tensor(TensorSpec::new("a", 1000));
    let l = b.add_tensor(TensorSpec::new("l", 8));
    let big = b.add_tensor(TensorSpec::new("big", 500));
    let g1 = b.add_tensor(TensorSpec::new("g1", 8));
    let av = b.add_tensor(TensorSpec::new("a.detach", 1000).view_of(a));
    let grad = b.add_tensor(TensorSpec::new("grad", 8).role(Role::Output).persistent());
    let op = |name: &str, kind| OpSpec::new(name, kind, name).cost(1.0);
    b.add_op(op("f", OpKind::Forward).inputs([x]).outputs([a]));
    b.add_op(op("loss", OpKind::Forward).inputs([a]).outputs([l]));
    b.add_op(op("tmp", OpKind::Backward).inputs([l]).outputs([big]));
    b.add_op(op("back1", OpKind::Backward).inputs([big]).outputs([g1]));
    b.add_op(op("detach", OpKind::Backward).inputs([a]).outputs([av]));
    b.add_op(
        op("back2", OpKind::Backward)
            .inputs([av, g1])
            .outputs([grad]),
    );
    let g = b.build().unwrap();
    let r = recompute(&g, &[g.op_by_name("f").unwrap()]).unwrap();
    let copy = r.tensor_by_name("recompute.a").expect("a copy of a");
    let view = r.tensor_by_name("a.detach").unwrap();
    assert_eq!(r.tensor(view).view_of, Some(copy));
    // Without recomputation `a` is live with `big`: x + a + l + big. With
    // it, the copy is made after `big` dies: x + a' + g1 + grad.
    let opts = memplan::Options::default();
    let plain = memplan::plan(&g, &opts).unwrap();
    let fitted = memplan::plan(&r, &opts).unwrap();
    checker::check(&r, &fitted).unwrap();
    assert_eq!(plain.stats.max_live_bytes, 1516);
    assert_eq!(fitted.stats.max_live_bytes, 1024);
}

/// The recomputed graph names, for each op it adds, the op it copies
/// (`metadata.recompute_of`): every added op, and only those, each with
/// its original's type and arity, also where a name was taken and the copy
/// got another (`rerecompute.…`).
#[test]
fn each_copy_names_its_original() {
    let mut b = GraphBuilder::new("taken");
    let x = b.add_tensor(TensorSpec::new("x", 64).role(Role::Input).persistent());
    let h = b.add_tensor(TensorSpec::new("h", 1024));
    let y = b.add_tensor(TensorSpec::new("y", 64));
    // A tensor already called what the copy of `h` would be.
    let taken = b.add_tensor(TensorSpec::new("recompute.h", 64));
    let dx = b.add_tensor(TensorSpec::new("dx", 64).role(Role::Output).persistent());
    b.add_op(
        OpSpec::new("f", OpKind::Forward, "relu")
            .inputs([x])
            .outputs([h]),
    );
    b.add_op(
        OpSpec::new("recompute.f", OpKind::Forward, "sum")
            .inputs([h])
            .outputs([y]),
    );
    b.add_op(
        OpSpec::new("g", OpKind::Forward, "copy")
            .inputs([y])
            .outputs([taken]),
    );
    b.add_op(
        OpSpec::new("b", OpKind::Backward, "relu_backward")
            .inputs([h, taken])
            .outputs([dx]),
    );
    let g = b.build().unwrap();
    let r = recompute(&g, &[g.op_by_name("f").unwrap()]).unwrap();
    let copy_of = r.metadata[COPY_OF].as_object().expect("a map");
    let added: Vec<&str> = r
        .ops()
        .iter()
        .map(|o| o.name.as_str())
        .filter(|n| g.op_by_name(n).is_none())
        .collect();
    assert_eq!(added.len(), 1, "{added:?}");
    assert_eq!(copy_of.len(), 1, "{copy_of:?}");
    let (copy, original) = copy_of.iter().next().unwrap();
    assert_eq!(copy, added[0]);
    assert_ne!(copy, "recompute.f", "the name was taken");
    assert_eq!(original, "f");
    let (c, o) = (
        r.op(r.op_by_name(copy).unwrap()),
        g.op(g.op_by_name("f").unwrap()),
    );
    assert_eq!(
        (c.op_type.as_str(), c.inputs.len(), c.outputs.len()),
        (o.op_type.as_str(), o.inputs.len(), o.outputs.len())
    );
    // The graph file keeps it.
    let back = memplan::io::json::parse_graph(
        &memplan::io::json::write_graph(&r),
        std::path::Path::new("r.json"),
    )
    .unwrap();
    assert_eq!(back.metadata[COPY_OF], r.metadata[COPY_OF]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

    /// On random graphs (views, in-place updates, reuse hints, persistent
    /// outputs), the floor within a share is at most the least max live
    /// bytes of every recomputation set within it over every order (brute
    /// force), and at most what the fit's own plan keeps live.
    #[test]
    fn the_floor_within_a_share_holds_on_random_graphs(
        g in memplan::testing::graph(7),
        pick in 0usize..4,
    ) {
        // (The brute force counts bytes while ops run: none without ops.)
        proptest::prop_assume!(g.num_ops() > 0);
        let sets = every_set(&g, |c| c.seconds);
        let step = memplan::cost::CostModel::default().total(&g).seconds;
        let mut costs: Vec<f64> = sets.iter().map(|s| s.0).collect();
        costs.sort_by(f64::total_cmp);
        costs.dedup();
        let i = pick * (costs.len() - 1) / 3;
        let cap = match costs.get(i + 1) {
            Some(next) => (costs[i] + next) / 2.0,
            None => costs[i] * 1.5 + 1e-9,
        };
        let want = sets.iter().filter(|s| s.0 <= cap).map(|s| s.1).min().unwrap();
        let prices: Vec<f64> = g
            .op_ids()
            .map(|o| memplan::cost::CostModel::default().op(&g, o).seconds)
            .collect();
        let floor = memplan::fit::floor_within(&g, &prices, cap, None);
        proptest::prop_assert!(floor.bytes <= want, "{floor:?} > {want}");
        if step > 0.0 {
            let f = fit_within(&g, cap / step, &opts(0)).unwrap();
            checker::check(&f.graph, &f.plan).unwrap();
            let got = f.share_floor.as_ref().unwrap().bytes;
            proptest::prop_assert!(got <= f.plan.stats.max_live_bytes, "{got} > {}", f.plan.stats.max_live_bytes);
        }
    }
}

/// A forward op that updates a running statistic in place (batch norm in
/// training) is recomputed only when the graph says a copy may skip the
/// update (`rerun_without_updates`); the copy then lists no updates, so the
/// statistic is updated once.
#[test]
fn an_op_whose_updates_a_copy_may_skip_is_recomputed_without_them() {
    let step = |flag: bool| {
        const S: u64 = 1 << 20;
        let mut b = GraphBuilder::new("norm");
        let x = b.add_tensor(TensorSpec::new("x", S).role(Role::Input).persistent());
        let stats = b.add_tensor(
            TensorSpec::new("running", 64)
                .role(Role::Parameter)
                .persistent(),
        );
        let y = b.add_tensor(TensorSpec::new("y", S));
        let z = b.add_tensor(TensorSpec::new("z", S));
        let l = b.add_tensor(TensorSpec::new("l", 4));
        let gz = b.add_tensor(TensorSpec::new("gz", S));
        let gx = b.add_tensor(TensorSpec::new("gx", S).role(Role::Output).persistent());
        let mut norm = OpSpec::new("norm", OpKind::Forward, "batch_norm")
            .inputs([x])
            .outputs([y])
            .updates([stats])
            .cost(1e-6);
        if flag {
            norm = norm.attr(memplan::fit::RERUN_WITHOUT_UPDATES, true);
        }
        b.add_op(norm);
        b.add_op(
            OpSpec::new("f", OpKind::Forward, "f")
                .inputs([y])
                .outputs([z])
                .cost(1.0),
        );
        b.add_op(
            OpSpec::new("loss", OpKind::Forward, "loss")
                .inputs([z])
                .outputs([l])
                .cost(1.0),
        );
        b.add_op(
            OpSpec::new("bz", OpKind::Backward, "bz")
                .inputs([l, z])
                .outputs([gz])
                .cost(1.0),
        );
        b.add_op(
            OpSpec::new("by", OpKind::Backward, "by")
                .inputs([gz, y])
                .outputs([gx])
                .cost(1.0),
        );
        b.build().unwrap()
    };
    let plain = step(false);
    assert!(
        candidates(&plain, &Default::default())
            .iter()
            .all(|c| plain.op(c.op).name != "norm")
    );
    let g = step(true);
    let norm = g.op_by_name("norm").unwrap();
    assert!(
        candidates(&g, &Default::default())
            .iter()
            .any(|c| c.op == norm)
    );
    let r = recompute(&g, &[norm]).unwrap();
    let copy = r.op_by_name("recompute.norm").unwrap();
    assert!(r.op(copy).updates.is_empty());
    assert_eq!(r.op(copy).inputs, vec![g.tensor_by_name("x").unwrap()]);
    let updated = r.op_ids().filter(|&o| !r.op(o).updates.is_empty()).count();
    assert_eq!(updated, 1, "the statistic is updated once");
    // The fit uses it: within a tiny share, y (1 MiB) is made again for
    // by instead of being kept across bz.
    let f = fit_within(&g, 1e-4, &opts(0)).unwrap();
    checker::check(&f.graph, &f.plan).unwrap();
    assert_eq!(f.recomputed, vec!["norm".to_string()]);
    let without = fit_within(&plain, 1e-4, &opts(0)).unwrap();
    assert!(f.plan.arena_bytes < without.plan.arena_bytes);
}
