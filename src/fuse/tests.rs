//! The fuser's tests: regions cover runs of compilable ops, the fused
//! graph keeps what the rest of the step uses and drops what it does not,
//! its plan passes the checker and never peaks above the order it fused.

use proptest::prelude::*;

use super::*;
use crate::example_spec::ExampleSpec;
use crate::graph::{GraphBuilder, OpKind, OpSpec, Role, TensorSpec};

fn planned_order(g: &Graph) -> Vec<OpId> {
    crate::pipeline::plan(
        g,
        &crate::pipeline::Options {
            time_limit: std::time::Duration::from_secs(2),
            ..Default::default()
        },
    )
    .unwrap()
    .order
}

/// x -> a -> b -> c, with c the step's output and `w` updated in place
/// after it (an optimizer update: not compiled).
fn chain() -> Graph {
    let mut b = GraphBuilder::new("chain");
    let x = b.add_tensor(TensorSpec::new("x", 100).role(Role::Input));
    let w = b.add_tensor(TensorSpec::new("w", 10).role(Role::Parameter).persistent());
    let a = b.add_tensor(TensorSpec::new("a", 100));
    let bb = b.add_tensor(TensorSpec::new("b", 100));
    let c = b.add_tensor(TensorSpec::new("c", 4).role(Role::Output).persistent());
    b.add_op(
        OpSpec::new("f", OpKind::Forward, "aten::exp")
            .inputs([x])
            .outputs([a]),
    );
    b.add_op(
        OpSpec::new("g", OpKind::Forward, "aten::mul")
            .inputs([a, w])
            .outputs([bb]),
    );
    b.add_op(
        OpSpec::new("h", OpKind::Forward, "aten::sum")
            .inputs([bb])
            .outputs([c]),
    );
    b.add_op(
        OpSpec::new("u", OpKind::Optimizer, "aten::add_")
            .inputs([c])
            .updates([w]),
    );
    b.build().unwrap()
}

#[test]
fn a_chain_is_one_region_and_its_intermediates_are_dropped() {
    let g = chain();
    let order = g.program_order().to_vec();
    let any = Options {
        limit: Some(u64::MAX),
        ..Options::default()
    };
    let f = fuse(&g, &order, &any).unwrap();
    assert_eq!(f.regions.len(), 1);
    let r = &f.regions[0];
    let names = |ts: &[TensorId]| {
        ts.iter()
            .map(|&t| g.tensor(t).name.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(r.ops.len(), 3);
    assert_eq!(names(&r.inputs), ["x", "w"]);
    assert_eq!(names(&r.outputs), ["c"]);
    // a and b are live together at g: 200 bytes of workspace.
    assert_eq!(r.workspace, 200);
    assert_eq!(f.graph.num_ops(), 2);
    assert!(f.graph.tensor_by_name("a").is_none());
    assert!(f.graph.tensor_by_name("fused0.workspace").is_some());
    let fused = f.graph.op(f.order[0]);
    assert_eq!(fused.op_type, FUSED);
    assert_eq!(fused.attrs["ops"], serde_json::json!(["f", "g", "h"]));
    assert_eq!(f.graph.op(f.order[1]).name, "u");
    // x, w, the workspace and c at once, where eager never has more than
    // two of x, a and b live (with w).
    assert_eq!(f.plan.stats.max_live_bytes, 314);
    assert_eq!(f.unfused_max_live, 210);
}

#[test]
fn a_limit_below_a_region_s_live_bytes_cuts_it() {
    let g = chain();
    let order = g.program_order().to_vec();
    // At the order's own peak (210), fusing f and g would hold x, w, b and
    // a's workspace at once (310): nothing is fused.
    assert!(
        fuse(&g, &order, &Options::default())
            .unwrap()
            .regions
            .is_empty()
    );
    let f = fuse(
        &g,
        &order,
        &Options {
            limit: Some(310),
            ..Options::default()
        },
    )
    .unwrap();
    // Adding h would need 314.
    assert_eq!(f.regions.len(), 1);
    assert_eq!(f.regions[0].ops.len(), 2);
    assert!(f.plan.stats.max_live_bytes <= 310);
    let one = Options {
        max_ops: 1,
        ..Options::default()
    };
    assert!(fuse(&g, &order, &one).unwrap().regions.is_empty());
}

#[test]
fn excluded_and_in_place_ops_stay_outside() {
    let g = chain();
    let order = g.program_order().to_vec();
    let mut opts = Options {
        limit: Some(u64::MAX),
        ..Options::default()
    };
    opts.exclude.insert("g".into());
    let f = fuse(&g, &order, &opts).unwrap();
    assert!(f.regions.is_empty(), "{:?}", f.regions);
    assert_eq!(f.graph.num_ops(), g.num_ops());
}

#[test]
fn bad_requests_are_refused() {
    let g = chain();
    let e = fuse(&g, &g.program_order()[..2], &Options::default()).unwrap_err();
    assert!(
        e.to_string().contains("lists 2 ops; the graph has 4"),
        "{e}"
    );
    let zero = Options {
        max_ops: 0,
        ..Options::default()
    };
    assert!(fuse(&g, g.program_order(), &zero).is_err());
}

#[test]
fn a_training_step_fuses_under_its_planned_peak() {
    let g = ExampleSpec::parse("gpt2-tiny,batch=2")
        .unwrap()
        .build()
        .unwrap();
    let order = planned_order(&g);
    let f = fuse(&g, &order, &Options::default()).unwrap();
    assert!(f.regions.len() > 2, "{} regions", f.regions.len());
    assert!(f.plan.stats.max_live_bytes <= f.unfused_max_live);
    // Every op of the step is in one region or in the fused graph, once.
    let mut seen = vec![0; g.num_ops()];
    for r in &f.regions {
        for o in &r.ops {
            seen[o.index()] += 1;
            assert!(g.op(*o).updates.is_empty());
        }
    }
    for o in f.graph.ops().iter().filter(|o| o.op_type != FUSED) {
        seen[g.op_by_name(&o.name).unwrap().index()] += 1;
    }
    assert!(seen.iter().all(|&n| n == 1));
    assert_eq!(
        f.fused_ops + f.graph.num_ops() - f.regions.len(),
        g.num_ops()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn fused_graphs_are_valid_and_never_peak_higher(g in crate::testing::graph(24)) {
        prop_assume!(g.num_ops() > 0);
        let order = g.program_order().to_vec();
        let f = fuse(&g, &order, &Options::default()).unwrap();
        prop_assert!(f.plan.stats.max_live_bytes <= f.unfused_max_live);
        for r in &f.regions {
            prop_assert!(r.ops.len() >= 2);
        }
    }
}

/// A base listed after a view of it, as recomputation leaves a graph: the
/// recomputed view `base` of `y` comes after `v = base.t()`, which a later
/// update reads. The fused graph keeps `v` and its base (crashed once:
/// "bases are kept", on a fitted GPT-2 step with Inductor kernels).
#[test]
fn a_view_listed_before_its_base_is_kept_with_it() {
    let mut b = GraphBuilder::new("late-base");
    let x = b.add_tensor(TensorSpec::new("x", 64).role(Role::Input));
    let w = b.add_tensor(TensorSpec::new("w", 64).role(Role::Parameter).persistent());
    // Ids: x 0, w 1, v 2, y 3, base 4.
    let v = b.add_tensor(TensorSpec::new("v", 0).view_of(TensorId(4)));
    let y = b.add_tensor(TensorSpec::new("y", 64));
    let base = b.add_tensor(TensorSpec::new("base", 0).view_of(y));
    assert_eq!(base, TensorId(4));
    b.add_op(
        OpSpec::new("exp", OpKind::Forward, "aten::exp")
            .inputs([x])
            .outputs([y]),
    );
    b.add_op(
        OpSpec::new("view", OpKind::Forward, "aten::view")
            .inputs([y])
            .outputs([base]),
    );
    b.add_op(
        OpSpec::new("t", OpKind::Forward, "aten::t")
            .inputs([base])
            .outputs([v]),
    );
    b.add_op(
        OpSpec::new("u", OpKind::Optimizer, "aten::add_")
            .inputs([v])
            .updates([w]),
    );
    let g = b.build().unwrap();
    let order = g.program_order().to_vec();
    let any = Options {
        limit: Some(u64::MAX),
        ..Options::default()
    };
    let f = fuse(&g, &order, &any).unwrap();
    assert_eq!(f.regions.len(), 1);
    let fv = f.graph.tensor_by_name("v").expect("v is handed on");
    let fb = f.graph.tensor_by_name("base").expect("its base is kept");
    let fy = f.graph.tensor_by_name("y").expect("and the base's base");
    assert_eq!(f.graph.tensor(fv).view_of, Some(fb));
    assert_eq!(f.graph.tensor(fb).view_of, Some(fy));
    crate::checker::check(&f.graph, &f.plan).unwrap();
}
