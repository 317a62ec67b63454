//! Running planned steps on the CPU executor: a planned run (one arena of
//! the planned size, the plan's order and reuses) matches the unplanned
//! reference (program order, every tensor in bytes of its own) — loss,
//! parameters and optimizer state — single-device and sharded over 1, 2 and
//! 4 ranks; the sharded step matches one device running the whole batch;
//! the loss goes down over steps on a fixed batch.

use std::collections::HashMap;
use std::time::Duration;

use memplan::exec;
use memplan::graph::Graph;
use memplan::models::fsdp;
use memplan::models::gpt2::{self, Gpt2Config};
use memplan::models::mlp::{self, MlpConfig};
use memplan::{Options, Plan, checker};
use memplan_runtime::binding::Bindings;
use memplan_runtime::runner::{RunConfig, RunReport, run_cpu};

fn plan(g: &Graph) -> Plan {
    let opts = Options {
        time_limit: Duration::from_secs(2),
        ..Options::default()
    };
    let p = memplan::plan(g, &opts).unwrap();
    checker::check(g, &p).unwrap();
    p
}

fn run(g: &Graph, plan: &Plan, steps: usize) -> RunReport {
    let p = exec::program(g, plan).unwrap();
    let cfg = RunConfig {
        steps,
        keep_state: true,
        ..RunConfig::default()
    };
    run_cpu(&p, &cfg).unwrap()
}

fn close(what: &str, a: &[f32], b: &[f32], rtol: f32, atol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= atol + rtol * y.abs(),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

/// Planned vs unplanned: same losses and same final state on every rank.
fn planned_matches_unplanned(g: &Graph, steps: usize) -> (RunReport, Plan) {
    let planned = plan(g);
    let reference = exec::unplanned_plan(g);
    assert!(
        planned.arena_bytes < reference.arena_bytes,
        "the plan should share bytes"
    );
    let a = run(g, &planned, steps);
    let b = run(g, &reference, steps);
    assert_eq!(a.arena_bytes, planned.arena_bytes);
    for (s, (x, y)) in a.steps.iter().zip(&b.steps).enumerate() {
        assert!(x.loss.is_finite());
        close(
            &format!("loss at step {s}"),
            &[x.loss],
            &[y.loss],
            1e-6,
            1e-6,
        );
    }
    assert_eq!(a.state.len(), b.state.len());
    for (ra, rb) in a.state.iter().zip(&b.state) {
        assert_eq!(ra.len(), rb.len());
        assert!(!ra.is_empty());
        for ((na, va), (nb, vb)) in ra.iter().zip(rb) {
            assert_eq!(na, nb);
            close(na, va, vb, 1e-5, 1e-7);
        }
    }
    (a, planned)
}

fn tiny() -> Gpt2Config {
    Gpt2Config::small_config(2, 32, 2, 16, 2, 64)
}

#[test]
fn gpt2_planned_step_matches_the_unplanned_reference() {
    let g = gpt2::build(&tiny()).unwrap();
    let (_, planned) = planned_matches_unplanned(&g, 3);
    // The plan took reuses, and the executor ran them in place.
    assert!(!planned.reuses.is_empty());
    let p = exec::program(&g, &planned).unwrap();
    let b = Bindings::new(&p).unwrap();
    assert!(b.instrs.iter().any(|i| !i.aliased.is_empty()));
    assert_eq!(b.workspace_bytes, 0);
}

#[test]
fn gpt2_with_checkpointing_and_clipping_matches_the_reference() {
    let mut cfg = tiny();
    cfg.checkpoint = true;
    cfg.clip_grad_norm = Some(0.5);
    cfg.optimizer = gpt2::Optimizer::Adam;
    let g = gpt2::build(&cfg).unwrap();
    planned_matches_unplanned(&g, 2);
}

#[test]
fn mlp_planned_step_matches_the_reference() {
    let cfg = MlpConfig {
        input: 20,
        hidden: 32,
        layers: 2,
        classes: 5,
        batch: 8,
        ..MlpConfig::default()
    };
    let g = mlp::build(&cfg).unwrap();
    planned_matches_unplanned(&g, 3);
}

#[test]
fn fsdp_planned_steps_match_the_reference_for_1_2_and_4_ranks() {
    let g = gpt2::build(&tiny()).unwrap();
    for w in [1, 2, 4] {
        let s = fsdp::shard(&g, w).unwrap();
        let (rep, _) = planned_matches_unplanned(&s, 2);
        assert_eq!(rep.state.len(), w as usize);
    }
}

/// Reassembles every parameter and moment of a sharded run by name.
fn unshard(s: &Graph, rep: &RunReport) -> HashMap<String, Vec<f32>> {
    let mut out = HashMap::new();
    for op in s.ops() {
        let Some(segs) = op.attrs.get("init_segments").and_then(|v| v.as_array()) else {
            continue;
        };
        let names: Vec<String> = op
            .updates
            .iter()
            .map(|&t| s.tensor(t).name.clone())
            .collect();
        for (k, suffix) in ["", ".adam_m", ".adam_v"].iter().enumerate() {
            let mut flat = Vec::new();
            for rank in &rep.state {
                let (_, v) = rank.iter().find(|(n, _)| *n == names[k]).unwrap();
                flat.extend_from_slice(v);
            }
            for seg in segs {
                let name = seg["name"].as_str().unwrap();
                let off = seg["offset"].as_u64().unwrap() as usize;
                let n = seg["elements"].as_u64().unwrap() as usize;
                out.insert(format!("{name}{suffix}"), flat[off..off + n].to_vec());
            }
        }
    }
    out
}

fn sharded_matches_one_device(cfg: &Gpt2Config, world: u64, steps: usize) {
    let mut whole = cfg.clone();
    whole.batch = cfg.batch * world;
    let g1 = gpt2::build(&whole).unwrap();
    let one = run(&g1, &plan(&g1), steps);
    let s = fsdp::shard(&gpt2::build(cfg).unwrap(), world).unwrap();
    let many = run(&s, &plan(&s), steps);
    for (x, y) in many.steps.iter().zip(&one.steps) {
        close("loss", &[x.loss], &[y.loss], 1e-5, 1e-6);
    }
    let got = unshard(&s, &many);
    let mut compared = 0;
    for (name, want) in &one.state[0] {
        if let Some(v) = got.get(name) {
            close(name, v, want, 2e-3, 2e-6);
            compared += 1;
        }
    }
    // Every parameter with its two moments.
    let params = g1
        .tensors()
        .iter()
        .filter(|t| t.role == memplan::graph::Role::Parameter)
        .count();
    assert_eq!(compared, 3 * params);
}

#[test]
fn fsdp_over_ranks_equals_one_device_with_the_whole_batch() {
    sharded_matches_one_device(&Gpt2Config::small_config(2, 32, 2, 8, 1, 64), 2, 2);
    sharded_matches_one_device(&Gpt2Config::small_config(1, 32, 4, 8, 1, 48), 4, 2);
    let mut clipped = Gpt2Config::small_config(1, 32, 2, 8, 1, 64);
    clipped.clip_grad_norm = Some(0.1);
    sharded_matches_one_device(&clipped, 2, 2);
}

#[test]
fn loss_goes_down_on_a_fixed_batch() {
    let mut cfg = tiny();
    cfg.lr = 3e-3;
    for g in [
        gpt2::build(&cfg).unwrap(),
        fsdp::shard(&gpt2::build(&cfg).unwrap(), 2).unwrap(),
    ] {
        let rep = run(&g, &plan(&g), 6);
        let l: Vec<f32> = rep.steps.iter().map(|s| s.loss).collect();
        // Starts near ln(vocab) and falls at every step.
        assert!((l[0] - (64f32).ln()).abs() < 0.5, "{l:?}");
        assert!(l.windows(2).all(|w| w[1] < w[0]), "{l:?}");
        assert!(l[5] < l[0] - 0.2, "{l:?}");
    }
}

/// Fused attention computes the same step as the explicit one (to f32
/// rounding: the softmax is normalised in another order), runs planned as
/// unplanned, and needs less memory once the `[B, H, T, T]` scores matter.
#[test]
fn fused_attention_matches_explicit_attention_with_less_memory() {
    // Sequence 70: tiles of 64 and 32 both end part-way.
    let mut cfg = Gpt2Config::small_config(2, 32, 2, 70, 2, 64);
    let explicit = gpt2::build(&cfg).unwrap();
    cfg.fused_attention = true;
    let fused = gpt2::build(&cfg).unwrap();
    let (f, fused_plan) = planned_matches_unplanned(&fused, 3);
    let e = run(&explicit, &plan(&explicit), 3);
    for (s, (x, y)) in f.steps.iter().zip(&e.steps).enumerate() {
        close(
            &format!("loss at step {s}"),
            &[x.loss],
            &[y.loss],
            1e-5,
            1e-6,
        );
    }
    for ((na, va), (nb, vb)) in f.state[0].iter().zip(&e.state[0]) {
        assert_eq!(na, nb);
        close(na, va, vb, 1e-3, 1e-5);
    }
    assert!(
        fused_plan.arena_bytes < plan(&explicit).arena_bytes,
        "fused {} vs explicit {}",
        fused_plan.arena_bytes,
        plan(&explicit).arena_bytes
    );
    // With checkpointing and clipping too.
    cfg.checkpoint = true;
    cfg.clip_grad_norm = Some(0.5);
    planned_matches_unplanned(&gpt2::build(&cfg).unwrap(), 2);
}
