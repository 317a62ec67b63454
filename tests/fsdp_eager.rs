//! FSDP2 eager's order rebuilt for a sharded step as `memplan.torch`
//! captures it (`baselines::fsdp_eager`): on a hand-built two-unit step
//! recorded the way capture records one (every forward all-gather before
//! the forward, every reduce-scatter after the backward), the order each
//! prefetch depth gives, op by op, its max live bytes worked out by hand,
//! and the independent checker's verdict on it.

use memplan::baselines::{self, fsdp_eager::Prefetch};
use memplan::graph::{Graph, GraphBuilder, OpId, OpKind, OpSpec, Role, TensorSpec};

const MIB: u64 = 1 << 20;

/// Two FSDP2 units `a` and `b`, both resharded after forward, trained by
/// SGD on their shards. Tensors (MiB): batch x 1 and shards sa, sb 1 each
/// (persistent); each gathered parameter 4 (forward ga, gb; backward ga2,
/// gb2); activations ya, yb 8 and the gradient dya 8; full gradients da,
/// db 4; reduced chunks ca, cb 1.
fn captured_two_units(with_attrs: bool) -> Graph {
    let mut b = GraphBuilder::new("fsdp2-two-units");
    let t = |b: &mut GraphBuilder, name: &str, mib: u64, role: Role| {
        let mut s = TensorSpec::new(name, mib * MIB).role(role);
        if matches!(role, Role::Input | Role::Parameter) {
            s = s.persistent();
        }
        b.add_tensor(s)
    };
    let x = t(&mut b, "x", 1, Role::Input);
    let sa = t(&mut b, "sa", 1, Role::Parameter);
    let sb = t(&mut b, "sb", 1, Role::Parameter);
    let ga = t(&mut b, "ga", 4, Role::Communication);
    let gb = t(&mut b, "gb", 4, Role::Communication);
    let ya = t(&mut b, "ya", 8, Role::Activation);
    let yb = t(&mut b, "yb", 8, Role::Activation);
    let gb2 = t(&mut b, "gb2", 4, Role::Communication);
    let db = t(&mut b, "db", 4, Role::Gradient);
    let dya = t(&mut b, "dya", 8, Role::Activation);
    let ga2 = t(&mut b, "ga2", 4, Role::Communication);
    let da = t(&mut b, "da", 4, Role::Gradient);
    let ca = t(&mut b, "ca", 1, Role::Gradient);
    let cb = t(&mut b, "cb", 1, Role::Gradient);
    // Capture tags every op of a gather with its unit and pass, every op
    // of a reduction with its unit.
    let tag = |op: OpSpec, unit: &str, pass: Option<&str>| match (with_attrs, pass) {
        (false, _) => op,
        (true, None) => op.attr("fsdp_unit", unit),
        (true, Some(p)) => op.attr("fsdp_unit", unit).attr("fsdp_pass", p),
    };
    let gather = |b: &mut GraphBuilder, name: &str, shard, buf, unit: &str, pass: &str| {
        let empty = OpSpec::new(format!("e_{name}"), OpKind::Forward, "aten.empty").outputs([buf]);
        b.add_op(tag(empty, unit, Some(pass)));
        let op = OpSpec::new(name, OpKind::Collective, "memplan.all_gather")
            .inputs([shard])
            .updates([buf]);
        b.add_op(tag(op, unit, Some(pass)));
    };
    let reduce = |b: &mut GraphBuilder, name: &str, chunk, grad, unit: &str| {
        let empty =
            OpSpec::new(format!("e_{name}"), OpKind::Backward, "aten.empty").outputs([chunk]);
        b.add_op(tag(empty, unit, None));
        let op =
            OpSpec::new(name, OpKind::Collective, "memplan.reduce_scatter").updates([chunk, grad]);
        b.add_op(tag(op, unit, None));
    };
    // As capture records it: the forward's gathers first.
    gather(&mut b, "ag_a", sa, ga, "a", "forward");
    gather(&mut b, "ag_b", sb, gb, "b", "forward");
    b.add_op(
        OpSpec::new("f_a", OpKind::Forward, "f")
            .inputs([x, ga])
            .outputs([ya]),
    );
    b.add_op(
        OpSpec::new("f_b", OpKind::Forward, "f")
            .inputs([ya, gb])
            .outputs([yb]),
    );
    // The backward regathers each unit at its pre-backward.
    gather(&mut b, "ag_b2", sb, gb2, "b", "backward");
    b.add_op(
        OpSpec::new("b_b", OpKind::Backward, "f")
            .inputs([yb, ya, gb2])
            .outputs([db, dya]),
    );
    gather(&mut b, "ag_a2", sa, ga2, "a", "backward");
    b.add_op(
        OpSpec::new("b_a", OpKind::Backward, "f")
            .inputs([dya, x, ga2])
            .outputs([da]),
    );
    // Then every reduce-scatter, then the updates.
    reduce(&mut b, "rs_a", ca, da, "a");
    reduce(&mut b, "rs_b", cb, db, "b");
    b.add_op(
        OpSpec::new("u_a", OpKind::Optimizer, "sgd")
            .inputs([ca])
            .updates([sa]),
    );
    b.add_op(
        OpSpec::new("u_b", OpKind::Optimizer, "sgd")
            .inputs([cb])
            .updates([sb]),
    );
    b.build().unwrap()
}

fn names(g: &Graph, order: &[OpId]) -> Vec<String> {
    order.iter().map(|&o| g.op(o).name.clone()).collect()
}

fn checked(g: &Graph, order: &[OpId]) {
    let plan = baselines::order_with_layout(g, order, "fsdp2-eager");
    memplan::checker::check(g, &plan).unwrap();
}

#[test]
fn without_prefetch_each_unit_is_gathered_at_its_use_and_reduced_after_its_gradient() {
    let g = captured_two_units(true);
    let none = Prefetch {
        forward: 0,
        backward: 0,
    };
    let order = baselines::fsdp_eager::eager_order(&g, none).expect("a captured FSDP2 step");
    assert_eq!(
        names(&g, &order),
        [
            "e_ag_a", "ag_a", "f_a", "e_ag_b", "ag_b", "f_b", // forward
            "e_ag_b2", "ag_b2", "b_b", "e_rs_b", "rs_b", // b's backward, then its reduce
            "e_ag_a2", "ag_a2", "b_a", "e_rs_a", "rs_a", // a's
            "u_a", "u_b", // optimizer.step() after the backward
        ]
    );
    checked(&g, &order);
    // Max live (MiB), 3 resident (x, sa, sb): ga +4 = 7; f_a +8 = 15, ga
    // dies: 11; gb +4 = 15; f_b +8 = 23, gb dies: 19; gb2 +4 = 23; b_b: db
    // +4, dya +8 = 35 (the peak), then ya, yb, gb2 die: 15; cb +1, rs_b
    // frees db: 12; ga2 +4 = 16; b_a +4 = 20; ...
    assert_eq!(baselines::order_max_live(&g, &order), 35 * MIB);
    // As recorded: ga and gb both from the start (11 before f_a, 19 at
    // f_a, 23 at f_b), the same 35 at b_b; db then waits to the end.
    assert_eq!(baselines::program_order_max_live(&g), 35 * MIB);
}

#[test]
fn prefetch_issues_a_unit_ahead_within_its_pass() {
    let g = captured_two_units(true);
    let order = baselines::fsdp_eager::eager_order(&g, Prefetch::CUDA).unwrap();
    assert_eq!(
        names(&g, &order),
        [
            "e_ag_a", "ag_a", "e_ag_b", "ag_b", "f_a", "f_b", // b gathered during a's forward
            "e_ag_b2", "ag_b2", "e_ag_a2", "ag_a2", "b_b", "e_rs_b",
            "rs_b", // a's during b's backward
            "b_a", "e_rs_a", "rs_a", "u_a", "u_b",
        ]
    );
    checked(&g, &order);
    // At b_b: 3 resident + ya 8 + yb 8 + gb2 4 + ga2 4 (prefetched) + db 4
    // + dya 8 = 39.
    assert_eq!(baselines::order_max_live(&g, &order), 39 * MIB);
    let cpu = baselines::fsdp_eager::eager_order(&g, Prefetch::CPU).unwrap();
    assert_eq!(
        names(&g, &cpu)[..6],
        ["e_ag_a", "ag_a", "f_a", "e_ag_b", "ag_b", "f_b"]
    );
    checked(&g, &cpu);
}

#[test]
fn the_baselines_run_the_rebuilt_order_and_say_so() {
    let g = captured_two_units(true);
    let base = baselines::all(&g);
    let po = base.iter().find(|b| b.name == "program-order").unwrap();
    assert!(
        po.description.starts_with("FSDP2 eager order"),
        "{}",
        po.description
    );
    assert_eq!(po.peak_bytes, 39 * MIB);
    // A graph whose collectives name no unit keeps its program order.
    let plain = captured_two_units(false);
    assert!(baselines::fsdp_eager::eager_order(&plain, Prefetch::CUDA).is_none());
    let base = baselines::all(&plain);
    let po = base.iter().find(|b| b.name == "program-order").unwrap();
    assert!(
        po.description.starts_with("program order"),
        "{}",
        po.description
    );
}
