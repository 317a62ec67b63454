//! FSDP2 eager's order rebuilt for a sharded step as `memplan.torch`
//! captures it (`baselines::fsdp_eager`): on a hand-built two-unit step
//! recorded the way capture records one (every forward all-gather before
//! the forward, every reduce-scatter after the backward), the order each
//! prefetch depth gives, op by op, its max live bytes worked out by hand,
//! and the independent checker's verdict on it.

use memplan::baselines::{
    self,
    fsdp_eager::{Device, Held, Prefetch},
};
use memplan::graph::{Graph, GraphBuilder, OpId, OpKind, OpSpec, Role, TensorSpec};

const MIB: u64 = 1 << 20;

/// Two FSDP2 units `a` and `b`, both resharded after forward, trained by
/// SGD on their shards. Tensors (MiB): batch x 1 and shards sa, sb 1 each
/// (persistent); each gathered parameter 4 (forward ga, gb; backward ga2,
/// gb2); activations ya, yb 8 and the gradient dya 8; full gradients da,
/// db 4; reduced chunks ca, cb 1.
fn captured_two_units(with_attrs: bool) -> Graph {
    captured(with_attrs, true, ["a", "b"])
}

/// [`captured_two_units`], with unit `a` resharded after the forward or
/// not (then, as FSDP2's root, gathered once: its backward reads no
/// gathered parameter, as an embedding's does not), and the units the two
/// reductions are tagged with.
fn captured(with_attrs: bool, a_resharded: bool, reduce_units: [&str; 2]) -> Graph {
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
    let ga2 = a_resharded.then(|| t(&mut b, "ga2", 4, Role::Communication));
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
    if a_resharded {
        let ga2 = ga2.expect("made for a resharded unit a");
        gather(&mut b, "ag_a2", sa, ga2, "a", "backward");
        b.add_op(
            OpSpec::new("b_a", OpKind::Backward, "f")
                .inputs([dya, x, ga2])
                .outputs([da]),
        );
    } else {
        b.add_op(
            OpSpec::new("b_a", OpKind::Backward, "f")
                .inputs([dya, x])
                .outputs([da]),
        );
    }
    // Then every reduce-scatter, then the updates.
    reduce(&mut b, "rs_a", ca, da, reduce_units[0]);
    reduce(&mut b, "rs_b", cb, db, reduce_units[1]);
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
    assert_eq!(po.footprint_bytes, 39 * MIB);
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

#[test]
fn a_units_reduction_waits_for_all_of_its_gradients() {
    // Both reductions tagged with unit a: FSDP2's post-backward reduces
    // them together once a's backward (the last gradient) is done.
    let g = captured(true, true, ["a", "a"]);
    let none = Prefetch {
        forward: 0,
        backward: 0,
    };
    let order = baselines::fsdp_eager::eager_order(&g, none).unwrap();
    assert_eq!(
        names(&g, &order)[6..],
        [
            "e_ag_b2", "ag_b2", "b_b", "e_ag_a2", "ag_a2", "b_a", // no reduction between
            "e_rs_a", "rs_a", "e_rs_b", "rs_b", "u_a", "u_b",
        ]
    );
    checked(&g, &order);
}

#[test]
fn fsdp2s_flat_buffers_and_unsharded_parameters_over_the_order() {
    // Unit a gathered once (FSDP2's root): its parameters stay gathered
    // until its post-backward, though the graph's last reader of ga is f_a.
    let g = captured(true, false, ["a", "b"]);
    let none = Prefetch {
        forward: 0,
        backward: 0,
    };
    let order = baselines::fsdp_eager::eager_order(&g, none).unwrap();
    assert_eq!(
        names(&g, &order),
        [
            "e_ag_a", "ag_a", "f_a", "e_ag_b", "ag_b", "f_b", "e_ag_b2", "ag_b2", "b_b", "e_rs_b",
            "rs_b", "b_a", "e_rs_a", "rs_a", "u_a", "u_b",
        ]
    );
    checked(&g, &order);
    let cuda = Device {
        prefetch: none,
        gloo: false,
    };
    let held = baselines::fsdp_eager::flat_buffers(&g, &order, cuda);
    let h = |from, to| Held {
        from,
        to,
        bytes: 4 * MIB,
    };
    assert_eq!(
        held,
        [
            // Each gather's flat buffer beside its parameters at the first
            // use (half-step 2i: op i before its outputs): b2 at b_b, a at
            // f_a, b at f_b.
            h(16, 16),
            h(4, 4),
            h(10, 10),
            // ga from after f_a to just before a's reduction (e_rs_a).
            h(6, 23),
            // Each reduction's flat input: beside the gradient at the
            // copy-in (e_rs_b, e_rs_a), then in the gradient's place once
            // the graph's reduce-scatter has freed it, to the next
            // reduction (b's: from after rs_b to before e_rs_a; a's, the
            // last, is freed with its reduction).
            h(18, 18),
            h(22, 23),
            h(24, 24),
        ]
    );
    // At b_b (step 8): 3 resident + ya 8 + yb 8 + gb2 4 + db 4 + dya 8 =
    // 35 in the graph, ga's 4 on top; just before b_b's outputs 23, with
    // b2's flat buffer and ga 31.
    assert_eq!(baselines::order_max_live(&g, &order), 35 * MIB);
    assert_eq!(
        baselines::order_max_live_holding(&g, &order, &held),
        39 * MIB
    );
    let cs = baselines::eager_caching_holding(&g, &order, false, &held);
    assert_eq!(cs.max_allocated, 39 * MIB);
    // On gloo each collective's temporary too: one per gather and per
    // reduction, at its last collective.
    let gloo = baselines::fsdp_eager::flat_buffers(&g, &order, Device { gloo: true, ..cuda });
    assert_eq!(gloo.len(), held.len() + 5);
    assert!(gloo.contains(&h(15, 15)), "{gloo:?}"); // ag_b2, step 7
}

#[test]
fn spans_past_the_order_are_cut_at_its_end() {
    let g = captured_two_units(true);
    let order = baselines::fsdp_eager::eager_order(&g, Prefetch::CUDA).unwrap();
    let n = order.len();
    // Held from the last op's outputs on, to far past the end: counted
    // as if it ended with the order.
    let held = |to| {
        [Held {
            from: 2 * n - 1,
            to,
            bytes: 100 * MIB,
        }]
    };
    let base = baselines::order_max_live(&g, &order);
    let at_end = baselines::order_max_live_holding(&g, &order, &held(2 * n - 1));
    assert!(at_end > base, "{at_end} {base}");
    let past = held(usize::MAX / 2);
    assert_eq!(baselines::order_max_live_holding(&g, &order, &past), at_end);
    let alloc = |h: &[Held]| baselines::eager_caching_holding(&g, &order, false, h).max_allocated;
    assert_eq!(alloc(&past), alloc(&held(2 * n - 1)));
    assert_eq!(alloc(&[]), base);
    // Starting past the end, or ending before it starts: nothing.
    for h in [
        Held {
            from: 2 * n,
            to: 2 * n + 3,
            bytes: 100 * MIB,
        },
        Held {
            from: 5,
            to: 4,
            bytes: 100 * MIB,
        },
    ] {
        assert_eq!(baselines::order_max_live_holding(&g, &order, &[h]), base);
        assert_eq!(
            baselines::eager_caching_holding(&g, &order, false, &[h]).max_allocated,
            base
        );
    }
}
