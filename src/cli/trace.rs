//! `memplan trace`: a plan's memory timeline as a Chrome / Perfetto trace.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use clap::Args;

use super::GraphArgs;
use super::load::load;
use super::load::load_or_make_plan;

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Graph file (anything memplan reads).
    #[arg(required_unless_present = "example")]
    pub graph: Option<PathBuf>,
    #[command(flatten)]
    pub source: GraphArgs,
    /// Trace this plan (memplan JSON plan) instead of planning the graph.
    #[arg(long, value_name = "PLAN")]
    pub plan: Option<PathBuf>,
    /// Output trace file (JSON; open it in ui.perfetto.dev or chrome://tracing);
    /// `-`: standard output.
    #[arg(short, long, value_name = "TRACE.json")]
    pub output: PathBuf,
    /// Time budget of the solve when planning, in seconds.
    #[arg(
        long,
        value_name = "S",
        allow_negative_numbers = true,
        default_value_t = 10.0
    )]
    pub time_limit: f64,
}

pub fn run(a: TraceArgs) -> Result<()> {
    let g = load(a.graph.as_deref(), &a.source)?;
    let plan = load_or_make_plan(&g, a.plan.as_deref(), a.time_limit)?;
    let trace = memplan::trace::trace(&g, &plan, plan.stats.lower_bound_bytes);
    memplan::trace::validate(&trace)
        .map_err(|e| anyhow!("internal error: the trace is malformed: {e}"))?;
    if super::is_stdout(&a.output) {
        super::write_output(&a.output, &serde_json::to_string(&trace)?)?;
    } else {
        let file = std::fs::File::create(&a.output)
            .with_context(|| format!("creating {}", a.output.display()))?;
        let mut w = std::io::BufWriter::new(file);
        serde_json::to_writer(&mut w, &trace)?;
        w.flush()
            .with_context(|| format!("writing {}", a.output.display()))?;
    }
    let events = trace["traceEvents"].as_array().map_or(0, |e| e.len());
    eprintln!("wrote {} ({events} trace events)", super::shown(&a.output));
    Ok(())
}
