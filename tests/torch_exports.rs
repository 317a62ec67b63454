//! The PyTorch training steps in `fixtures/torch/`, exported by
//! `memplan.torch.export` (see `docs/torch-export.md`): each loads, keeps its
//! recorded figures, has the structure of a training step, and plans into a
//! plan the checker accepts and that is never worse than the eager baseline.
//!
//! The figures are exact and deterministic: they change only when a fixture
//! is re-exported or memplan's liveness rules change.

use std::path::PathBuf;

use memplan::graph::{Graph, Lifetime, OpKind, Role};
use memplan::{Options, baselines, checker};

struct Case {
    file: &'static str,
    ops: usize,
    tensors: usize,
    /// Max live bytes of the eager order (`program-order`).
    program_order: u64,
    /// The caching-allocator simulation of the eager order.
    reserved: u64,
    allocated: u64,
}

fn load(file: &str) -> Graph {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "fixtures", "torch", file]
        .iter()
        .collect();
    memplan::io::load_graph(&path).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn meta_u64(g: &Graph, key: &str) -> u64 {
    g.metadata
        .get(key)
        .and_then(|v| v.as_u64())
        .unwrap_or_else(|| panic!("{}: metadata {key:?} missing", g.name))
}

/// Forward, then backward, then optimizer ops; parameters and optimizer
/// state persistent step inputs; every gradient made by the backward pass
/// and last used by the optimizer; the parameters the exporter counted.
fn check_structure(g: &Graph) {
    let kinds: Vec<OpKind> = g.ops().iter().map(|o| o.kind).collect();
    let rank = |k: OpKind| match k {
        OpKind::Forward => 0,
        OpKind::Backward => 1,
        OpKind::Optimizer => 2,
        other => panic!("{}: unexpected op kind {other:?}", g.name),
    };
    assert!(
        kinds.windows(2).all(|w| rank(w[0]) <= rank(w[1])),
        "{}: phases out of order",
        g.name
    );
    let pos: Vec<usize> = {
        let mut p = vec![0; g.num_ops()];
        for (i, &o) in g.program_order().iter().enumerate() {
            p[o.index()] = i;
        }
        p
    };
    assert!(
        g.program_order()
            .iter()
            .enumerate()
            .all(|(i, o)| o.index() == i),
        "{}: the program order differs from the eager order the ops are listed in",
        g.name
    );
    let mut params = 0u64;
    let mut grads = 0usize;
    for t in g.tensor_ids() {
        let x = g.tensor(t);
        if x.is_view() {
            continue;
        }
        match x.role {
            Role::Parameter | Role::OptimizerState => {
                assert_eq!(x.lifetime, Lifetime::Persistent, "{}", x.name);
                assert!(x.producer.is_none(), "{}", x.name);
                if x.name.starts_with("param:") {
                    params += x.size;
                }
            }
            Role::Gradient => {
                grads += 1;
                assert_eq!(x.lifetime, Lifetime::Transient, "{}", x.name);
                let p = x.producer.expect("a gradient is produced");
                assert_eq!(g.op(p).kind, OpKind::Backward, "{}", x.name);
                let last = *g
                    .users_of_root(t)
                    .iter()
                    .max_by_key(|o| pos[o.index()])
                    .expect("a gradient is used");
                assert_eq!(g.op(last).kind, OpKind::Optimizer, "{}", x.name);
            }
            Role::Output => assert_eq!(x.lifetime, Lifetime::Persistent, "{}", x.name),
            _ => {}
        }
    }
    assert!(grads > 0, "{}: no gradients", g.name);
    assert_eq!(params, meta_u64(g, "parameter_bytes"), "{}", g.name);
}

fn run(c: &Case) {
    let g = load(c.file);
    check_structure(&g);
    let po = baselines::program_order_max_live(&g);
    let cs = baselines::pytorch_caching(&g);
    let got = (
        g.num_ops(),
        g.num_tensors(),
        po,
        cs.max_reserved,
        cs.max_allocated,
    );
    let want = (c.ops, c.tensors, c.program_order, c.reserved, c.allocated);
    assert_eq!(
        got, want,
        "{}: (ops, tensors, program-order, reserved, allocated)",
        c.file
    );
    // The exporter computed the same liveness on its own.
    assert_eq!(
        po,
        meta_u64(&g, "program_order_max_live_bytes"),
        "{}",
        c.file
    );
    // The eager baseline plan passes the checker with the same max live.
    let base = baselines::program_order_greedy(&g);
    let report = checker::check(&g, &base).unwrap_or_else(|e| panic!("{}: {e}", c.file));
    assert_eq!(report.max_live_bytes, po, "{}", c.file);

    let plan = memplan::plan(&g, &Options::default()).unwrap();
    checker::check(&g, &plan).unwrap_or_else(|e| panic!("{}: {e}", c.file));
    assert!(plan.arena_bytes <= base.arena_bytes, "{}", c.file);
    assert!(plan.stats.lower_bound_bytes <= plan.stats.max_live_bytes);
    eprintln!(
        "{}: memplan {} (max live {}), program-order {}, pytorch-reserved {}",
        c.file, plan.arena_bytes, plan.stats.max_live_bytes, po, cs.max_reserved
    );
}

#[test]
fn resnet50_b32() {
    run(&Case {
        file: "resnet50_b32.json.gz",
        ops: 1063,
        tensors: 1846,
        program_order: 3_089_837_868,
        reserved: 3_795_845_120,
        allocated: 3_106_923_520,
    });
}

#[test]
fn vit_b_16_b32() {
    run(&Case {
        file: "vit_b_16_b32.json.gz",
        ops: 1965,
        tensors: 2575,
        program_order: 5_123_411_780,
        reserved: 5_351_931_904,
        allocated: 5_141_662_208,
    });
}

#[test]
fn bert_base_b8() {
    run(&Case {
        file: "bert_base_b8.json.gz",
        ops: 2140,
        tensors: 2930,
        program_order: 5_375_122_300,
        reserved: 5_517_606_912,
        allocated: 5_378_533_376,
    });
}

#[test]
fn gpt2_b8() {
    run(&Case {
        file: "gpt2_b8.json.gz",
        ops: 1710,
        tensors: 2356,
        program_order: 15_103_507_652,
        reserved: 15_246_295_040,
        allocated: 15_106_443_776,
    });
}

#[test]
fn gpt2_xl_b1() {
    run(&Case {
        file: "gpt2_xl_b1.json.gz",
        ops: 6639,
        tensors: 9193,
        program_order: 28_294_689_796,
        reserved: 35_095_838_720,
        allocated: 28_973_952_000,
    });
}
