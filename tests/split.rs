//! Splitting the loss chain ([`memplan::split`]): the split steps of the
//! built-in GPT-2 and Llama run on the CPU executor and equal the unsplit
//! ones, every split plan passes the checker, `auto` keeps a split only
//! when it lowers the planned arena, and chains that are not separable are
//! never split.
//!
//! Tolerances (f32 steps, 2–3 steps of Adam/AdamW): losses within 1e-5
//! relative; the final state (every parameter, moment and the loss) within
//! 1e-5 relative L2 distance of the unsplit step's (the split only
//! regroups two sums; element by element, Adam turns a gradient near zero
//! into a step of either sign, so single near-zero elements may differ by
//! far more than the whole).
//! bf16 mixed precision: the head's bf16 gradient is rounded once per
//! chunk instead of once, so the state is compared by relative L2 distance,
//! within 1e-2 (measured 1.7e-4 at k = 3; the f32 steps: 6e-9 to 3e-7).

mod common;

use std::time::Duration;

use common::{opts, plan, run_seeded, state_distance};
use memplan::checker;
use memplan::exec;
use memplan::graph::{Graph, GraphBuilder, OpKind, OpSpec, Role, TensorSpec};
use memplan::models::gpt2::{self, Gpt2Config};
use memplan::models::llama::{self, LlamaConfig};
use memplan::split::{self, Split};
use memplan_runtime::runner::{RunConfig, RunReport, run_cpu};

/// Runs `steps` steps of `g`'s plan on the CPU executor, in one arena of
/// exactly the planned size (the runner's default batches).
fn run(g: &Graph, steps: usize) -> RunReport {
    run_seeded(g, steps, RunConfig::default().data_seed)
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

fn split(g: &Graph, k: u64) -> Graph {
    let chains = split::find_chains(g);
    assert_eq!(chains.len(), 1, "one loss chain in {}", g.name);
    split::split_chains(g, &chains, k).unwrap()
}

/// The split step equals the unsplit one (f32).
fn split_matches(g: &Graph, k: u64, steps: usize) {
    let s = split(g, k);
    assert!(
        split::find_chains(&s).is_empty(),
        "split chains are not split again"
    );
    let a = run(&s, steps);
    let b = run(g, steps);
    for (i, (x, y)) in a.steps.iter().zip(&b.steps).enumerate() {
        assert!(x.loss.is_finite());
        close(
            &format!("loss at step {i}"),
            &[x.loss],
            &[y.loss],
            1e-5,
            0.0,
        );
    }
    assert_eq!(a.state[0].len(), b.state[0].len());
    let dist = state_distance(&a, &b);
    eprintln!("{} split into {k}: state distance {dist:.2e}", g.name);
    assert!(dist < 1e-5, "state distance {dist}");
}

fn tiny_gpt2() -> Gpt2Config {
    Gpt2Config::small_config(2, 32, 2, 16, 2, 64)
}

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
fn split_gpt2_equals_unsplit_on_the_cpu() {
    let g = gpt2::build(&tiny_gpt2()).unwrap();
    split_matches(&g, 2, 3);
    split_matches(&g, 5, 2);
}

#[test]
fn split_llama_equals_unsplit_untied_tied_and_checkpointed() {
    let g = llama::build(&tiny_llama()).unwrap();
    // 140 rows in chunks of 47, 47 and 46.
    split_matches(&g, 3, 3);
    let mut cfg = tiny_llama();
    cfg.tied = true;
    cfg.checkpoint = true;
    cfg.clip_grad_norm = Some(0.5);
    split_matches(&llama::build(&cfg).unwrap(), 4, 2);
}

#[test]
fn split_sharded_llama_equals_sharded_unsplit() {
    // Sharded over two ranks, then split (`--world-size 2 --split
    // K`): the head gradient's chunks are summed before its reduce-scatter,
    // so every rank's losses and state equal the unsplit sharded step's.
    let shard = |g: Graph| {
        let mut t = memplan::transforms::Transforms::default();
        t.fsdp.world = 2;
        t.apply(g).unwrap()
    };
    split_matches(&shard(llama::build(&tiny_llama()).unwrap()), 3, 3);
    let mut cfg = tiny_llama();
    cfg.tied = true;
    split_matches(&shard(llama::build(&cfg).unwrap()), 2, 3);
}

#[test]
fn split_mixed_precision_llama_stays_near_unsplit() {
    let mut cfg = tiny_llama();
    cfg.mixed_precision = true;
    cfg.dtype = memplan::models::DType::BF16;
    let g = llama::build(&cfg).unwrap();
    let s = split(&g, 3);
    let (a, b) = (run(&s, 3), run(&g, 3));
    for (x, y) in a.steps.iter().zip(&b.steps) {
        assert!(
            (x.loss - y.loss).abs() <= 1e-3 * y.loss,
            "{} vs {}",
            x.loss,
            y.loss
        );
    }
    let dist = state_distance(&a, &b);
    eprintln!("{} split into 3: state distance {dist:.2e}", g.name);
    assert!(dist < 1e-2, "state distance {dist}");
}

/// A Llama step whose logits dominate: a large vocabulary at a long
/// sequence.
fn vocab_heavy() -> Graph {
    llama::build(&LlamaConfig {
        layers: 1,
        width: 32,
        heads: 4,
        kv_heads: 2,
        ffn: 64,
        vocab: 4096,
        seq: 256,
        batch: 2,
        ..LlamaConfig::preset("llama-tiny").unwrap()
    })
    .unwrap()
}

#[test]
fn auto_splits_where_the_peak_drops_and_every_split_plan_checks() {
    let g = vocab_heavy();
    let (s, p, rep) = split::plan_split(&g, &opts(), Split::Auto).unwrap();
    checker::check(&s, &p).unwrap();
    let base = rep.tried[0].1;
    assert!(rep.chunks > 1, "{:?}", rep.tried);
    assert!(p.arena_bytes < base, "{:?}", rep.tried);
    assert_eq!(rep.tried.iter().map(|t| t.1).min(), Some(p.arena_bytes));
    assert!(rep.added_flops > 0.0);
    // Each k plans and checks.
    for k in [2, 7] {
        let sg = split(&g, k);
        checker::check(&sg, &plan(&sg)).unwrap();
    }
    // Off leaves the graph as it was.
    let (same, _, rep) = split::plan_split(&g, &opts(), Split::Off).unwrap();
    assert_eq!(rep.chunks, 1);
    assert_eq!(same.num_ops(), g.num_ops());
}

#[test]
fn without_a_gain_the_graph_is_left_as_it_was() {
    // A tiny vocabulary: the logits are small and the peak is elsewhere;
    // an MLP no wider than the model has no up projection to split around.
    let g = llama::build(&LlamaConfig {
        vocab: 8,
        ffn: 8,
        ..tiny_llama()
    })
    .unwrap();
    let (s, p, rep) = split::plan_split(&g, &opts(), Split::Auto).unwrap();
    checker::check(&s, &p).unwrap();
    // The peak is elsewhere: every split plans to the same arena
    // (measured: 687,364 bytes, unsplit and at each k tried), and a tie
    // keeps the unsplit graph.
    assert_eq!(rep.chunks, 1, "{:?}", rep.tried);
    assert_eq!(rep.added_flops, 0.0);
    let names = |g: &Graph| g.ops().iter().map(|o| o.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&s), names(&g));
    assert_eq!(p.arena_bytes, rep.tried[0].1);
    assert!(rep.tried.iter().all(|t| t.1 >= p.arena_bytes));
}

/// A minimal loss chain: `logits = y Hᵀ`, cross-entropy and its backward,
/// `dy = dlogits H`, `dH = dlogitsᵀ y`; `extra` adds an op that reads the
/// logits across rows (a softmax over the batch dimension: not separable).
fn chain(extra: bool, swapped: bool) -> Graph {
    chain_sized(8, 4, 16, extra, swapped)
}

/// [`chain`] with `r` rows of width `c` and `v` classes; `y`, `H` and the
/// targets are step inputs, the loss, `dy` and `dH` persistent outputs.
fn chain_sized(r: u64, c: u64, v: u64, extra: bool, swapped: bool) -> Graph {
    chain_cast(r, c, v, extra, swapped, false)
}

/// [`chain_sized`]; with `casts`, bf16 logits upcast to f32 for the loss
/// and the f32 gradient cast back to bf16 for the products (as a PyTorch
/// step under autocast computes the loss).
fn chain_cast(r: u64, c: u64, v: u64, extra: bool, swapped: bool, casts: bool) -> Graph {
    let mut b = GraphBuilder::new("chain");
    let f = |b: &mut GraphBuilder, name: &str, shape: Vec<u64>, role: Role| {
        let n: u64 = shape.iter().product();
        b.add_tensor(
            TensorSpec::new(name, 4 * n)
                .role(role)
                .dtype("f32")
                .shape(shape),
        )
    };
    let y = f(&mut b, "y", vec![r, c], Role::Input);
    let h = f(&mut b, "h", vec![v, c], Role::Input);
    let tgt = b.add_tensor(
        TensorSpec::new("targets", 4 * r)
            .role(Role::Input)
            .dtype("i32")
            .shape(vec![r]),
    );
    let logits = f(&mut b, "logits", vec![r, v], Role::Activation);
    let low = |b: &mut GraphBuilder, name: &str| {
        b.add_tensor(
            TensorSpec::new(name, 2 * r * v)
                .dtype("bf16")
                .shape(vec![r, v]),
        )
    };
    let (logits16, dl16) = if casts {
        (low(&mut b, "logits.bf16"), low(&mut b, "dlogits.bf16"))
    } else {
        (logits, logits)
    };
    // The head writes bf16 logits when `casts`; the loss reads f32 ones.
    let head_out = if casts { logits16 } else { logits };
    let loss = b.add_tensor(
        TensorSpec::new("loss", 4)
            .role(Role::Output)
            .dtype("f32")
            .shape(vec![1])
            .persistent(),
    );
    let dl = f(&mut b, "dlogits", vec![r, v], Role::Activation);
    let dy = f(&mut b, "dy", vec![r, c], Role::Output);
    let dh = f(&mut b, "dh", vec![v, c], Role::Output);
    for t in [dy, dh] {
        b.tensor_spec_mut(t).lifetime = memplan::graph::Lifetime::Persistent;
    }
    let head = OpSpec::new("head", OpKind::Forward, "matmul_nt")
        .inputs(if swapped { [h, y] } else { [y, h] })
        .outputs([head_out])
        .attr("m", r)
        .attr("k", c)
        .attr("n", v);
    b.add_op(head);
    if casts {
        b.add_op(
            OpSpec::new("logits.upcast", OpKind::Forward, "cast")
                .inputs([logits16])
                .outputs([logits])
                .attr("elements", r * v),
        );
    }
    b.add_op(
        OpSpec::new("loss", OpKind::Forward, "cross_entropy")
            .inputs([logits, tgt])
            .outputs([loss])
            .attr("rows", r)
            .attr("classes", v),
    );
    if extra {
        let s = f(&mut b, "col_softmax", vec![r, v], Role::Output);
        b.add_op(
            OpSpec::new("mix", OpKind::Forward, "softmax_over_rows")
                .inputs([logits])
                .outputs([s]),
        );
    }
    b.add_op(
        OpSpec::new("loss.backward", OpKind::Backward, "cross_entropy_backward")
            .inputs([logits, tgt])
            .outputs([dl])
            .reuse(dl, logits)
            .attr("rows", r)
            .attr("classes", v)
            .attr("scale", 1.0 / r as f64),
    );
    let mm_in = if casts {
        b.add_op(
            OpSpec::new("dlogits.downcast", OpKind::Backward, "cast")
                .inputs([dl])
                .outputs([dl16])
                .attr("elements", r * v),
        );
        dl16
    } else {
        dl
    };
    b.add_op(
        OpSpec::new("head.backward_data", OpKind::Backward, "matmul_nn")
            .inputs([mm_in, h])
            .outputs([dy])
            .attr("m", r)
            .attr("k", v)
            .attr("n", c),
    );
    b.add_op(
        OpSpec::new("head.backward_weight", OpKind::Backward, "matmul_tn")
            .inputs([mm_in, y])
            .outputs([dh])
            .attr("m", v)
            .attr("k", r)
            .attr("n", c),
    );
    b.build().unwrap()
}

#[test]
fn a_chain_that_is_not_separable_is_never_split() {
    assert_eq!(split::find_chains(&chain(false, false)).len(), 1);
    // Another op reads the logits across rows.
    assert!(split::find_chains(&chain(true, false)).is_empty());
    // The product's rows are the head's, not the tokens': `H yᵀ`'s shape
    // attributes do not match a row split.
    assert!(split::find_chains(&chain(false, true)).is_empty());
    for g in [chain(true, false), chain(false, true)] {
        let (s, _, rep) = split::plan_split(&g, &opts(), Split::Chunks(2)).unwrap();
        assert_eq!(rep.chunks, 1);
        assert_eq!(s.num_ops(), g.num_ops());
    }
}

#[test]
fn split_parses_auto_off_and_counts() {
    assert_eq!("auto".parse::<Split>(), Ok(Split::Auto));
    assert_eq!("off".parse::<Split>(), Ok(Split::Off));
    assert_eq!("8".parse::<Split>(), Ok(Split::Chunks(8)));
    assert!("0".parse::<Split>().is_err());
    assert!("many".parse::<Split>().is_err());
    assert_eq!(split::chunk_rows(10, 3), vec![(0, 4), (4, 7), (7, 10)]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 16,
        failure_persistence: None,
        ..Default::default()
    })]

    /// Random chains (rows, width, classes) split into a random number of
    /// chunks: the split graph's plan checks, and on random inputs the
    /// CPU executor gives the same loss, `dy` and `dH` (f32; 1e-5
    /// relative + 1e-6 absolute: two sums regrouped).
    #[test]
    fn random_chains_split_into_random_chunks_equal_the_original(
        r in 2u64..48,
        c in 1u64..9,
        v in 2u64..40,
        kk in 0u64..1000,
        seed in 0u64..1000,
    ) {
        let g = chain_sized(r, c, v, false, false);
        let k = 2 + kk % (r - 1);
        let chains = split::find_chains(&g);
        proptest::prop_assert_eq!(chains.len(), 1);
        let s = split::split_chains(&g, &chains, k).unwrap();
        let cfg = RunConfig {
            steps: 1,
            keep_state: true,
            data_seed: seed,
            ..RunConfig::default()
        };
        let go = |g: &Graph| run_cpu(&exec::program(g, &plan(g)).unwrap(), &cfg).unwrap();
        let (a, b) = (go(&s), go(&g));
        close("loss", &[a.steps[0].loss], &[b.steps[0].loss], 1e-5, 1e-6);
        proptest::prop_assert_eq!(a.state[0].len(), b.state[0].len());
        for ((na, va), (nb, vb)) in a.state[0].iter().zip(&b.state[0]) {
            proptest::prop_assert_eq!(na, nb);
            close(na, va, vb, 1e-5, 1e-6);
        }
    }

    /// The same chains with a reader that mixes rows, or with the product's
    /// operands swapped, are never split.
    #[test]
    fn random_chains_that_are_not_separable_are_never_split(
        r in 2u64..48,
        c in 1u64..9,
        v in 2u64..40,
        swapped in proptest::bool::ANY,
    ) {
        let g = chain_sized(r, c, v, !swapped, swapped);
        proptest::prop_assert!(split::find_chains(&g).is_empty());
    }
}

/// `memplan plan --split`: `auto` reports each candidate's arena and keeps
/// the smallest; the written split graph and plan pass `memplan check`;
/// `--split K` splits any other command's graph (`--split-chunks K`, its
/// deprecated old name, too, with a warning), refuses `auto` where the
/// command does not plan, and refuses a graph without a loss chain.
#[test]
fn cli_plan_split_auto_writes_a_graph_and_plan_that_check() {
    use std::process::Command;
    let dir = std::env::temp_dir().join(format!("memplan-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (plan_path, graph_path) = (dir.join("plan.json"), dir.join("graph.json"));
    let bin = env!("CARGO_BIN_EXE_memplan");
    let args = [
        "plan",
        "--example",
        "gpt2-tiny",
        "--seq",
        "256",
        "--split",
        "auto",
        "--json",
        "--time-limit",
        "3",
    ];
    let out = Command::new(bin)
        .args(args)
        .arg("-o")
        .arg(&plan_path)
        .arg("--graph-output")
        .arg(&graph_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let s = &v["split"];
    assert!(s["chunks"].as_u64().unwrap() > 1, "{s}");
    let tried: Vec<u64> = s["tried"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["arena_bytes"].as_u64().unwrap())
        .collect();
    assert!(tried.len() >= 3 && tried.len() <= 1 + split::AUTO_CHUNKS.len());
    assert_eq!(v["arena_bytes"].as_u64(), tried.iter().min().copied());
    assert!(v["peak_bytes"].as_u64().unwrap() < tried[0]);
    let check = Command::new(bin)
        .arg("check")
        .arg(&graph_path)
        .arg(&plan_path)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    // --split on another command; refused without a chain.
    let stats_of = |flag: &str, value: &str| {
        Command::new(bin)
            .args([
                "stats",
                "--example",
                "gpt2-tiny",
                "--seq",
                "256",
                flag,
                value,
                "--json",
            ])
            .output()
            .unwrap()
    };
    let stats = stats_of("--split", "4");
    assert!(
        stats.status.success(),
        "{}",
        String::from_utf8_lossy(&stats.stderr)
    );
    let ops = |out: &std::process::Output| {
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["ops"].clone()
    };
    let old = stats_of("--split-chunks", "4");
    assert!(old.status.success());
    assert_eq!(ops(&old), ops(&stats), "the old name splits the same");
    assert!(String::from_utf8_lossy(&old.stderr).contains("--split-chunks is deprecated"));
    assert!(!String::from_utf8_lossy(&stats.stderr).contains("deprecated"));
    let auto = stats_of("--split", "auto");
    assert!(!auto.status.success());
    assert!(
        String::from_utf8_lossy(&auto.stderr)
            .contains("--split auto picks the chunk count while planning"),
        "{}",
        String::from_utf8_lossy(&auto.stderr)
    );
    let mlp = Command::new(bin)
        .args(["stats", "--example", "mlp", "--split", "4"])
        .output()
        .unwrap();
    assert!(!mlp.status.success());
    assert!(String::from_utf8_lossy(&mlp.stderr).contains("no separable loss chain"));
    std::fs::remove_dir_all(&dir).ok();
}

/// One `--split auto|K|off` on `compare` and `bench` as on `plan`: memplan's
/// plan is the split step's where that lowers its arena, and every
/// baseline runs that same split step (the graph `plan --split
/// --graph-output` writes); the JSON says how many chunks.
#[test]
fn compare_and_bench_take_the_same_split_flag_as_plan() {
    use std::process::Command;
    let bin = env!("CARGO_BIN_EXE_memplan");
    let dir = std::env::temp_dir().join(format!("memplan-split-flag-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(bin).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    // Each baseline's footprint (the ratios beside them are to each
    // plan's own bound).
    let footprints = |v: &serde_json::Value| -> Vec<(String, u64)> {
        let mut f: Vec<(String, u64)> = v["baselines"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, b)| (k.clone(), b["footprint_bytes"].as_u64().unwrap()))
            .collect();
        f.sort();
        f
    };
    let ex = [
        "--example",
        "gpt2-tiny",
        "--seq",
        "256",
        "--json",
        "--time-limit",
        "3",
    ];
    let plain = run(&[&["compare"][..], &ex].concat());
    let split = run(&[&["compare"][..], &ex, &["--split", "4"]].concat());
    assert!(plain.get("split").is_none());
    assert_eq!(split["split"]["chunks"], 4, "{}", split["split"]);
    assert!(split["arena_bytes"].as_u64() < plain["arena_bytes"].as_u64());
    // The baselines are those of the split step as a file.
    let graph = dir.join("split.json");
    let graph_arg = graph.to_str().unwrap();
    run(&[
        &["plan"][..],
        &ex,
        &["--split", "4", "--graph-output", graph_arg],
    ]
    .concat());
    let of_file = run(&["compare", graph_arg, "--json", "--time-limit", "3"]);
    assert_eq!(footprints(&split), footprints(&of_file));
    assert_ne!(footprints(&split), footprints(&plain));
    let bench = |extra: &[&str]| {
        let args = [
            &[
                "bench",
                "example:gpt2-tiny,seq=256",
                "--json",
                "--time-limit",
                "3",
            ][..],
            extra,
        ]
        .concat();
        run(&args)["graphs"][0].clone()
    };
    let (b_plain, b_split) = (bench(&[]), bench(&["--split", "4"]));
    assert_eq!(b_plain["split_chunks"], 1);
    assert_eq!(b_split["split_chunks"], 4);
    assert!(b_split["arena_bytes"].as_u64() < b_plain["arena_bytes"].as_u64());
    assert_eq!(footprints(&b_split), footprints(&split));
    assert_eq!(footprints(&b_plain), footprints(&plain));
    std::fs::remove_dir_all(&dir).ok();
}

/// `fit` may split: with a budget the unsplit step meets only by
/// recomputing, the split step fits without recomputation at a smaller
/// added time, so the fit splits; with splitting off it recomputes.
#[test]
fn fit_splits_where_that_is_the_cheaper_way_into_the_budget() {
    let g = vocab_heavy();
    let (sg, sp, rep) = split::plan_split(&g, &opts(), Split::Auto).unwrap();
    assert!(rep.chunks > 1);
    let fit_opts = memplan::fit::FitOptions {
        budget: sp.arena_bytes,
        time_limit: Duration::from_secs(4),
        probe_time: Duration::from_millis(300),
        ..Default::default()
    };
    let f = split::fit_split(&g, &fit_opts, Split::Auto).unwrap();
    assert!(f.split.chunks > 1, "{:?}", f.split);
    assert!(f.fitted.plan.arena_bytes <= sp.arena_bytes);
    assert!(f.fitted.recomputed.is_empty(), "{:?}", f.fitted.recomputed);
    assert!(f.fitted.added.flops >= f.split.added_flops);
    checker::check(&f.fitted.graph, &f.fitted.plan).unwrap();
    assert!(f.fitted.graph.num_ops() >= sg.num_ops());
    // Off: the same budget by recomputation, or not at all.
    let f = split::fit_split(&g, &fit_opts, Split::Off);
    if let Ok(f) = f {
        assert_eq!(f.split.chunks, 1);
        assert_eq!(
            f.fitted
                .graph
                .ops()
                .iter()
                .filter(|o| o.op_type == "pack")
                .count(),
            0
        );
    }
}

/// `fit --max-added --split`: the smallest arena within a share of the
/// step's FLOPs, the split's own FLOPs counted in it. On a step whose
/// peak is the logits, the split one is kept, below both the unsplit fit
/// and the split plan's bound of the unsplit step; with a share smaller
/// than the split's additions the step is not split.
#[test]
fn fit_within_a_share_splits_and_counts_the_split_in_it() {
    let g = vocab_heavy();
    let fit_opts = memplan::fit::FitOptions {
        time_limit: Duration::from_secs(4),
        probe_time: Duration::from_millis(300),
        objective: memplan::fit::Objective::Flops,
        ..Default::default()
    };
    let step = memplan::cost::CostModel::default()
        .checked_total(&g)
        .unwrap();
    let plain = memplan::fit::fit_within(&g, 0.05, &fit_opts).unwrap();
    let f = split::fit_within_split(&g, 0.05, &fit_opts, Split::Auto).unwrap();
    assert!(f.split.chunks > 1, "{:?}", f.split);
    assert!(f.split.added_flops > 0.0);
    assert!(f.fitted.added.flops >= f.split.added_flops);
    assert!(f.fitted.added.flops <= 0.05 * step.flops * (1.0 + 1e-9));
    assert!(f.fitted.plan.arena_bytes < plain.plan.arena_bytes);
    assert_eq!(f.fitted.max_added, Some(0.05));
    checker::check(&f.fitted.graph, &f.fitted.plan).unwrap();
    // A share below what the split adds: the unsplit fit, as fit_within.
    let tiny = 0.5 * f.split.added_flops / step.flops;
    let f = split::fit_within_split(&g, tiny, &fit_opts, Split::Auto).unwrap();
    assert_eq!(f.split.chunks, 1);
    assert!(f.fitted.added.flops <= tiny * step.flops * (1.0 + 1e-9));
    checker::check(&f.fitted.graph, &f.fitted.plan).unwrap();
    // Off: fit_within itself.
    let f = split::fit_within_split(&g, 0.05, &fit_opts, Split::Off).unwrap();
    assert_eq!(f.split.chunks, 1);
    checker::check(&f.fitted.graph, &f.fitted.plan).unwrap();
}

/// The bindings' entry point: a graph document in, the planned (split)
/// graph, its plan and the split's figures out; bad `split` text refused.
#[test]
fn plan_split_json_returns_the_split_graph_and_its_plan() {
    let g = vocab_heavy();
    let text = memplan::io::json::write_graph(&g);
    let out = memplan::api::plan_split_json(&text, 2.0, "auto").unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["split"]["chunks"].as_u64().unwrap() > 1);
    let graph = v["graph"].to_string();
    let plan = v["plan"].to_string();
    memplan::api::check_json(&graph, &plan).unwrap();
    let off = memplan::api::plan_split_json(&text, 1.0, "off").unwrap();
    let v: serde_json::Value = serde_json::from_str(&off).unwrap();
    assert_eq!(v["split"]["chunks"], 1);
    assert!(memplan::api::plan_split_json(&text, 1.0, "lots").is_err());
}

/// A chain with an upcast of the logits and a downcast of their gradient
/// (bf16 products, f32 loss) splits with a cast per chunk, plans, checks
/// and equals the original on the CPU executor; the casts are part of the
/// chain, so the f32 logits are chunked too.
#[test]
fn a_chain_with_casts_splits_and_equals_the_original() {
    let g = chain_cast(24, 8, 40, false, false, true);
    let chains = split::find_chains(&g);
    assert_eq!(chains.len(), 1);
    assert!(chains[0].up.is_some() && chains[0].down.is_some());
    let s = split::split_chains(&g, &chains, 5).unwrap();
    assert_eq!(s.ops().iter().filter(|o| o.op_type == "cast").count(), 10);
    let cfg = RunConfig {
        steps: 1,
        keep_state: true,
        ..RunConfig::default()
    };
    let go = |g: &Graph| run_cpu(&exec::program(g, &plan(g)).unwrap(), &cfg).unwrap();
    let (a, b) = (go(&s), go(&g));
    close("loss", &[a.steps[0].loss], &[b.steps[0].loss], 1e-5, 1e-6);
    for ((na, va), (nb, vb)) in a.state[0].iter().zip(&b.state[0]) {
        assert_eq!(na, nb);
        close(na, va, vb, 1e-5, 1e-6);
    }
    // Another reader of the upcast logits (mixing rows): not split.
    assert!(split::find_chains(&chain_cast(24, 8, 40, true, false, true)).is_empty());
}
