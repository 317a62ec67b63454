//! `memplan plot`: a picture of a plan's memory (SVG).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;

use memplan::plot::{PlotOptions, human};

use super::GraphArgs;
use super::load::{load, load_or_make_plan};

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
