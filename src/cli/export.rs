//! `memplan export`: a graph (or an HLO module's plan) written out.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};

use memplan::{Plan, baselines, checker};

use super::GraphArgs;
use super::format::{grouped, human_bytes};
use super::load::{for_xla, load, solve};

pub(super) fn export(graph: Option<&Path>, src: &GraphArgs, output: &Path) -> Result<()> {
    let g = load(graph, src)?;
    if super::is_stdout(output) {
        super::write_output(output, &memplan::io::json::write_graph(&g))?;
    } else {
        memplan::io::save_graph(&g, output)?;
    }
    eprintln!(
        "wrote {} ({} ops, {} tensors) to {}",
        g.name,
        g.num_ops(),
        g.num_tensors(),
        super::shown(output)
    );
    Ok(())
}

/// `export --hlo`: the module relisted in the plan's order.
pub(super) fn export_hlo(
    module: &Path,
    plan: Option<&Path>,
    output: &Path,
    time_limit: f64,
    no_chain: bool,
    opts: &memplan::io::hlo::ImportOptions,
) -> Result<()> {
    use memplan::io::hlo;
    let text = memplan::io::read_text(module)?;
    if !hlo::looks_like_hlo(&text) {
        bail!(
            "{}: --hlo needs an XLA HLO module (text starting with `HloModule`)",
            module.display()
        );
    }
    let m = hlo::parse_module(&text).map_err(|e| {
        anyhow!(memplan::error::Error::from(e)).context(format!("reading {}", module.display()))
    })?;
    let g = hlo::import::import_module(&m, opts).map_err(|e| e.in_file(module))?;
    let plan = match plan {
        Some(p) => {
            let t = memplan::io::read_text(p)?;
            let plan = Plan::from_json(&t, &g, p)?;
            checker::check(&g, &plan).with_context(|| {
                format!(
                    "{} is not a valid plan of {}",
                    p.display(),
                    module.display()
                )
            })?;
            plan
        }
        None if opts.xla_allocations => for_xla(&g, module, solve(&g, time_limit)?, time_limit)?.0,
        None => solve(&g, time_limit)?,
    };
    let out = hlo::schedule::scheduled_text(&text, &m, &g, &plan.order, !no_chain)
        .with_context(|| format!("relisting {}", module.display()))?;
    if super::is_stdout(output) {
        super::write_output(output, &out)?;
    } else {
        memplan::io::write_text(output, &out)?;
    }
    let xla_order = g
        .extra_orders
        .iter()
        .find(|(n, _)| n == "xla-order")
        .map(|(n, o)| baselines::order_with_layout(&g, o, n).stats.max_live_bytes);
    eprintln!(
        "wrote {} scheduled in memplan's order to {}: max live {} ({} bytes){}",
        m.name,
        super::shown(output),
        human_bytes(plan.stats.max_live_bytes),
        grouped(plan.stats.max_live_bytes),
        match xla_order {
            Some(x) => format!(
                ", XLA's own order {} ({} bytes)",
                human_bytes(x),
                grouped(x)
            ),
            None => String::new(),
        }
    );
    Ok(())
}
