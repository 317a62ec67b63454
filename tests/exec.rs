//! Running planned steps on the CPU executor: a planned run (one arena of
//! the planned size, the plan's order and reuses) matches the unplanned
//! reference (program order, every tensor in bytes of its own) — loss,
//! parameters and optimizer state — single-device and sharded over 1, 2 and
//! 4 ranks; the sharded step matches one device running the whole batch;
//! the loss goes down over steps on a fixed batch. For the Llama step, a
//! finite-difference check of the whole step's gradients too.

use std::collections::HashMap;
use std::time::Duration;

use memplan::exec;
use memplan::graph::Graph;
use memplan::models::fsdp;
use memplan::models::gpt2::{self, Gpt2Config};
use memplan::models::llama::{self, LlamaConfig};
use memplan::models::mlp::{self, MlpConfig};
use memplan::{Options, Plan, checker};
use memplan_runtime::binding::Bindings;
use memplan_runtime::runner::{RunConfig, RunReport, loss_tensors, run_cpu, synthetic_batch};
use memplan_runtime::{CpuExecutor, Executor, SingleRank};

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

#[test]
fn a_profiled_run_times_every_instruction_by_kernel() {
    let g = mlp::build(&MlpConfig::default()).unwrap();
    let p = exec::program(&g, &plan(&g)).unwrap();
    let cfg = RunConfig {
        steps: 3,
        profile: true,
        ..RunConfig::default()
    };
    let r = run_cpu(&p, &cfg).unwrap();
    assert_eq!(
        r.profile.iter().map(|k| k.instrs).sum::<usize>(),
        p.instrs.len()
    );
    let kernels: std::collections::HashSet<_> = p.instrs.iter().map(|i| i.kernel.name()).collect();
    assert_eq!(r.profile.len(), kernels.len());
    assert!(r.profile.windows(2).all(|w| w[0].seconds >= w[1].seconds));
    // The instructions' time is within the steps' (the profiled steps are
    // the second and third).
    let timed: f64 = r.profile.iter().map(|k| k.seconds).sum();
    let steps = (r.steps[1].seconds + r.steps[2].seconds) / 2.0;
    assert!(timed > 0.0 && timed <= steps, "{timed} s of {steps} s");
    // Off by default, and profiling changes no result.
    let plain = run_cpu(
        &p,
        &RunConfig {
            steps: 3,
            ..RunConfig::default()
        },
    )
    .unwrap();
    assert!(plain.profile.is_empty());
    for (a, b) in plain.steps.iter().zip(&r.steps) {
        assert_eq!(a.loss, b.loss);
    }
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

/// `build(b)`: the step with batch `b`; the step with batch `batch` sharded
/// over `world` ranks against one device with batch `world · batch`.
fn sharded_matches_one_device(build: &dyn Fn(u64) -> Graph, batch: u64, world: u64, steps: usize) {
    sharded_with_matches_one_device(build, batch, &fsdp::FsdpOptions::new(world), steps)
}

/// [`sharded_matches_one_device`] sharded as `opts` says.
fn sharded_with_matches_one_device(
    build: &dyn Fn(u64) -> Graph,
    batch: u64,
    opts: &fsdp::FsdpOptions,
    steps: usize,
) {
    let world = opts.world;
    let g1 = build(batch * world);
    let one = run(&g1, &plan(&g1), steps);
    let s = fsdp::shard_with(&build(batch), opts, &fsdp::default_unit).unwrap();
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
    let gpt2_with = |cfg: Gpt2Config| {
        move |b: u64| {
            let mut c = cfg.clone();
            c.batch = b;
            gpt2::build(&c).unwrap()
        }
    };
    let a = gpt2_with(Gpt2Config::small_config(2, 32, 2, 8, 1, 64));
    sharded_matches_one_device(&a, 1, 2, 2);
    let b = gpt2_with(Gpt2Config::small_config(1, 32, 4, 8, 1, 48));
    sharded_matches_one_device(&b, 1, 4, 2);
    // Three ranks: no row count divides, every shard is padded.
    sharded_matches_one_device(&b, 1, 3, 2);
    let mut clipped = Gpt2Config::small_config(1, 32, 2, 8, 1, 64);
    clipped.clip_grad_norm = Some(0.1);
    sharded_matches_one_device(&gpt2_with(clipped.clone()), 1, 2, 2);
    // FSDP1's flat shards compute the same step.
    for world in [2, 4] {
        let flat = fsdp::FsdpOptions {
            layout: fsdp::ShardLayout::Flat,
            ..fsdp::FsdpOptions::new(world)
        };
        sharded_with_matches_one_device(&gpt2_with(clipped.clone()), 1, &flat, 2);
    }
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

/// A Llama step small enough for finite differences: grouped-query
/// attention (4 query heads, 2 key/value heads), sequence 70 (tiles end
/// part-way).
fn tiny_llama() -> LlamaConfig {
    LlamaConfig {
        layers: 2,
        width: 32,
        heads: 4,
        kv_heads: 2,
        ffn: 48,
        vocab: 64,
        seq: 70,
        batch: 2,
        ..LlamaConfig::preset("llama-tiny").unwrap()
    }
}

#[test]
fn llama_planned_step_matches_the_unplanned_reference() {
    let g = llama::build(&tiny_llama()).unwrap();
    let (_, planned) = planned_matches_unplanned(&g, 3);
    // RoPE and its backward ran in place where the plan took the reuse.
    let p = exec::program(&g, &planned).unwrap();
    let b = Bindings::new(&p).unwrap();
    assert!(b.instrs.iter().any(|i| !i.aliased.is_empty()));
    // Checkpointing, clipping and a tied head.
    let mut cfg = tiny_llama();
    cfg.checkpoint = true;
    cfg.clip_grad_norm = Some(0.5);
    cfg.tied = true;
    planned_matches_unplanned(&llama::build(&cfg).unwrap(), 2);
}

#[test]
fn llama_fsdp_matches_the_reference_and_one_device() {
    let mut cfg = tiny_llama();
    cfg.seq = 16;
    cfg.batch = 1;
    let g = llama::build(&cfg).unwrap();
    for w in [1, 2, 4] {
        let s = fsdp::shard(&g, w).unwrap();
        // A unit per block: `layers.0`, `layers.1`, then the others.
        let gathers = s.ops().iter().filter(|o| o.op_type == "all_gather").count();
        assert!(gathers >= 4, "{gathers} all-gathers");
        let (rep, _) = planned_matches_unplanned(&s, 2);
        assert_eq!(rep.state.len(), w as usize);
    }
    let build = move |b: u64| {
        let mut c = cfg.clone();
        c.batch = b;
        llama::build(&c).unwrap()
    };
    sharded_matches_one_device(&build, 1, 2, 2);
    sharded_matches_one_device(&build, 1, 4, 2);
    // FSDP2's options change when parameters are gathered, not the result.
    for (prefetch, reshard_after_forward) in [(0, true), (2, true), (1, false)] {
        let opts = fsdp::FsdpOptions {
            prefetch,
            reshard_after_forward,
            ..fsdp::FsdpOptions::new(2)
        };
        let s = fsdp::shard_with(&g, &opts, &fsdp::default_unit).unwrap();
        planned_matches_unplanned(&s, 2);
    }
}

#[test]
fn llama_loss_goes_down_on_a_fixed_batch() {
    let mut cfg = tiny_llama();
    cfg.lr = 3e-3;
    let g = llama::build(&cfg).unwrap();
    let rep = run(&g, &plan(&g), 6);
    let l: Vec<f32> = rep.steps.iter().map(|s| s.loss).collect();
    assert!((l[0] - (64f32).ln()).abs() < 0.5, "{l:?}");
    assert!(l.windows(2).all(|w| w[1] < w[0]), "{l:?}");
    assert!(l[5] < l[0] - 0.2, "{l:?}");
}

/// One step of `g` (unplanned: every tensor keeps its bytes) with
/// element `at` of parameter `param` moved by `h`: the loss, and the
/// executor after the step. The projections start 10× larger than their
/// init so that attention scores and gates are of order one and every
/// gradient stands well above the finite differences' rounding.
fn llama_step(g: &Graph, nudge: Option<(&str, usize, f32)>) -> (f32, CpuExecutor) {
    let p = exec::program(g, &exec::unplanned_plan(g)).unwrap();
    let mut ex = CpuExecutor::new(p.clone(), 0).unwrap();
    ex.initialize(0).unwrap();
    for name in ["layers.0.attention.wqkv", "layers.0.feed_forward.w13"] {
        let t = p.tensor_by_name(name).unwrap();
        let v: Vec<f32> = ex.read_f32(t).unwrap().iter().map(|x| 10.0 * x).collect();
        ex.write_f32(t, &v).unwrap();
    }
    if let Some((name, at, h)) = nudge {
        let t = p.tensor_by_name(name).unwrap();
        let mut v = ex.read_f32(t).unwrap();
        v[at] += h;
        ex.write_f32(t, &v).unwrap();
    }
    ex.write(&synthetic_batch(&p, 1, 0).unwrap()).unwrap();
    ex.step(&SingleRank).unwrap();
    let loss = ex.read_f32(loss_tensors(&p)[0]).unwrap()[0];
    (loss, ex)
}

/// The whole Llama step's gradients (embedding, RMSNorm, the query, key and
/// value parts of the projection through RoPE and grouped-query attention,
/// the gate and up parts of SwiGLU, the head) against central differences
/// of its loss.
#[test]
fn llama_gradients_match_finite_differences() {
    let cfg = LlamaConfig {
        layers: 1,
        width: 16,
        heads: 4,
        kv_heads: 2,
        ffn: 24,
        vocab: 32,
        seq: 6,
        batch: 2,
        ..LlamaConfig::preset("llama-tiny").unwrap()
    };
    let g = llama::build(&cfg).unwrap();
    let (_, ex) = llama_step(&g, None);
    let p = ex.program().clone();
    let (c, d) = (16usize, 4usize);
    let qkv_cols = (4 + 2 * 2) * d;
    let probes: Vec<(&str, Vec<usize>)> = vec![
        ("tok_embeddings.weight", vec![0, 100, 31 * c + 5]),
        ("layers.0.attention_norm.weight", vec![0, 7]),
        // Query, key and value columns of rows 0 and 3.
        (
            "layers.0.attention.wqkv",
            vec![1, c + 2, c + 2 * d + 3, 3 * qkv_cols + 5],
        ),
        ("layers.0.attention.wo", vec![0, 77]),
        ("layers.0.ffn_norm.weight", vec![3]),
        // Gate and up columns.
        ("layers.0.feed_forward.w13", vec![2, 24 + 2, 5 * 48 + 30]),
        ("layers.0.feed_forward.w2", vec![0, 200]),
        ("norm.weight", vec![9]),
        ("output.weight", vec![0, 300]),
    ];
    let h = 1e-2f32;
    let mut checked = 0;
    for (name, ats) in probes {
        let grad = ex
            .read_f32(p.tensor_by_name(&format!("{name}.grad")).unwrap())
            .unwrap();
        for at in ats {
            let (up, _) = llama_step(&g, Some((name, at, h)));
            let (down, _) = llama_step(&g, Some((name, at, -h)));
            let fd = (up - down) / (2.0 * h);
            assert!(
                (fd - grad[at]).abs() <= 2e-5 + 0.03 * grad[at].abs(),
                "{name}[{at}]: finite difference {fd}, gradient {}",
                grad[at]
            );
            checked += usize::from(grad[at].abs() > 1e-3);
        }
    }
    // Tokens 0 and 3 are absent from the batch (zero gradient); nearly
    // every other probe is a gradient far above the tolerance.
    assert!(checked >= 17, "{checked} probes with a gradient above 1e-3");
}

/// Relative L2 distance of two runs' final f32 state (parameters and
/// moments), over every element of rank 0.
fn state_distance(a: &RunReport, b: &RunReport) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for ((na, va), (nb, vb)) in a.state[0].iter().zip(&b.state[0]) {
        assert_eq!(na, nb);
        for (&x, &y) in va.iter().zip(vb) {
            d += (x as f64 - y as f64).powi(2);
            n += (y as f64).powi(2);
        }
    }
    (d / n).sqrt()
}

/// Mixed precision (bf16 compute and activations, f32 master weights and
/// moments): planned equals unplanned, single-device and sharded (the
/// gathers move bf16), and the step stays within a documented distance of
/// the f32 step: losses within 0.1% and parameters and moments within 1%
/// (relative L2) after 3 steps (measured: 1.1e-5 and 1.1e-3).
#[test]
fn mixed_precision_steps_match_their_reference_and_stay_near_f32() {
    let mut cfg = tiny_llama();
    let f32_graph = llama::build(&cfg).unwrap();
    cfg.mixed_precision = true;
    cfg.dtype = memplan::models::DType::BF16;
    let g = llama::build(&cfg).unwrap();
    let casts = g.ops().iter().filter(|o| o.op_type == "cast").count();
    assert!(casts > 2 * 10, "weight and gradient casts: {casts}");
    let (mixed, planned) = planned_matches_unplanned(&g, 3);
    let full = run(&f32_graph, &plan(&f32_graph), 3);
    assert!(planned.arena_bytes < plan(&f32_graph).arena_bytes);
    for (x, y) in mixed.steps.iter().zip(&full.steps) {
        assert!(
            (x.loss - y.loss).abs() <= 1e-3 * y.loss,
            "{} vs {}",
            x.loss,
            y.loss
        );
    }
    let dist = state_distance(&mixed, &full);
    assert!(dist < 0.01, "state {dist}");
    // Sharded: the all-gathers move bf16, the reduce-scatters f32; as in
    // FSDP2, each gradient stays bf16 and `chunk_cat` packs it into the
    // f32 reduce-scatter input (no f32 copy of each gradient, no cast of
    // a gradient before the reduction).
    let s = fsdp::shard(&g, 2).unwrap();
    let mut packed = 0;
    for o in s.ops() {
        let dt = |t: &memplan::graph::TensorId| s.tensor(*t).dtype.clone().unwrap();
        match o.op_type.as_str() {
            "all_gather" => assert_eq!(dt(&o.outputs[0]), "bf16", "{}", o.name),
            "reduce_scatter" => assert_eq!(dt(&o.outputs[0]), "f32", "{}", o.name),
            "chunk_cat" => {
                assert_eq!(dt(&o.outputs[0]), "f32", "{}", o.name);
                assert!(o.inputs.iter().all(|t| dt(t) == "bf16"), "{}", o.name);
                packed += 1;
            }
            "cast" => assert!(
                o.kind != memplan::graph::OpKind::Backward,
                "a gradient cast before the reduction: {}",
                o.name
            ),
            _ => {}
        }
    }
    assert!(packed > 0);
    planned_matches_unplanned(&s, 2);
    // Reducing in bf16: the reduce-scatters move bf16, each shard is cast
    // to f32 for the update, and the step still lands near f32.
    let opts = fsdp::FsdpOptions {
        reduce_in_compute_dtype: true,
        ..fsdp::FsdpOptions::new(2)
    };
    let s = fsdp::shard_with(&g, &opts, &fsdp::default_unit).unwrap();
    let rs: Vec<_> = s
        .ops()
        .iter()
        .filter(|o| o.op_type == "reduce_scatter")
        .collect();
    assert!(!rs.is_empty());
    for o in rs {
        assert_eq!(s.tensor(o.outputs[0]).dtype.as_deref(), Some("bf16"));
    }
    let (bf16_reduced, _) = planned_matches_unplanned(&s, 2);
    let f32_reduced = run(
        &fsdp::shard(&g, 2).unwrap(),
        &plan(&fsdp::shard(&g, 2).unwrap()),
        2,
    );
    assert!(state_distance(&bf16_reduced, &f32_reduced) < 0.01);
    // Sharded, the mixed step trains as the f32 one does (a check that the
    // planned and unplanned runs alone cannot make: both share any bug).
    let f32_sharded = fsdp::shard(&f32_graph, 2).unwrap();
    let f32_run = run(&f32_sharded, &plan(&f32_sharded), 2);
    for rep in [&bf16_reduced, &f32_reduced] {
        assert!(
            rep.steps[1].loss < rep.steps[0].loss - 0.01,
            "{:?}",
            rep.steps
        );
        for (x, y) in rep.steps.iter().zip(&f32_run.steps) {
            assert!(
                (x.loss - y.loss).abs() <= 1e-3 * y.loss,
                "{} vs {}",
                x.loss,
                y.loss
            );
        }
    }
    // GPT-2 with a tied head, clipping and checkpointing too.
    let mut gcfg = tiny();
    gcfg.mixed_precision = true;
    gcfg.dtype = memplan::models::DType::BF16;
    gcfg.checkpoint = true;
    gcfg.clip_grad_norm = Some(0.5);
    planned_matches_unplanned(&gpt2::build(&gcfg).unwrap(), 2);
}

/// A per-parameter layout whose chunks do not cover a parameter is refused
/// by name when the program is built, not copied short.
#[test]
fn a_copy_out_that_misses_elements_is_refused() {
    let s = fsdp::shard(&gpt2::build(&tiny()).unwrap(), 2).unwrap();
    let o = s
        .op_ids()
        .find(|&o| s.op(o).op_type == "copy_out")
        .expect("a copy-out");
    let mut b = s.to_builder();
    let spec = b.op_spec_mut(o);
    let n = spec.attrs["chunks"].as_array().unwrap().len();
    spec.attrs
        .insert("chunks".into(), serde_json::json!(vec![1; n]));
    let bad = b.build().unwrap();
    let e = memplan::exec::program(&bad, &plan(&bad))
        .unwrap_err()
        .to_string();
    assert!(e.contains("copy_out") && e.contains("do not cover"), "{e}");
}

/// A step offloaded to host memory runs on the CPU executor (its host pool
/// after the arena, the copies moving bytes as they are) and equals the
/// plan without offload bit for bit: losses, parameters and optimizer
/// state, over steps; what moved is the state and activations the
/// offload chose.
#[test]
fn offloaded_steps_equal_the_plan_bit_for_bit() {
    use memplan::offload::{self, Device, Options as OffloadOptions, Target};
    let llama = llama::build(&tiny_llama()).unwrap();
    for g in [gpt2::build(&tiny()).unwrap(), llama] {
        let base = plan(&g);
        let bound = offload::bound::at_any_time(&g).bytes;
        let budget = bound + (base.arena_bytes - bound) / 2;
        let opts = OffloadOptions {
            device: Device::preset("cpu-dev").unwrap(),
            host_memory: None,
            target: Target::Budget(budget),
            deadline: None,
            compute_seconds: None,
            reference_seconds: None,
        };
        let r = offload::offload(&g, &base, &opts).unwrap();
        assert!(
            r.plan.arena_bytes <= budget && r.offloaded_tensors > 0,
            "{}",
            g.name
        );
        let a = run(&g, &base, 3);
        let b = run(&r.graph, &r.plan, 3);
        for (x, y) in a.steps.iter().zip(&b.steps) {
            assert!(x.loss.is_finite());
            assert_eq!(x.loss.to_bits(), y.loss.to_bits(), "{}: loss", g.name);
        }
        assert_eq!(
            a.state, b.state,
            "{}: parameters and optimizer state",
            g.name
        );
    }
}
