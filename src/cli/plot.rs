//! `memplan plot`: a picture of a plan's memory (SVG).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;

use memplan::graph::Graph;
use memplan::plot::{PlotOptions, human};
use memplan::{Options, Plan, checker};

use super::GraphArgs;
use super::commands::load;

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// Graph file (anything memplan reads).
    #[arg(required_unless_present = "example")]
    pub graph: Option<PathBuf>,
    #[command(flatten)]
    pub source: GraphArgs,
    /// Draw this plan (memplan JSON plan) instead of planning the graph.
    #[arg(long, value_name = "PLAN")]
    pub plan: Option<PathBuf>,
    /// Output SVG file; `-`: standard output.
    #[arg(short, long, value_name = "OUT.svg")]
    pub output: PathBuf,
    /// Picture width in pixels.
    #[arg(long, value_name = "PX", default_value_t = 1200)]
    pub width: u32,
    /// Picture height in pixels.
    #[arg(long, value_name = "PX", default_value_t = 900)]
    pub height: u32,
    /// Title; the graph's name and size by default.
    #[arg(long)]
    pub title: Option<String>,
    /// Time budget of the solve when planning, in seconds.
    #[arg(
        long,
        value_name = "S",
        allow_negative_numbers = true,
        default_value_t = 10.0
    )]
    pub time_limit: f64,
}

pub fn run(a: PlotArgs) -> Result<()> {
    if !(200..=20000).contains(&a.width) || !(200..=20000).contains(&a.height) {
        bail!("--width and --height must be between 200 and 20000 pixels");
    }
    let g = load(a.graph.as_deref(), &a.source)?;
    let plan = load_or_make_plan(&g, a.plan.as_deref(), a.time_limit)?;
    let opts = PlotOptions {
        width: a.width,
        height: a.height,
        title: a.title.clone(),
        lower_bound: None,
    };
    let svg = memplan::plot::svg(&g, &plan, &opts)?;
    super::write_output(&a.output, &svg)?;
    eprintln!(
        "wrote {}: {} arena, lower bound {}",
        super::shown(&a.output),
        human(plan.arena_bytes),
        human(plan.stats.lower_bound_bytes)
    );
    Ok(())
}

/// Reads and checks the plan at `path`, or plans `g` when there is none.
pub fn load_or_make_plan(g: &Graph, path: Option<&Path>, time_limit: f64) -> Result<Plan> {
    if let Some(p) = path {
        let text = memplan::io::read_text(p)?;
        let plan = Plan::from_json(&text, g, p)?;
        checker::check(g, &plan)
            .map_err(|e| anyhow!("{}: the plan is invalid: {e}", p.display()))?;
        return Ok(plan);
    }
    let opts = Options {
        time_limit: super::commands::time_limit(time_limit)?,
        ..Options::default()
    };
    let plan = memplan::plan(g, &opts)?;
    checker::check(g, &plan).context("internal error: memplan produced an invalid plan")?;
    Ok(plan)
}
