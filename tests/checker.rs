//! The checker rejects broken plans, each for the right reason, and agrees
//! with a naive pairwise oracle on randomly corrupted plans.

use std::time::Duration;

use memplan::checker::{CheckError, check};
use memplan::graph::{
    Graph, GraphBuilder, Lifetime, OpId, OpKind, OpSpec, Role, TensorId, TensorSpec,
};
use memplan::{Options, Plan, PlanStats, testing};
use proptest::prelude::*;

/// w (param, 1024) and x (input, 512) feed f0 -> y (1024); f1: y -> z
/// (1024) and q (0 B); f2 reads z and y and makes v, a view of z; f3
/// reads v and x and makes the persistent out (64). Hints: y <- w (w is
/// persistent: never legal), z <- y (y is read later by f2: not legal in
/// this order), out <- x (legal at f3, x's last use).
struct Case {
    g: Graph,
    t: [TensorId; 7],
    f: [OpId; 4],
}

fn case() -> Case {
    let mut b = GraphBuilder::new("case");
    let w = b.add_tensor(
        TensorSpec::new("w", 1024)
            .role(Role::Parameter)
            .persistent()
            .align(256),
    );
    let x = b.add_tensor(TensorSpec::new("x", 512).role(Role::Input).align(256));
    let y = b.add_tensor(TensorSpec::new("y", 1024).align(256));
    let z = b.add_tensor(TensorSpec::new("z", 1024).align(256));
    let v = b.add_tensor(TensorSpec::new("v", 1024).view_of(z));
    let out = b.add_tensor(
        TensorSpec::new("out", 64)
            .role(Role::Output)
            .persistent()
            .align(64),
    );
    let q = b.add_tensor(TensorSpec::new("q", 0));
    let f0 = b.add_op(
        OpSpec::new("f0", OpKind::Forward, "f")
            .inputs([x, w])
            .outputs([y])
            .reuse(y, w),
    );
    let f1 = b.add_op(
        OpSpec::new("f1", OpKind::Forward, "f")
            .inputs([y])
            .outputs([z, q])
            .reuse(z, y),
    );
    let f2 = b.add_op(
        OpSpec::new("f2", OpKind::Forward, "view")
            .inputs([z, y])
            .outputs([v]),
    );
    let f3 = b.add_op(
        OpSpec::new("f3", OpKind::Forward, "f")
            .inputs([v, x])
            .outputs([out])
            .reuse(out, x),
    );
    Case {
        g: b.build().unwrap(),
        t: [w, x, y, z, v, out, q],
        f: [f0, f1, f2, f3],
    }
}

/// A valid plan: w 0, x 1024, y 1536, z 2560, out in x's bytes at f3.
fn valid(c: &Case) -> Plan {
    let [w, x, y, z, _v, out, _q] = c.t;
    let mut offsets = vec![None; c.g.num_tensors()];
    for (t, o) in [(w, 0), (x, 1024), (y, 1536), (z, 2560), (out, 1024)] {
        offsets[t.index()] = Some(o);
    }
    Plan {
        order: c.f.to_vec(),
        offsets,
        arena_bytes: 3584,
        reuses: vec![(out, x)],
        stats: PlanStats::default(),
    }
}

#[test]
fn accepts_the_valid_plan() {
    let c = case();
    let r = check(&c.g, &valid(&c)).unwrap();
    // Step 2 (f2): w + x + y + z.
    assert_eq!(r.max_live_bytes, 1024 + 512 + 1024 + 1024);
    assert_eq!(r.used_bytes, 3584);
}

fn rejects(c: &Case, p: &Plan) -> CheckError {
    match check(&c.g, p) {
        Ok(r) => panic!("accepted a broken plan: {r}"),
        Err(e) => e,
    }
}

#[test]
fn rejects_overlap() {
    let c = case();
    let mut p = valid(&c);
    // out (live at step 3) onto z (live at steps 1..=3).
    p.offsets[c.t[5].index()] = Some(2560);
    p.reuses.clear();
    let e = rejects(&c, &p);
    assert!(
        matches!(&e, CheckError::Overlap { a, b, step: 3, .. } if [a.as_str(), b.as_str()].contains(&"z") && [a.as_str(), b.as_str()].contains(&"out")),
        "{e}"
    );
    assert!(e.to_string().contains("step 3"), "{e}");
}

#[test]
fn rejects_dependency_violation() {
    let c = case();
    let mut p = valid(&c);
    p.order.swap(0, 1);
    let e = rejects(&c, &p);
    assert!(
        matches!(&e, CheckError::Dependency { op, dep, .. } if op == "f1" && dep == "f0"),
        "{e}"
    );
}

#[test]
fn rejects_duplicate_and_missing_ops() {
    let c = case();
    let mut p = valid(&c);
    p.order[2] = c.f[1];
    let e = rejects(&c, &p);
    assert_eq!(e, CheckError::DuplicateOp("f1".into()));
    let mut p = valid(&c);
    p.order.pop();
    assert_eq!(rejects(&c, &p), CheckError::OrderLength { got: 3, want: 4 });
    let mut p = valid(&c);
    p.order[3] = OpId(9);
    assert_eq!(rejects(&c, &p), CheckError::UnknownOp(9));
}

#[test]
fn rejects_out_of_arena() {
    let c = case();
    let mut p = valid(&c);
    p.arena_bytes = 3583;
    let e = rejects(&c, &p);
    assert!(
        matches!(&e, CheckError::OutsideArena { tensor, arena: 3583, .. } if tensor == "z"),
        "{e}"
    );
}

#[test]
fn rejects_misalignment() {
    let c = case();
    let mut p = valid(&c);
    p.offsets[c.t[2].index()] = Some(1536 + 128);
    p.arena_bytes = 4096;
    let e = rejects(&c, &p);
    assert_eq!(
        e,
        CheckError::Misaligned {
            tensor: "y".into(),
            offset: 1664,
            align: 256
        }
    );
}

#[test]
fn rejects_missing_and_needless_offsets() {
    let c = case();
    let mut p = valid(&c);
    p.offsets[c.t[3].index()] = None;
    assert_eq!(rejects(&c, &p), CheckError::MissingOffset("z".into()));
    let mut p = valid(&c);
    p.offsets[c.t[4].index()] = Some(2560);
    assert_eq!(rejects(&c, &p), CheckError::NeedlessOffset("v".into()));
    let mut p = valid(&c);
    p.offsets[c.t[6].index()] = Some(0);
    assert_eq!(rejects(&c, &p), CheckError::NeedlessOffset("q".into()));
    let mut p = valid(&c);
    p.offsets.pop();
    assert!(matches!(rejects(&c, &p), CheckError::OffsetsLength { .. }));
}

fn bad_reuse_why(e: &CheckError) -> &str {
    match e {
        CheckError::BadReuse { why, .. } => why,
        other => panic!("expected a reuse error, got {other}"),
    }
}

#[test]
fn rejects_reuse_that_is_not_the_last_use() {
    let c = case();
    let [_, _, y, z, ..] = c.t;
    let mut p = valid(&c);
    p.offsets[z.index()] = Some(1536);
    p.reuses.push((z, y));
    let e = rejects(&c, &p);
    assert!(bad_reuse_why(&e).contains("last use is at step 2"), "{e}");
}

#[test]
fn rejects_reuse_of_a_persistent_input() {
    let c = case();
    let [w, _, y, ..] = c.t;
    let mut p = valid(&c);
    p.offsets[y.index()] = Some(0);
    p.reuses.push((y, w));
    let e = rejects(&c, &p);
    assert!(bad_reuse_why(&e).contains("persistent"), "{e}");
}

#[test]
fn rejects_undeclared_reuse() {
    let c = case();
    let [_, x, _, z, _, out, _] = c.t;
    let mut p = valid(&c);
    p.reuses = vec![(out, z)];
    let e = rejects(&c, &p);
    assert!(bad_reuse_why(&e).contains("declares no such"), "{e}");
    // A reuse whose output is not inside the input's bytes.
    let mut p = valid(&c);
    p.offsets[out.index()] = Some(1024 + 512);
    let e = rejects(&c, &p);
    assert!(bad_reuse_why(&e).contains("within"), "{e}");
    // The same input reused twice.
    let mut p = valid(&c);
    p.reuses.push((out, x));
    let e = rejects(&c, &p);
    assert!(bad_reuse_why(&e).contains("two reuses"), "{e}");
}

#[test]
fn persistent_tensors_keep_their_bytes_to_the_end() {
    // p0 makes `keep` (64 B), nobody reads it; p1 runs after and makes
    // `tmp` (64 B). Sharing bytes is fine when `keep` is transient (it
    // dies at step 0), and an overlap when it is persistent.
    for persistent in [false, true] {
        let mut b = GraphBuilder::new("persist");
        let keep = b.add_tensor(TensorSpec::new("keep", 64).role(Role::Output).lifetime(
            if persistent {
                Lifetime::Persistent
            } else {
                Lifetime::Transient
            },
        ));
        let tmp = b.add_tensor(TensorSpec::new("tmp", 64));
        let p0 = b.add_op(OpSpec::new("p0", OpKind::Forward, "f").outputs([keep]));
        let p1 = b.add_op(
            OpSpec::new("p1", OpKind::Forward, "f")
                .outputs([tmp])
                .after([p0]),
        );
        let g = b.build().unwrap();
        let p = Plan {
            order: vec![p0, p1],
            offsets: vec![Some(0), Some(0)],
            arena_bytes: 64,
            reuses: vec![],
            stats: PlanStats::default(),
        };
        match (persistent, check(&g, &p)) {
            (false, Ok(r)) => assert_eq!(r.max_live_bytes, 64),
            (true, Err(CheckError::Overlap { step: 1, .. })) => {}
            (_, other) => panic!("persistent={persistent}: {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------
// Random corruption against a naive oracle.

/// Closed live interval of every tensor that owns bytes, from the graph's
/// ops directly (a third statement of the rules, next to the checker's and
/// the solver's).
fn lifetimes(g: &Graph, order: &[OpId]) -> Vec<Option<(usize, usize)>> {
    let n = order.len();
    let mut step = vec![0; g.num_ops()];
    for (i, &o) in order.iter().enumerate() {
        step[o.index()] = i;
    }
    let mut life = vec![None; g.num_tensors()];
    for t in g.tensor_ids() {
        if !g.occupies_memory(t) {
            continue;
        }
        let x = g.tensor(t);
        let birth = x.producer.map_or(0, |p| step[p.index()]);
        let mut death = None::<usize>;
        for o in g.op_ids() {
            let op = g.op(o);
            let touches = op.inputs.iter().chain(&op.updates).any(|&u| g.root(u) == t)
                || op
                    .outputs
                    .iter()
                    .any(|&u| u != t && g.tensor(u).view_of.is_some() && g.root(u) == t);
            if touches {
                death = Some(death.map_or(step[o.index()], |d: usize| d.max(step[o.index()])));
            }
        }
        let death = if x.lifetime == Lifetime::Persistent {
            n.saturating_sub(1)
        } else {
            death.unwrap_or(birth).max(birth)
        };
        life[t.index()] = Some((birth, death));
    }
    life
}

/// Whether a plan with a valid order and memplan's own (legal) reuses has a
/// valid layout, pair by pair.
fn oracle(g: &Graph, p: &Plan) -> bool {
    let life = lifetimes(g, &p.order);
    let owners: Vec<TensorId> = g.tensor_ids().filter(|&t| g.occupies_memory(t)).collect();
    for &t in &owners {
        let off = p.offsets[t.index()].unwrap();
        if off % g.tensor(t).align != 0 || off + g.tensor(t).size > p.arena_bytes {
            return false;
        }
    }
    for &(o, i) in &p.reuses {
        let (oo, io) = (p.offsets[o.index()].unwrap(), p.offsets[i.index()].unwrap());
        if oo < io || oo + g.tensor(o).size > io + g.tensor(i).size {
            return false;
        }
    }
    for (k, &a) in owners.iter().enumerate() {
        for &b in &owners[k + 1..] {
            if p.reuses.contains(&(a, b)) || p.reuses.contains(&(b, a)) {
                continue;
            }
            let (la, lb) = (life[a.index()].unwrap(), life[b.index()].unwrap());
            let (oa, ob) = (p.offsets[a.index()].unwrap(), p.offsets[b.index()].unwrap());
            let time = la.0 <= lb.1 && lb.0 <= la.1;
            let bytes = oa < ob + g.tensor(b).size && ob < oa + g.tensor(a).size;
            if time && bytes {
                return false;
            }
        }
    }
    true
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Move one tensor to another's offset or anywhere in the arena: the
    /// checker accepts exactly when the oracle does.
    #[test]
    fn checker_agrees_with_the_oracle(
        g in testing::graph(12),
        pick in any::<prop::sample::Index>(),
        target in any::<prop::sample::Index>(),
        anywhere in any::<bool>(),
    ) {
        let opts = Options { time_limit: Duration::from_secs(2), ..Options::default() };
        let plan = memplan::plan(&g, &opts).unwrap();
        prop_assert!(oracle(&g, &plan));
        let owners: Vec<TensorId> = g.tensor_ids().filter(|&t| g.occupies_memory(t)).collect();
        prop_assume!(!owners.is_empty());
        let t = owners[pick.index(owners.len())];
        let mut bad = plan.clone();
        let new = if anywhere {
            let align = g.tensor(t).align;
            (target.index(plan.arena_bytes.max(1) as usize) as u64 / align) * align
        } else {
            plan.offsets[owners[target.index(owners.len())].index()].unwrap()
        };
        bad.offsets[t.index()] = Some(new);
        let verdict = check(&g, &bad);
        prop_assert_eq!(verdict.is_ok(), oracle(&g, &bad), "checker said {:?}", verdict);
    }
}
