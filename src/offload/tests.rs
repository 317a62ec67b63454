//! The offload's own tests: the plans it returns pass the checker, every
//! compute op reads the values it read without offload, the modeled time
//! is the chooser's, and bad requests are refused by name.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::example_spec::ExampleSpec;
use crate::graph::{COPY_TO_DEVICE, COPY_TO_HOST, OpId, TensorId};

fn base_plan(g: &Graph) -> Plan {
    crate::pipeline::plan(
        g,
        &crate::pipeline::Options {
            time_limit: std::time::Duration::from_secs(5),
            ..Default::default()
        },
    )
    .unwrap()
}

fn opts(target: Target) -> Options {
    Options {
        device: Device::preset("h100-pcie5").unwrap(),
        host_memory: None,
        target,
        deadline: None,
        compute_seconds: None,
        reference_seconds: None,
    }
}

/// What each compute op reads, as versions of the original step's
/// values (a write makes a new version named after the op and the
/// output's place; a copy passes its input's version on), keyed by op
/// name; and the version each tensor holds at the end, by name.
type Trace = (HashMap<String, Vec<String>>, HashMap<String, String>);

fn trace(g: &Graph, order: &[OpId]) -> Trace {
    let original = |t: TensorId| {
        let n = &g.tensor(t).name;
        let n = n.strip_prefix("offload.").unwrap_or(n);
        match n.strip_prefix("reload") {
            Some(rest) if rest.contains('.') && rest.as_bytes()[0].is_ascii_digit() => {
                rest.split_once('.').unwrap().1.to_string()
            }
            _ => n.to_string(),
        }
    };
    let mut version: HashMap<TensorId, String> = HashMap::new();
    let v = |t: TensorId, version: &HashMap<TensorId, String>| {
        version
            .get(&g.root(t))
            .cloned()
            .unwrap_or_else(|| format!("{}@start", original(g.root(t))))
    };
    let mut reads = HashMap::new();
    for &o in order {
        let op = g.op(o);
        if op.op_type == COPY_TO_HOST || op.op_type == COPY_TO_DEVICE {
            let x = v(op.inputs[0], &version);
            for &t in op.outputs.iter().chain(&op.updates) {
                version.insert(t, x.clone());
            }
            continue;
        }
        let r: Vec<String> = op
            .inputs
            .iter()
            .chain(&op.updates)
            .map(|&t| format!("{}={}", original(t), v(t, &version)))
            .collect();
        for (i, &t) in op.outputs.iter().chain(&op.updates).enumerate() {
            version.insert(g.root(t), format!("{}#{i}", op.name));
        }
        reads.insert(op.name.clone(), r);
    }
    let last = g
        .tensor_ids()
        .map(|t| (g.tensor(t).name.clone(), v(t, &version)))
        .collect();
    (reads, last)
}

/// The offloaded step computes what the step computed: the same ops,
/// each reading the same versions, and every persistent tensor ends with
/// the version it ended with (offloaded state: in host memory, under its
/// own name).
fn assert_same_values(g: &Graph, base: &Plan, r: &Offloaded) {
    let (before, end_before) = trace(g, &base.order);
    let (after, end_after) = trace(&r.graph, &r.plan.order);
    assert_eq!(before.len(), after.len(), "the compute ops");
    for (name, reads) in &before {
        assert_eq!(
            &after[name], reads,
            "op {name} reads other values with offload"
        );
    }
    for t in g.tensor_ids() {
        let x = g.tensor(t);
        if x.lifetime == Lifetime::Persistent && x.view_of.is_none() {
            assert_eq!(
                end_before[&x.name], end_after[&x.name],
                "persistent {} at the end",
                x.name
            );
        }
    }
}

fn example(text: &str) -> Graph {
    ExampleSpec::parse(text).unwrap().build().unwrap()
}

use crate::graph::Lifetime;

#[test]
fn a_budget_is_met_with_a_checked_plan_that_computes_the_same_values() {
    for text in ["gpt2-tiny", "llama-tiny", "mlp"] {
        let g = example(text);
        let base = base_plan(&g);
        let bound = bound::at_any_time(&g).bytes;
        for frac in [0.9, 0.6, 0.4] {
            let b = bound + ((base.arena_bytes - bound) as f64 * frac) as u64;
            let r = offload(&g, &base, &opts(Target::Budget(b))).unwrap();
            assert!(
                r.plan.arena_bytes <= b,
                "{text} {frac}: {} > {b}",
                r.plan.arena_bytes
            );
            assert!(r.plan.arena_bytes >= r.bound.bytes);
            assert!(r.offloaded_tensors > 0 && r.host_bytes > 0, "{text} {frac}");
            assert_eq!(checker::check(&r.graph, &r.plan).unwrap(), r.check);
            assert!(r.timing.seconds >= r.compute_seconds * (1.0 - 1e-12));
            assert_eq!(
                r.timing.compute_seconds, r.compute_seconds,
                "copies are not compute"
            );
            assert_same_values(&g, &base, &r);
            // The graph with its copies reads back as written.
            let text_graph = crate::io::json::write_graph(&r.graph);
            let back =
                crate::io::json::parse_graph(&text_graph, std::path::Path::new("offloaded.json"))
                    .unwrap();
            assert_eq!(back.tensors(), r.graph.tensors());
        }
    }
}

#[test]
fn a_slowdown_is_kept_and_the_chooser_models_the_rewritten_step() {
    let g = example("gpt2-small,batch=1");
    let base = base_plan(&g);
    for share in [0.0, 0.05, 0.2] {
        let r = offload(&g, &base, &opts(Target::MaxSlowdown(share))).unwrap();
        assert!(r.timing.seconds <= r.seconds_without_offload * (1.0 + share) * (1.0 + 1e-9));
        assert!(r.plan.arena_bytes <= base.arena_bytes);
        if share > 0.0 {
            assert!(
                r.plan.arena_bytes < base.arena_bytes,
                "{share}: nothing offloaded"
            );
        }
        assert!(r.plan.arena_bytes >= r.bound.bytes);
        assert_same_values(&g, &base, &r);
    }
    let dev = Device::preset("h100-pcie5").unwrap();
    let mut ch = Chooser::new(&g, &base.order, &dev);
    let lim = Limits {
        target: base.arena_bytes / 2,
        stall: None,
        host_bytes: None,
    };
    while ch.improve(&lim) {}
    let (rg, order) =
        rewrite::rewrite(&g, &base.order, &ch.cands, &ch.decisions, &ch.plans).unwrap();
    assert_eq!(ch.simulate(), simulate(&rg, &order, &dev).seconds);
}

#[test]
fn what_cannot_fit_is_refused_with_the_bound() {
    let g = example("gpt2-tiny");
    let base = base_plan(&g);
    let bound = bound::at_any_time(&g);
    let e = offload(&g, &base, &opts(Target::Budget(bound.bytes - 1))).unwrap_err();
    assert!(matches!(e, Error::DoesNotFit(_)), "{e}");
    let m = e.to_string();
    assert!(
        m.contains("needs") && m.contains(&g.op(bound_op(&g)).name),
        "{m}"
    );
    // Too little host memory for what the budget needs.
    let mut o = opts(Target::Budget(
        bound.bytes + (base.arena_bytes - bound.bytes) / 4,
    ));
    o.host_memory = Some(1024);
    let e = offload(&g, &base, &o).unwrap_err().to_string();
    assert!(e.contains("host memory"), "{e}");
    let e = offload(&g, &base, &opts(Target::MaxSlowdown(f64::NAN)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("slowdown"), "{e}");
}

fn bound_op(g: &Graph) -> OpId {
    bound::working_set(g).1.unwrap()
}

#[test]
fn the_bound_within_a_time_falls_with_the_time() {
    let g = example("gpt2-small,batch=1");
    let base = base_plan(&g);
    let dev = Device::preset("h100-pcie5").unwrap();
    let floor = base.stats.lower_bound_bytes;
    let t0 = simulate(&g, &base.order, &dev).seconds;
    let tight = bound::within(&g, floor, 0.0, &dev).bytes;
    let loose = bound::within(&g, floor, t0, &dev).bytes;
    let any = bound::at_any_time(&g).bytes;
    assert!(tight >= loose && loose >= any, "{tight} {loose} {any}");
    assert!(tight <= floor);
    // With no time at all, nothing can leave but unused state.
    assert!(tight + g.resident_bytes() >= floor);
}

#[test]
fn compute_ops_never_touch_host_memory() {
    use crate::graph::{GraphBuilder, OpKind, OpSpec, Role, TensorSpec};
    let mut b = GraphBuilder::new("bad");
    let w = b.add_tensor(
        TensorSpec::new("w", 64)
            .role(Role::Parameter)
            .persistent()
            .host(),
    );
    let y = b.add_tensor(TensorSpec::new("y", 64));
    b.add_op(
        OpSpec::new("use", OpKind::Forward, "relu")
            .inputs([w])
            .outputs([y]),
    );
    let e = b.build().unwrap_err().to_string();
    assert!(
        e.contains("\"use\"") && e.contains("\"w\"") && e.contains("copy it to the device"),
        "{e}"
    );
    let mut b = GraphBuilder::new("bad-size");
    let w = b.add_tensor(
        TensorSpec::new("w", 64)
            .role(Role::Parameter)
            .persistent()
            .host(),
    );
    let d = b.add_tensor(TensorSpec::new("d", 32));
    b.add_op(
        OpSpec::new("in", OpKind::Other, COPY_TO_DEVICE)
            .inputs([w])
            .outputs([d]),
    );
    let e = b.build().unwrap_err().to_string();
    assert!(e.contains("differ in size"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_steps_offload_to_checked_plans_with_the_same_values(
        g in crate::testing::graph(24),
        frac in 0.0f64..1.0,
    ) {
        let base = base_plan(&g);
        let bound = bound::at_any_time(&g).bytes;
        prop_assume!(base.arena_bytes > bound);
        let b = bound + ((base.arena_bytes - bound) as f64 * frac) as u64;
        match offload(&g, &base, &opts(Target::Budget(b))) {
            Ok(r) => {
                prop_assert!(r.plan.arena_bytes <= b);
                assert_same_values(&g, &base, &r);
            }
            Err(Error::DoesNotFit(m)) => prop_assert!(m.contains("bound"), "{}", m),
            Err(e) => prop_assert!(false, "{}", e),
        }
    }
}

/// A value updated in place, then idle while other ops need the memory,
/// then read: its copy to the host follows the update, and (over a link
/// too slow to hide anything) its copy back, at the same place, follows
/// the copy out; the reader reads the updated value. A persistent
/// parameter updated at the end ends on the host with its last write.
#[test]
fn updated_values_leave_after_their_last_write_and_come_back_current() {
    use crate::graph::{GraphBuilder, OpKind, OpSpec, Role, TensorSpec};
    let mut b = GraphBuilder::new("update-then-idle");
    let w = b.add_tensor(
        TensorSpec::new("w", 1 << 16)
            .role(Role::Parameter)
            .persistent(),
    );
    let x = b.add_tensor(TensorSpec::new("x", 2 << 20));
    b.add_op(
        OpSpec::new("make", OpKind::Forward, "relu")
            .inputs([w])
            .outputs([x]),
    );
    b.add_op(OpSpec::new("bump", OpKind::Forward, "add").updates([x]));
    let mut prev = x;
    for i in 0..6 {
        let y = b.add_tensor(TensorSpec::new(format!("y{i}"), 4 << 20));
        b.add_op(
            OpSpec::new(format!("work{i}"), OpKind::Forward, "relu")
                .inputs([prev])
                .outputs([y]),
        );
        prev = y;
    }
    let z = b.add_tensor(TensorSpec::new("z", 1 << 20));
    b.add_op(
        OpSpec::new("read", OpKind::Backward, "add")
            .inputs([x, prev])
            .outputs([z]),
    );
    b.add_op(
        OpSpec::new("update", OpKind::Optimizer, "sgd")
            .inputs([z])
            .updates([w]),
    );
    let g = b.build().unwrap();
    let base = base_plan(&g);
    let mut o = opts(Target::Budget(base.arena_bytes - (1 << 20)));
    o.device = o.device.with_link_gbps(0.001).unwrap();
    let r = offload(&g, &base, &o).unwrap();
    assert!(r.plan.arena_bytes < base.arena_bytes);
    assert!(
        r.timing.seconds > r.compute_seconds,
        "a link this slow stalls"
    );
    assert_same_values(&g, &base, &r);
    let names: Vec<&str> = r
        .plan
        .order
        .iter()
        .map(|&op| r.graph.op(op).name.as_str())
        .collect();
    let at = |n: &str| names.iter().position(|&m| m == n);
    let (out, back) = (
        at("offload0.x").expect("x leaves"),
        at("reload1.x").expect("x is back"),
    );
    assert!(
        at("bump").unwrap() < out && out < back && back < at("read").unwrap(),
        "{names:?}"
    );
}

/// `memplan plot` and `trace` of a step with offload: the timeline's host
/// pool is the plan's (the checker's host max live, the offload's host
/// bytes) and stays out of the device curves; the trace puts each copy on
/// its stream's row and the host tensors on rows of their own; the
/// picture draws the host pool.
#[test]
fn pictures_and_traces_show_both_pools_and_the_copy_streams() {
    use crate::timeline::Timeline;
    use serde_json::Value;
    let g = example("gpt2-tiny");
    let base = base_plan(&g);
    let bound = bound::at_any_time(&g).bytes;
    let b = bound + (base.arena_bytes - bound) / 2;
    let r = offload(&g, &base, &opts(Target::Budget(b))).unwrap();
    let tl = Timeline::of_plan(&r.graph, &r.plan);
    assert!(r.host_bytes > 0);
    assert_eq!(tl.host_peak, r.host_bytes);
    assert_eq!(tl.host_peak, r.check.host_max_live_bytes);
    assert_eq!(tl.peak, r.plan.stats.max_live_bytes, "host bytes stay out");
    let host_tensors: Vec<_> = r
        .graph
        .tensor_ids()
        .filter(|&t| r.graph.on_host(t))
        .collect();
    assert!(
        host_tensors
            .iter()
            .all(|t| tl.host_intervals[t.index()].is_some() && tl.intervals[t.index()].is_none())
    );

    let v = crate::trace::trace(&r.graph, &r.plan, r.plan.stats.lower_bound_bytes);
    crate::trace::validate(&v).unwrap();
    let ev = v["traceEvents"].as_array().unwrap();
    let row_of = |ty: &str| -> Vec<u64> {
        ev.iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == 1 && e["args"]["type"] == ty)
            .map(|e| e["tid"].as_u64().unwrap())
            .collect()
    };
    let (to_host, to_device) = (row_of(COPY_TO_HOST), row_of(COPY_TO_DEVICE));
    let count = |ty: &str| r.graph.ops().iter().filter(|o| o.op_type == ty).count();
    assert_eq!(to_host.len(), count(COPY_TO_HOST));
    assert_eq!(to_device.len(), count(COPY_TO_DEVICE));
    assert_eq!(to_host.len() + to_device.len(), r.copies);
    assert!(to_host.iter().all(|&t| t == 1) && to_device.iter().all(|&t| t == 2));
    let names: Vec<&str> = ev
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == 1)
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["compute", "copies to host", "copies to device"]);
    let host_peak = ev
        .iter()
        .filter(|e| e["name"] == "host live bytes")
        .map(|e| e["args"]["bytes"].as_u64().unwrap())
        .max();
    assert_eq!(host_peak, Some(r.host_bytes));
    let host_rows = ev
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == 3 && e["args"]["memory"] == "host")
        .count();
    assert_eq!(host_rows, host_tensors.len());
    assert!(
        ev.iter().any(|e| e["name"] == "thread_name"
            && e["args"]["name"].as_str().unwrap().starts_with("host: "))
    );
    assert_eq!(
        v["otherData"]["host_max_live_bytes"],
        Value::from(r.host_bytes)
    );

    let svg = crate::plot::svg(&r.graph, &r.plan, &Default::default()).unwrap();
    assert!(svg.contains("host pool"));
    assert!(svg.contains(&format!(", host {}", crate::timeline::human(r.host_bytes))));
    // A step without offload draws and traces no host pool.
    let plain = crate::plot::svg(&g, &base, &Default::default()).unwrap();
    assert!(!plain.contains("host pool"));
    let t = crate::trace::trace(&g, &base, 0);
    assert!(
        !t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "host live bytes")
    );
}
