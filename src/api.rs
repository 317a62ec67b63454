//! The pipeline as text in, text out, for the bindings (the C ABI in
//! `capi/`, the Python package in `python/`): graphs and plans cross a
//! language boundary as the JSON documents of docs/graph-format.md and
//! docs/plan-format.md, so no Rust type leaks into another language and
//! every binding gets the same errors (which element of which document is
//! wrong, never a panic).

use std::path::Path;

use serde_json::json;

use crate::batch::{BatchLine, max_batch, recorded_batch};
use crate::error::Error;
use crate::fit::{FitOptions, Fitted, Objective, fit, fit_within};
use crate::graph::Graph;
use crate::plan::Plan;
use crate::{checker, io, pipeline};

/// How a document that did not come from a file is named in errors.
pub const GRAPH_DOC: &str = "<graph>";
pub const PLAN_DOC: &str = "<plan>";

fn graph(text: &str) -> Result<Graph, Error> {
    io::json::parse_graph(text, Path::new(GRAPH_DOC))
}

/// Plans the graph in `graph_json` within `time_limit_s` seconds and
/// returns the plan document (order, every tensor's offset, the arena, and
/// in `stats` the lower bound and the gap to it). The plan has passed the
/// independent checker.
pub fn plan_json(graph_json: &str, time_limit_s: f64) -> Result<String, Error> {
    let time_limit = pipeline::time_limit(time_limit_s, "time limit")?;
    let g = graph(graph_json)?;
    let opts = pipeline::Options {
        time_limit,
        ..pipeline::Options::default()
    };
    let plan = pipeline::plan(&g, &opts)?;
    checker::check(&g, &plan).map_err(|e| Error::Internal(e.to_string()))?;
    Ok(plan.to_json(&g))
}

/// Plans the graph in `graph_json` as [`plan_json`] does, splitting its
/// loss chain as `split` asks (`"auto"`, `"off"` or a number of chunks;
/// [`crate::split::plan_split`]): returns `{"graph", "plan", "split"}`,
/// the graph that was planned (split or not) as a graph document, its
/// checked plan, and `split` with `chunks` (1: not split), `tried`
/// (`[chunks, arena bytes]` of each candidate), `added_flops` and
/// `step_flops`.
pub fn plan_split_json(graph_json: &str, time_limit_s: f64, split: &str) -> Result<String, Error> {
    let time_limit = pipeline::time_limit(time_limit_s, "time limit")?;
    let split: crate::split::Split = split.parse().map_err(Error::InvalidArgument)?;
    let g = graph(graph_json)?;
    let opts = pipeline::Options {
        time_limit,
        ..pipeline::Options::default()
    };
    let (g, plan, rep) = crate::split::plan_split(&g, &opts, split)?;
    checker::check(&g, &plan).map_err(|e| Error::Internal(e.to_string()))?;
    let doc = |text: String| -> Result<serde_json::Value, Error> {
        serde_json::from_str(&text).map_err(|e| Error::Internal(e.to_string()))
    };
    Ok(json!({
        "graph": doc(io::json::write_graph(&g))?,
        "plan": doc(plan.to_json(&g))?,
        "split": split_report(&rep),
    })
    .to_string())
}

fn split_report(rep: &crate::split::SplitReport) -> serde_json::Value {
    json!({
        "chunks": rep.chunks,
        "chains": rep.chains,
        "regions": rep.regions,
        "tried": rep.tried,
        "added_flops": rep.added_flops,
        "step_flops": rep.step_flops,
    })
}

/// What a user gets without memplan on the graph in `graph_json`
/// ([`crate::baselines::all`], the figures of `memplan compare`): returns
/// `{"baselines": [{"name", "footprint_bytes", "description"}, ...],
/// "best_eager": name or null}`, the last the eager configuration that
/// needs the least ([`crate::baselines::best_eager`]). `device` (`cuda`
/// or `cpu`) says how FSDP2 eager issues a captured sharded step's
/// all-gathers and which collectives' buffers count
/// ([`crate::baselines::fsdp_eager::Device`]).
pub fn baselines_json(graph_json: &str, device: &str) -> Result<String, Error> {
    use crate::baselines::fsdp_eager::Device;
    let device = match device {
        "cuda" => Device::CUDA,
        "cpu" => Device::CPU,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "device {device:?}: the baselines model \"cuda\" or \"cpu\""
            )));
        }
    };
    let g = graph(graph_json)?;
    let base = crate::baselines::all_with(&g, device);
    let best = crate::baselines::best_eager(&base).map(|b| b.name.clone());
    Ok(json!({ "baselines": base, "best_eager": best }).to_string())
}

/// Checks the plan document `plan_json` against the graph in `graph_json`
/// with the independent checker; returns its report as JSON
/// (`max_live_bytes`, `used_bytes`, `host_max_live_bytes`, `ops`,
/// `tensors_placed`).
pub fn check_json(graph_json: &str, plan_json: &str) -> Result<String, Error> {
    let g = graph(graph_json)?;
    let plan = Plan::from_json(plan_json, &g, Path::new(PLAN_DOC))?;
    let r = checker::check(&g, &plan)?;
    Ok(json!({
        "max_live_bytes": r.max_live_bytes,
        "used_bytes": r.used_bytes,
        "host_max_live_bytes": r.host_max_live_bytes,
        "ops": r.ops,
        "tensors_placed": r.tensors_placed,
    })
    .to_string())
}

fn objective(name: &str) -> Result<Objective, Error> {
    match name {
        "time" => Ok(Objective::Time),
        "flops" => Ok(Objective::Flops),
        _ => Err(Error::InvalidArgument(format!(
            "unknown objective {name:?} (time or flops)"
        ))),
    }
}

/// Fits the graph in `graph_json` into `budget` bytes by recomputation
/// ([`crate::fit::fit`]): returns [`crate::fit::Fitted::summary_json`]
/// (`recomputed_ops`, `added_flops`, `added_seconds_estimate`,
/// `no_recompute_arena_bytes`, `optimal`, ...) with `graph` the step with
/// its recomputation (a graph document) and `plan` its checked plan.
/// A budget nothing fits is an error that states the bound.
pub fn fit_json(
    graph_json: &str,
    budget: u64,
    time_limit_s: f64,
    minimise: &str,
) -> Result<String, Error> {
    let g = graph(graph_json)?;
    let opts = FitOptions {
        budget,
        ..fit_options(time_limit_s, minimise)?
    };
    fitted_json(&fit(&g, &opts)?)
}

/// The fit's options for a time limit in seconds and an objective's name
/// (`time` or `flops`), each checked.
fn fit_options(time_limit_s: f64, minimise: &str) -> Result<FitOptions, Error> {
    Ok(FitOptions {
        time_limit: pipeline::time_limit(time_limit_s, "time limit")?,
        objective: objective(minimise)?,
        ..FitOptions::default()
    })
}

/// The smallest arena found for the graph in `graph_json` whose
/// recomputation adds at most `max_added` times the step's cost (estimated
/// time, or FLOPs with `minimise` "flops"; [`crate::fit::fit_within`]):
/// the same report as [`fit_json`], with `max_added_share`.
pub fn fit_within_json(
    graph_json: &str,
    max_added: f64,
    time_limit_s: f64,
    minimise: &str,
) -> Result<String, Error> {
    let g = graph(graph_json)?;
    let opts = fit_options(time_limit_s, minimise)?;
    fitted_json(&fit_within(&g, max_added, &opts)?)
}

/// [`fit_within_json`] for a graph that already adds `already_flops` FLOPs
/// to the step it was made from (a split made outside the core, as
/// `memplan.torch` splits a captured step): `max_added` is a share of that
/// step's cost and those FLOPs count against it
/// ([`crate::fit::fit_within_after`]); an error of kind `does_not_fit` when
/// they alone exceed it.
pub fn fit_within_after_json(
    graph_json: &str,
    max_added: f64,
    already_flops: f64,
    time_limit_s: f64,
    minimise: &str,
) -> Result<String, Error> {
    let g = graph(graph_json)?;
    let opts = fit_options(time_limit_s, minimise)?;
    fitted_json(&crate::fit::fit_within_after(
        &g,
        max_added,
        already_flops,
        &opts,
    )?)
}

/// A fit's report with the fitted graph and plan as documents.
/// [`fit_json`] (with `budget`) or [`fit_within_json`] (with `max_added`:
/// exactly one of the two) that may also split the loss chain as `split`
/// asks (`"auto"`, `"off"` or a number of chunks): with a budget where
/// that is the cheaper way into it ([`crate::split::fit_split`]), within a
/// share where that gives the smaller arena, the split's FLOPs counted in
/// the share ([`crate::split::fit_within_split`]). The report is the fit's,
/// its `graph` the split step's when split, its `added_flops` the split's
/// and the recomputation's, with `split` as [`plan_split_json`] gives it
/// (`chunks` 1: not split).
pub fn fit_split_json(
    graph_json: &str,
    budget: Option<u64>,
    max_added: Option<f64>,
    time_limit_s: f64,
    minimise: &str,
    split: &str,
) -> Result<String, Error> {
    let split: crate::split::Split = split.parse().map_err(Error::InvalidArgument)?;
    let g = graph(graph_json)?;
    let mut opts = fit_options(time_limit_s, minimise)?;
    let f = match (budget, max_added) {
        (Some(b), None) => {
            opts.budget = b;
            crate::split::fit_split(&g, &opts, split)?
        }
        (None, Some(share)) => crate::split::fit_within_split(&g, share, &opts, split)?,
        _ => {
            return Err(Error::InvalidArgument(
                "give either a budget (bytes) or max_added (a share of the step's cost)".into(),
            ));
        }
    };
    let mut report: serde_json::Value = serde_json::from_str(&fitted_json(&f.fitted)?)
        .map_err(|e| Error::Internal(e.to_string()))?;
    report["split"] = split_report(&f.split);
    Ok(report.to_string())
}

/// What [`offload_json`] takes (JSON, every field optional but one of
/// `budget` and `max_slowdown`).
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct OffloadRequest {
    /// The most bytes the device arena may take.
    budget: Option<u64>,
    /// Instead: the most added modeled time, a share (`0.05`).
    max_slowdown: Option<f64>,
    /// A preset of [`crate::offload::PRESETS`] (default `h100-pcie5`).
    device: Option<String>,
    /// The link's GB/s each way, replacing the preset's.
    link_gbps: Option<f64>,
    /// The most host bytes offloaded tensors may take at once.
    host_memory: Option<u64>,
    /// Seconds for the whole search (default 60).
    time_limit: Option<f64>,
}

/// Offloads the graph in `graph_json` to host memory, chosen with
/// recomputation ([`crate::offload::fit_offload`]), as `options_json`
/// asks: `{"budget": BYTES}` (the least modeled time within it) or
/// `{"max_slowdown": SHARE}` (the smallest arena within it), with
/// `device`, `link_gbps`, `host_memory`, `time_limit`. Returns the step
/// with its copies (`graph`), its checked `plan`, and the figures under
/// `offload` (docs/offload.md).
pub fn offload_json(graph_json: &str, options_json: &str) -> Result<String, Error> {
    use crate::offload::{self, Device, Target};
    let g = graph(graph_json)?;
    let r: OffloadRequest = serde_json::from_str(options_json)
        .map_err(|e| Error::InvalidArgument(format!("offload options: {e}")))?;
    let target = match (r.budget, r.max_slowdown) {
        (Some(b), None) => Target::Budget(b),
        (None, Some(s)) => Target::MaxSlowdown(s),
        _ => {
            return Err(Error::InvalidArgument(
                "offload options: give either \"budget\" (bytes) or \"max_slowdown\" (a share)"
                    .into(),
            ));
        }
    };
    let mut device = Device::preset(r.device.as_deref().unwrap_or("h100-pcie5"))?;
    if let Some(gbps) = r.link_gbps {
        device = device.with_link_gbps(gbps)?;
    }
    let opts = offload::Options {
        device,
        host_memory: r.host_memory,
        target,
        deadline: None,
        compute_seconds: None,
        reference_seconds: None,
    };
    let limit = pipeline::time_limit(r.time_limit.unwrap_or(60.0), "time limit")?;
    let o = offload::fit_offload(&g, &opts, limit)?;
    let graph: serde_json::Value = serde_json::from_str(&io::json::write_graph(&o.graph))
        .map_err(|e| Error::Internal(e.to_string()))?;
    let plan: serde_json::Value = serde_json::from_str(&o.plan.to_json(&o.graph))
        .map_err(|e| Error::Internal(e.to_string()))?;
    Ok(serde_json::json!({
        "graph": graph,
        "plan": plan,
        "arena_bytes": o.plan.arena_bytes,
        "offload": o.summary_json(),
    })
    .to_string())
}

/// Fusion regions of a planned order ([`crate::fuse::fuse`]), as
/// `options_json` asks: `{"order": [op names], "limit": BYTES,
/// "max_ops": N, "exclude": [op names]}` (only `order` is required).
/// Returns `regions` (each `name`, `ops`, `inputs`, `outputs` by name and
/// `workspace_bytes`), the fused step (`graph`) and its checked `plan`,
/// `max_live_bytes` (the fused plan's), `unfused_max_live_bytes` and
/// `fused_ops`.
pub fn fuse_json(graph_json: &str, options_json: &str) -> Result<String, Error> {
    let g = graph(graph_json)?;
    let r: FuseRequest = serde_json::from_str(options_json)
        .map_err(|e| Error::InvalidArgument(format!("fuse options: {e}")))?;
    let order = r
        .order
        .iter()
        .map(|n| {
            g.op_by_name(n).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "fuse options: order names op {n:?}, which the graph lacks"
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut seen = vec![false; g.num_ops()];
    for (i, &o) in order.iter().enumerate() {
        if std::mem::replace(&mut seen[o.index()], true) {
            return Err(Error::InvalidArgument(format!(
                "fuse options: order lists op {:?} twice (again at {i})",
                g.op(o).name
            )));
        }
        if let Some(d) = g.deps(o).iter().find(|d| !seen[d.index()]) {
            return Err(Error::InvalidArgument(format!(
                "fuse options: order runs op {:?} before op {:?}, which it depends on",
                g.op(o).name,
                g.op(*d).name
            )));
        }
    }
    let defaults = crate::fuse::Options::default();
    let opts = crate::fuse::Options {
        limit: r.limit,
        max_ops: r.max_ops.unwrap_or(defaults.max_ops),
        exclude: r.exclude.into_iter().collect(),
    };
    let f = crate::fuse::fuse(&g, &order, &opts)?;
    let names = |ts: &[crate::graph::TensorId]| -> Vec<String> {
        ts.iter().map(|&t| g.tensor(t).name.clone()).collect()
    };
    let regions: Vec<serde_json::Value> = f
        .regions
        .iter()
        .map(|x| {
            json!({
                "name": x.name,
                "ops": x.ops.iter().map(|&o| g.op(o).name.clone()).collect::<Vec<_>>(),
                "inputs": names(&x.inputs),
                "outputs": names(&x.outputs),
                "workspace_bytes": x.workspace,
            })
        })
        .collect();
    let doc = |text: String| -> Result<serde_json::Value, Error> {
        serde_json::from_str(&text).map_err(|e| Error::Internal(e.to_string()))
    };
    Ok(json!({
        "regions": regions,
        "graph": doc(io::json::write_graph(&f.graph))?,
        "plan": doc(f.plan.to_json(&f.graph))?,
        "max_live_bytes": f.plan.stats.max_live_bytes,
        "unfused_max_live_bytes": f.unfused_max_live,
        "fused_ops": f.fused_ops,
    })
    .to_string())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FuseRequest {
    order: Vec<String>,
    limit: Option<u64>,
    max_ops: Option<usize>,
    #[serde(default)]
    exclude: Vec<String>,
}

fn fitted_json(f: &Fitted) -> Result<String, Error> {
    let graph: serde_json::Value = serde_json::from_str(&io::json::write_graph(&f.graph))
        .map_err(|e| Error::Internal(e.to_string()))?;
    let plan: serde_json::Value = serde_json::from_str(&f.plan.to_json(&f.graph))
        .map_err(|e| Error::Internal(e.to_string()))?;
    let mut report = f.summary_json();
    report["graph"] = graph;
    report["plan"] = plan;
    Ok(report.to_string())
}

/// The line through one step captured twice (`graph1_json` at batch `b1`,
/// `graph2_json` at `b2`; see [`crate::batch`]). A batch size of 0 means
/// the one the graph's metadata records.
fn line(graph1_json: &str, b1: u64, graph2_json: &str, b2: u64) -> Result<BatchLine, Error> {
    let read = |text: &str, b: u64, doc: &str| -> Result<(Graph, u64), Error> {
        let g = io::json::parse_graph(text, Path::new(doc))?;
        let b = match b {
            0 => recorded_batch(&g).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{doc}: its metadata records no \"batch\"; give the batch sizes"
                ))
            })?,
            b => b,
        };
        Ok((g, b))
    };
    let (g1, b1) = read(graph1_json, b1, "<graph at the first batch>")?;
    let (g2, b2) = read(graph2_json, b2, "<graph at the second batch>")?;
    BatchLine::new(g1, b1, g2, b2)
}

/// A built-in example step as a graph document. `spec` is written as for
/// `memplan bench`: `NAME[,batch=N,seq=N,layers=N,dtype=T,clip=X,world=N,
/// prefetch=N,noreshard,flat,reduce=bf16,checkpoint,fused,mixed]`, with or
/// without the `example:` prefix (`llama3-8b,world=8,mixed,checkpoint`:
/// one rank's FSDP2 step).
pub fn example_json(spec: &str) -> Result<String, Error> {
    let g = crate::example_spec::ExampleSpec::parse(spec)?.build()?;
    Ok(io::json::write_graph(&g))
}

/// The step at `batch`, extrapolated from two captures (see
/// [`crate::batch`]), as a graph document.
pub fn graph_at_batch_json(
    graph1_json: &str,
    b1: u64,
    graph2_json: &str,
    b2: u64,
    batch: u64,
) -> Result<String, Error> {
    let g = line(graph1_json, b1, graph2_json, b2)?.at(batch)?;
    Ok(io::json::write_graph(&g))
}

/// The largest batch that fits `budget` bytes, from two captures: PyTorch
/// eager's in its best configuration and on its default allocator
/// (caching-allocator simulations), memplan's without and with
/// recomputation (`{"eager", "eager_configuration", "eager_default",
/// "planned", "fitted", "cap", "budget_bytes"}`, [`crate::batch::MaxBatch`]);
/// each fit probe gets `probe_time_s`.
pub fn max_batch_json(
    graph1_json: &str,
    b1: u64,
    graph2_json: &str,
    b2: u64,
    budget: u64,
    probe_time_s: f64,
) -> Result<String, Error> {
    let line = line(graph1_json, b1, graph2_json, b2)?;
    let opts = FitOptions {
        time_limit: pipeline::time_limit(probe_time_s, "probe time")?,
        ..FitOptions::default()
    };
    let r = max_batch(&mut |b| line.at(b), budget, &opts, 1 << 16)?;
    serde_json::to_string(&r).map_err(|e| Error::Internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{ExampleOptions, example};

    #[test]
    fn plans_checks_and_names_what_is_wrong() {
        let g = example("gpt2-tiny", &ExampleOptions::default()).unwrap();
        let text = io::json::write_graph(&g);
        let plan = plan_json(&text, 2.0).unwrap();
        let report: serde_json::Value =
            serde_json::from_str(&check_json(&text, &plan).unwrap()).unwrap();
        let p: serde_json::Value = serde_json::from_str(&plan).unwrap();
        assert!(report["max_live_bytes"].as_u64().unwrap() <= p["arena_bytes"].as_u64().unwrap());
        let e = plan_json("{", 1.0).unwrap_err().to_string();
        assert!(e.contains(GRAPH_DOC), "{e}");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            let e = plan_json(&text, bad).unwrap_err().to_string();
            assert!(e.contains("time limit"), "{bad}: {e}");
        }
        // A plan whose arena is too small fails the checker, by name.
        let mut bad = p.clone();
        bad["arena_bytes"] = json!(16);
        let e = check_json(&text, &bad.to_string()).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidPlan);
        assert!(e.to_string().starts_with("the plan is invalid: "), "{e}");
    }

    fn doc(batch: u64) -> String {
        let opts = ExampleOptions {
            batch: Some(batch),
            layers: Some(2),
            ..ExampleOptions::default()
        };
        io::json::write_graph(&example("gpt2-tiny", &opts).unwrap())
    }

    #[test]
    fn fits_checks_and_extrapolates_over_the_batch() {
        let text = doc(16);
        let base: serde_json::Value =
            serde_json::from_str(&plan_json(&text, 2.0).unwrap()).unwrap();
        let (floor, _) = crate::fit::fit_floor(&graph(&text).unwrap());
        let budget = (base["arena_bytes"].as_u64().unwrap() + floor) / 2;
        let f: serde_json::Value =
            serde_json::from_str(&fit_json(&text, budget, 4.0, "flops").unwrap()).unwrap();
        assert!(f["arena_bytes"].as_u64().unwrap() <= budget);
        assert!(!f["recomputed_ops"].as_array().unwrap().is_empty());
        let report = check_json(&f["graph"].to_string(), &f["plan"].to_string()).unwrap();
        let report: serde_json::Value = serde_json::from_str(&report).unwrap();
        assert!(report["max_live_bytes"].as_u64().unwrap() <= budget);
        let e = fit_json(&text, 1 << 20, 5.0, "time")
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs at least"), "{e}");
        let e = fit_json(&text, budget, 5.0, "speed")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown objective"), "{e}");
        let w: serde_json::Value =
            serde_json::from_str(&fit_within_json(&text, 0.05, 4.0, "flops").unwrap()).unwrap();
        assert!(w["arena_bytes"].as_u64() < base["arena_bytes"].as_u64());
        assert!(w["added_flops"].as_f64().unwrap() <= 0.05 * w["step_flops"].as_f64().unwrap());
        assert_eq!(w["max_added_share"], 0.05);
        let report = check_json(&w["graph"].to_string(), &w["plan"].to_string()).unwrap();
        assert!(report.contains("max_live_bytes"), "{report}");
        let e = fit_within_json(&text, -1.0, 4.0, "flops")
            .unwrap_err()
            .to_string();
        assert!(e.contains("share of the step's cost"), "{e}");

        let sharded = graph(&example_json("llama-tiny,world=2,mixed").unwrap()).unwrap();
        assert_eq!(sharded.metadata["fsdp_layout"], "per-parameter");
        let e = example_json("llama-tiny,world=2,wide")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown option \"wide\""), "{e}");
        let e = example_json("gpt5").unwrap_err().to_string();
        assert!(e.contains("unknown example"), "{e}");
        let at = graph_at_batch_json(&doc(2), 2, &doc(3), 3, 16).unwrap();
        let (x, y) = (graph(&at).unwrap(), graph(&text).unwrap());
        assert!(x.tensor_ids().all(|t| x.tensor(t).size == y.tensor(t).size));
        let r: serde_json::Value =
            serde_json::from_str(&max_batch_json(&doc(2), 2, &doc(3), 3, 300 << 20, 2.0).unwrap())
                .unwrap();
        assert!(r["eager"].as_u64().unwrap() >= 1, "{r}");
        assert!(r["fitted"].as_u64() >= r["planned"].as_u64(), "{r}");
        let e = max_batch_json(&doc(2), 2, &doc(3), 2, 1 << 30, 2.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("two different"), "{e}");
        // Batch sizes from the graphs' metadata.
        let at0 = graph_at_batch_json(&doc(2), 0, &doc(3), 0, 16).unwrap();
        assert_eq!(at0, at);
        let bare = doc(3).replace("\"batch\"", "\"batch_size\"");
        let e = graph_at_batch_json(&doc(2), 0, &bare, 0, 16)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("second batch") && e.contains("records no"),
            "{e}"
        );
    }
}
