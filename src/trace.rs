//! A plan's memory timeline as a Chrome / Perfetto trace (`memplan trace`).
//!
//! The output is the Trace Event Format's JSON object form
//! (`{"traceEvents": [...]}`), which `ui.perfetto.dev` and
//! `chrome://tracing` open. Time is the step: step `i` spans
//! `[i ms, i + 1 ms)` (`ts` is in microseconds, so `ts = 1000 i`).
//!
//! Three processes:
//! 1. **ops**: one complete event (`"ph": "X"`) per op, in the plan's
//!    order, with its type, kind and the live bytes at its step;
//! 2. **memory**: counter events (`"ph": "C"`): `live bytes` with one series
//!    per role (Perfetto shows a track per role, Chrome stacks them),
//!    `total live bytes`, and the arena size and lower bound as flat lines;
//! 3. **tensors**: one complete event per tensor that owns bytes, spanning
//!    its live steps, with its size, offset and role. Tensors of one role
//!    are packed into as few rows ("threads") as their lifetimes allow, so
//!    events on a row never overlap.
//!
//! An instant event marks the peak step.
//!
//! A step with offload (copies to and from host memory, docs/offload.md)
//! puts its copies on two more rows of **ops**, one per copy stream
//! ("copies to host", "copies to device"), adds a `host live bytes`
//! counter, and lists its host tensors in **tensors** below the device
//! ones, on rows named `host: <role>`.

use serde_json::{Value, json};

use crate::graph::{COPY_TO_DEVICE, COPY_TO_HOST, Graph, Role};
use crate::plan::Plan;
use crate::timeline::{STACK_ORDER, human, role_label};
use crate::timeline::{Timeline, role_index};

/// Microseconds per step.
pub const STEP_US: u64 = 1000;

const PID_OPS: u64 = 1;
const PID_MEMORY: u64 = 2;
const PID_TENSORS: u64 = 3;

fn meta(pid: u64, tid: Option<u64>, what: &str, name: &str) -> Value {
    let mut e = json!({"ph": "M", "pid": pid, "name": what, "args": {"name": name}});
    if let Some(t) = tid {
        e["tid"] = json!(t);
    }
    e
}

fn sort_index(pid: u64, tid: Option<u64>, index: u64) -> Value {
    let (name, mut e) = match tid {
        None => ("process_sort_index", json!({"pid": pid})),
        Some(t) => ("thread_sort_index", json!({"pid": pid, "tid": t})),
    };
    e["ph"] = json!("M");
    e["name"] = json!(name);
    e["args"] = json!({"sort_index": index});
    e
}

/// The trace of `plan` for `g` as a JSON value. `lower_bound` is drawn as a
/// flat counter when it is above zero.
pub fn trace(g: &Graph, plan: &Plan, lower_bound: u64) -> Value {
    let tl = Timeline::of_plan(g, plan);
    let copies = g.ops().iter().any(|o| stream(&o.op_type) > 0);
    let mut ev: Vec<Value> = vec![
        meta(PID_OPS, None, "process_name", "ops (memplan order)"),
        meta(
            PID_OPS,
            Some(0),
            "thread_name",
            if copies { "compute" } else { "ops" },
        ),
        meta(PID_MEMORY, None, "process_name", "memory"),
        meta(PID_TENSORS, None, "process_name", "tensors (by role)"),
    ];
    if copies {
        for (tid, name) in [(1, "copies to host"), (2, "copies to device")] {
            ev.push(meta(PID_OPS, Some(tid), "thread_name", name));
            ev.push(sort_index(PID_OPS, Some(tid), tid));
        }
    }
    for (i, pid) in [PID_OPS, PID_MEMORY, PID_TENSORS].into_iter().enumerate() {
        ev.push(sort_index(pid, None, i as u64));
    }
    op_events(&mut ev, g, plan, &tl);
    counter_events(&mut ev, plan, &tl, lower_bound);
    tensor_events(&mut ev, g, plan, &tl);
    json!({
        "traceEvents": ev,
        "displayTimeUnit": "ms",
        "otherData": {
            "tool": "memplan",
            "version": env!("CARGO_PKG_VERSION"),
            "graph": g.name,
            "time_unit": "1 ms = 1 step of the plan's order",
            "arena_bytes": plan.arena_bytes,
            "max_live_bytes": tl.peak,
            "host_max_live_bytes": tl.host_peak,
            "lower_bound_bytes": lower_bound,
            "order_source": plan.stats.order_source,
            "layout_source": plan.stats.layout_source,
        },
    })
}

/// The row (thread) of an op of this type in **ops**: 0 for compute, 1
/// and 2 for the copy streams to and from host memory.
fn stream(op_type: &str) -> u64 {
    match op_type {
        COPY_TO_HOST => 1,
        COPY_TO_DEVICE => 2,
        _ => 0,
    }
}

/// Ops (process 1): one complete event per op, in the plan's order, on
/// its stream's row.
fn op_events(ev: &mut Vec<Value>, g: &Graph, plan: &Plan, tl: &Timeline) {
    for (i, &o) in plan.order.iter().enumerate() {
        let op = g.op(o);
        ev.push(json!({
            "ph": "X", "pid": PID_OPS, "tid": stream(&op.op_type),
            "ts": i as u64 * STEP_US, "dur": STEP_US,
            "name": op.name, "cat": op.kind.as_str(),
            "args": {
                "step": i,
                "type": op.op_type,
                "live_bytes": tl.total.get(i).copied().unwrap_or(0),
                "live": human(tl.total.get(i).copied().unwrap_or(0)),
            },
        }));
    }
}

/// Counters (process 2), emitted where a value changes (and at both
/// ends), the arena and the bound as flat lines, and the peak.
fn counter_events(ev: &mut Vec<Value>, plan: &Plan, tl: &Timeline, lower_bound: u64) {
    let n = tl.steps as u64;
    let roles: Vec<Role> = STACK_ORDER
        .iter()
        .copied()
        .filter(|r| tl.roles_present().contains(r))
        .collect();
    for i in 0..tl.steps {
        let changed = i == 0
            || roles
                .iter()
                .any(|&r| tl.by_role[role_index(r)][i] != tl.by_role[role_index(r)][i - 1]);
        if !changed {
            continue;
        }
        let ts = i as u64 * STEP_US;
        let by_role: serde_json::Map<String, Value> = roles
            .iter()
            .map(|&r| {
                (
                    role_label(r).to_string(),
                    json!(tl.by_role[role_index(r)][i]),
                )
            })
            .collect();
        ev.push(json!({"ph": "C", "pid": PID_MEMORY, "tid": 0, "ts": ts, "name": "live bytes", "args": by_role}));
        ev.push(json!({"ph": "C", "pid": PID_MEMORY, "tid": 0, "ts": ts, "name": "total live bytes", "args": {"bytes": tl.total[i]}}));
    }
    if tl.host_peak > 0 {
        for i in 0..tl.steps {
            if i == 0 || tl.host[i] != tl.host[i - 1] {
                ev.push(
                    json!({"ph": "C", "pid": PID_MEMORY, "tid": 0, "ts": i as u64 * STEP_US,
                               "name": "host live bytes", "args": {"bytes": tl.host[i]}}),
                );
            }
        }
    }
    let mut flat = vec![("arena bytes", plan.arena_bytes)];
    if lower_bound > 0 {
        flat.push(("lower bound bytes", lower_bound));
    }
    for (name, v) in flat {
        for ts in [0, n * STEP_US] {
            ev.push(json!({"ph": "C", "pid": PID_MEMORY, "tid": 0, "ts": ts, "name": name, "args": {"bytes": v}}));
        }
    }
    if n > 0 {
        ev.push(json!({
            "ph": "i", "s": "g", "pid": PID_MEMORY, "tid": 0,
            "ts": tl.peak_step() as u64 * STEP_US, "name": "peak",
            "args": {"bytes": tl.peak, "live": human(tl.peak), "step": tl.peak_step()},
        }));
    }
}

/// Tensors (process 3): interval partitioning per role (rows freed at
/// death are reused first), so a row's events never overlap.
fn tensor_events(ev: &mut Vec<Value>, g: &Graph, plan: &Plan, tl: &Timeline) {
    let mut next_tid = 0u64;
    let pools = [(false, &tl.intervals), (true, &tl.host_intervals)];
    for (pool, (host, intervals)) in pools.into_iter().enumerate() {
        for (ri, &role) in STACK_ORDER.iter().enumerate() {
            let sort = (pool * STACK_ORDER.len() + ri) as u64;
            next_tid = role_rows(ev, g, plan, (host, intervals), role, sort, next_tid);
        }
    }
}

/// The rows of one role's tensors in one pool (device, or host with
/// `host`), from row `next_tid` on; returns the next free row.
fn role_rows(
    ev: &mut Vec<Value>,
    g: &Graph,
    plan: &Plan,
    (host, intervals): (bool, &[Option<crate::timeline::Interval>]),
    role: Role,
    sort: u64,
    mut next_tid: u64,
) -> u64 {
    let mut ts: Vec<_> = g
        .tensor_ids()
        .filter(|&t| g.tensor(t).role == role)
        .filter_map(|t| intervals[t.index()].map(|iv| (iv, t)))
        .collect();
    ts.sort_by_key(|&(iv, t)| (iv.first, iv.last, t));
    // Rows: the step after which each row is free again.
    let mut rows: Vec<usize> = Vec::new();
    let first_tid = next_tid;
    for (iv, t) in ts {
        let row = match rows.iter().position(|&free| free <= iv.first) {
            Some(r) => r,
            None => {
                rows.push(0);
                rows.len() - 1
            }
        };
        rows[row] = iv.last + 1;
        let x = g.tensor(t);
        ev.push(json!({
            "ph": "X", "pid": PID_TENSORS, "tid": first_tid + row as u64,
            "ts": iv.first as u64 * STEP_US,
            "dur": (iv.last - iv.first + 1) as u64 * STEP_US,
            "name": x.name, "cat": role.as_str(),
            "args": {
                "bytes": x.size,
                "size": human(x.size),
                // Host tensors have no place in the arena.
                "offset": if host { Value::Null } else { json!(plan.offsets[t.index()]) },
                "memory": if host { "host" } else { "device" },
                "role": role.as_str(),
                "first_step": iv.first,
                "last_step": iv.last,
            },
        }));
    }
    for r in 0..rows.len() as u64 {
        let tid = first_tid + r;
        let pool = if host { "host: " } else { "" };
        ev.push(meta(
            PID_TENSORS,
            Some(tid),
            "thread_name",
            &format!("{pool}{} {}", role_label(role), r + 1),
        ));
        ev.push(sort_index(PID_TENSORS, Some(tid), sort * 1_000_000 + r));
    }
    next_tid += rows.len() as u64;
    next_tid
}

/// Checks that `v` is a well-formed Trace Event Format JSON object: a
/// `traceEvents` array whose events carry the fields their phase needs, with
/// numeric timestamps, durations and counter values, and complete events
/// that never overlap on one row unless nested. Returns the first problem.
pub fn validate(v: &Value) -> Result<(), String> {
    let events = v
        .get("traceEvents")
        .and_then(Value::as_array)
        .ok_or("no traceEvents array")?;
    let mut rows: std::collections::BTreeMap<(u64, u64), Vec<(f64, f64)>> = Default::default();
    for (i, e) in events.iter().enumerate() {
        let bad = |why: &str| format!("event {i}: {why}: {e}");
        let ph = e
            .get("ph")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no ph"))?;
        e.get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no name"))?;
        let pid = e
            .get("pid")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("no pid"))?;
        if ph == "M" {
            e.get("args")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("metadata without args"))?;
            continue;
        }
        let ts = e
            .get("ts")
            .and_then(Value::as_f64)
            .ok_or_else(|| bad("no numeric ts"))?;
        if ts < 0.0 {
            return Err(bad("negative ts"));
        }
        match ph {
            "X" => {
                let tid = e
                    .get("tid")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| bad("no tid"))?;
                let dur = e
                    .get("dur")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| bad("no dur"))?;
                if dur < 0.0 {
                    return Err(bad("negative dur"));
                }
                rows.entry((pid, tid)).or_default().push((ts, ts + dur));
            }
            "C" => {
                let args = e
                    .get("args")
                    .and_then(Value::as_object)
                    .ok_or_else(|| bad("counter without args"))?;
                if args.is_empty() || !args.values().all(Value::is_number) {
                    return Err(bad("counter args must be numbers"));
                }
            }
            "i" | "I" => {
                if let Some(s) = e.get("s").and_then(Value::as_str)
                    && !matches!(s, "g" | "p" | "t")
                {
                    return Err(bad("instant scope must be g, p or t"));
                }
            }
            other => return Err(bad(&format!("phase {other:?} is not used by memplan"))),
        }
    }
    for ((pid, tid), mut spans) in rows {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut open: Vec<f64> = Vec::new();
        for (s, e) in spans {
            while open.last().is_some_and(|&end| end <= s) {
                open.pop();
            }
            if let Some(&end) = open.last()
                && e > end
            {
                return Err(format!(
                    "pid {pid} tid {tid}: the event [{s}, {e}) overlaps one ending at {end} without nesting"
                ));
            }
            open.push(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_is_valid_and_complete() {
        let g = crate::models::example("gpt2-tiny", &Default::default()).unwrap();
        let plan = crate::plan(&g, &crate::Options::default()).unwrap();
        let v = trace(&g, &plan, plan.stats.lower_bound_bytes);
        validate(&v).unwrap();
        // Round-trips through text.
        let text = serde_json::to_string(&v).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        validate(&back).unwrap();
        let ev = back["traceEvents"].as_array().unwrap();
        let ops = ev
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == PID_OPS)
            .count();
        assert_eq!(ops, g.num_ops());
        let tensors = ev
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == PID_TENSORS)
            .count();
        let owning = g.tensor_ids().filter(|&t| g.occupies_memory(t)).count();
        assert_eq!(tensors, owning);
        // The counters reach the plan's max live at the peak.
        let peak = ev
            .iter()
            .filter(|e| e["name"] == "total live bytes")
            .map(|e| e["args"]["bytes"].as_u64().unwrap())
            .max()
            .unwrap();
        assert_eq!(peak, plan.stats.max_live_bytes);
        let roles = ev.iter().find(|e| e["name"] == "live bytes").unwrap()["args"]
            .as_object()
            .unwrap()
            .clone();
        assert!(roles.contains_key("parameters") && roles.contains_key("activations"));
    }

    #[test]
    fn validator_rejects_broken_traces() {
        for bad in [
            json!({}),
            json!({"traceEvents": [{"ph": "X", "name": "a", "pid": 1, "tid": 0, "ts": 0}]}),
            json!({"traceEvents": [{"ph": "C", "name": "c", "pid": 1, "ts": 0, "args": {"x": "1"}}]}),
            json!({"traceEvents": [
                {"ph": "X", "name": "a", "pid": 1, "tid": 0, "ts": 0, "dur": 10},
                {"ph": "X", "name": "b", "pid": 1, "tid": 0, "ts": 5, "dur": 10}
            ]}),
            json!({"traceEvents": [{"ph": "Q", "name": "a", "pid": 1, "ts": 0}]}),
        ] {
            assert!(validate(&bad).is_err(), "accepted {bad}");
        }
        let nested = json!({"traceEvents": [
            {"ph": "X", "name": "a", "pid": 1, "tid": 0, "ts": 0, "dur": 10},
            {"ph": "X", "name": "b", "pid": 1, "tid": 0, "ts": 2, "dur": 3},
            {"ph": "X", "name": "c", "pid": 1, "tid": 0, "ts": 10, "dur": 3}
        ]});
        validate(&nested).unwrap();
    }
}
