//! `memplan run`: plan a training step and execute it for real, on the CPU
//! or a CUDA GPU, inside one arena of the planned size; print per step the
//! loss, the time, and planned vs measured peak memory.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::ValueEnum;
use serde_json::json;

use memplan::exec;
use memplan_runtime::device::AttentionLowering;
use memplan_runtime::runner::{Agreement, RunConfig, RunReport};

use super::GraphArgs;
use super::format::{grouped, human_bytes, table};
use super::load::{load, solve};

/// Where the step runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

/// Options of `memplan run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Graph file (memplan JSON, optionally .gz); its ops must all have
    /// kernels (docs/ops.md).
    #[arg(required_unless_present = "example")]
    pub graph: Option<PathBuf>,
    #[command(flatten)]
    pub source: GraphArgs,
    /// Where to run: cpu, or cuda (needs a build with `--features cuda`).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: Device,
    /// Training steps to run on the same synthetic batch.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub steps: usize,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Time budget for planning, in seconds.
    #[arg(
        long,
        value_name = "S",
        allow_negative_numbers = true,
        default_value_t = 10.0
    )]
    pub time_limit: f64,
    /// Seed of parameter initialization (the batch uses SEED + 1).
    #[arg(long, value_name = "SEED", default_value_t = 0)]
    pub seed: u64,
    /// Run the unplanned reference instead: program order, every tensor in
    /// bytes of its own.
    #[arg(long)]
    pub unplanned: bool,
    /// First CUDA device; rank r uses device FIRST + r.
    #[arg(long, value_name = "FIRST", default_value_t = 0)]
    pub gpu: usize,
    /// With `--device cuda`: also run the same steps on the CPU executor
    /// and report how far the CUDA losses and final parameters and
    /// optimizer state are from the CPU's.
    #[arg(long)]
    pub compare_cpu: bool,
    /// Time every instruction (rank 0) and print the time per step by
    /// kernel, most first (after the first step when there are several).
    /// On CUDA each instruction gets two timing events, so the profiled
    /// run's step times are a little above the plain run's.
    #[arg(long)]
    pub profile: bool,
    /// With `--device cuda`: how fused attention runs: `flash` (the flash
    /// kernels, f32 arithmetic on the CUDA cores), `gemm` (cuBLAS
    /// products over blocks of query rows, the scores of a block in the
    /// workspace) or `tensor-cores` (flash kernels with bf16 tensor-core
    /// products, for bf16 attention with a head dimension that is a
    /// multiple of 16 up to 128, on compute capability 8.0 or later;
    /// `flash` elsewhere) or `auto` (the default: `tensor-cores` on
    /// compute capability 8.0 or later, `flash` before); docs/runtime.md.
    #[arg(long, value_enum, default_value = "auto")]
    pub attention: AttentionArg,
}

/// `--attention`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum AttentionArg {
    Auto,
    Flash,
    Gemm,
    TensorCores,
}

pub fn run(a: RunArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if a.compare_cpu && a.device == Device::Cpu {
        bail!("--compare-cpu compares a CUDA run with the CPU executor: add --device cuda");
    }
    if !matches!(a.attention, AttentionArg::Auto | AttentionArg::Flash) && a.device == Device::Cpu {
        bail!("--attention chooses how the CUDA executor runs fused attention: add --device cuda");
    }
    let g = load(a.graph.as_deref(), &a.source)?;
    let plan = if a.unplanned {
        exec::unplanned_plan(&g)
    } else {
        solve(&g, a.time_limit)?
    };
    let program = exec::program(&g, &plan).context("lowering the plan for the executor")?;
    let cfg = RunConfig {
        steps: a.steps,
        init_seed: a.seed,
        data_seed: a.seed.wrapping_add(1),
        keep_state: a.compare_cpu,
        profile: a.profile,
        attention: match a.attention {
            AttentionArg::Auto => AttentionLowering::Auto,
            AttentionArg::Flash => AttentionLowering::Flash,
            AttentionArg::Gemm => AttentionLowering::GEMM,
            AttentionArg::TensorCores => AttentionLowering::TensorCores,
        },
    };
    let report = match a.device {
        Device::Cpu => memplan_runtime::runner::run_cpu(&program, &cfg)?,
        Device::Cuda => run_cuda(&program, &cfg, a.gpu)?,
    };
    let agreement = if a.compare_cpu && a.device != Device::Cpu {
        let cpu = memplan_runtime::runner::run_cpu(&program, &cfg)
            .context("running the CPU reference for --compare-cpu")?;
        Some(memplan_runtime::runner::agreement(&report, &cpu)?)
    } else {
        None
    };
    print(
        &a,
        &g.name,
        &plan,
        program.world_size,
        &report,
        agreement.as_ref(),
    )
}

#[cfg(feature = "cuda")]
fn run_cuda(p: &memplan_runtime::Program, cfg: &RunConfig, gpu: usize) -> Result<RunReport> {
    Ok(memplan_runtime::cuda::run_cuda(p, cfg, gpu)?)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &memplan_runtime::Program, _: &RunConfig, _: usize) -> Result<RunReport> {
    bail!(
        "this memplan was built without CUDA support; rebuild with `cargo build --release --features cuda` (CUDA is loaded at run time, no toolkit is needed to build)"
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The device's name as the output writes it.
fn device_name(d: Device) -> &'static str {
    match d {
        Device::Cpu => "cpu",
        Device::Cuda => "cuda",
    }
}

fn print(
    a: &RunArgs,
    name: &str,
    plan: &memplan::Plan,
    world: u32,
    r: &RunReport,
    agree: Option<&Agreement>,
) -> Result<()> {
    let device = device_name(a.device);
    // Timing: the first step warms caches (and on CUDA, kernels); the
    // median of the rest is the step time when there are any.
    let times: Vec<f64> = r.steps.iter().map(|s| s.seconds).collect();
    let steady = if times.len() > 1 {
        times[1..].to_vec()
    } else {
        times.clone()
    };
    let med = median(steady);
    if a.json {
        let v = run_json(a, name, plan, world, r, agree, med);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let s = &plan.stats;
    println!(
        "{name} on {device}, world size {world}: arena {} ({} bytes, {}), workspace {}",
        human_bytes(r.arena_bytes),
        grouped(r.arena_bytes),
        if a.unplanned {
            "unplanned: every tensor its own bytes".to_string()
        } else {
            format!("{} + {}", s.order_source, s.layout_source)
        },
        human_bytes(r.workspace_bytes),
    );
    let measured = match a.device {
        Device::Cpu => "allocated",
        Device::Cuda => "measured peak",
    };
    let rows: Vec<Vec<String>> = r
        .steps
        .iter()
        .enumerate()
        .map(|(i, st)| {
            vec![
                (i + 1).to_string(),
                format!("{:.4}", st.loss),
                format!("{:.3} s", st.seconds),
                human_bytes(plan.arena_bytes),
                human_bytes(st.measured_bytes),
            ]
        })
        .collect();
    print!(
        "{}",
        table(&["step", "loss", "time", "planned peak", measured], &rows)
    );
    println!(
        "median step time {:.3} s{}",
        med,
        if times.len() > 1 {
            " (steps after the first)"
        } else {
            ""
        }
    );
    if a.profile {
        print_profile(r, med);
    }
    if let Some(g) = agree {
        println!(
            "vs the CPU executor: largest loss difference {:.2e} (relative), parameters and optimizer state ‖Δ‖/‖cpu‖ = {:.2e} over {} elements{}",
            g.loss_rel,
            g.state_rel_l2,
            grouped(g.elements),
            g.worst_tensor
                .as_ref()
                .map(|w| format!(" (worst tensor {} at {:.2e})", w.0, w.1))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// `memplan run --json`'s document: the run's setup, each step, the
/// profile and the comparison with the CPU executor when asked.
fn run_json(
    a: &RunArgs,
    name: &str,
    plan: &memplan::Plan,
    world: u32,
    r: &RunReport,
    agree: Option<&Agreement>,
    med: f64,
) -> serde_json::Value {
    let s = &plan.stats;
    let device = device_name(a.device);
    let steps: Vec<_> = r
        .steps
        .iter()
        .enumerate()
        .map(|(i, st)| {
            json!({
                "step": i + 1,
                "loss": st.loss,
                "seconds": st.seconds,
                "planned_arena_bytes": plan.arena_bytes,
                // The arena's old name here, written for one more release.
                "planned_peak_bytes": plan.arena_bytes,
                "measured_peak_bytes": st.measured_bytes,
            })
        })
        .collect();
    json!({
        "graph": name,
        "device": device,
        "world_size": world,
        "planned": !a.unplanned,
        "arena_bytes": r.arena_bytes,
        "workspace_bytes": r.workspace_bytes,
        "lower_bound_bytes": s.lower_bound_bytes,
        "order_source": s.order_source,
        "layout_source": s.layout_source,
        "median_step_seconds": med,
        "attention": match a.attention {
            AttentionArg::Auto => "auto",
            AttentionArg::Flash => "flash",
            AttentionArg::Gemm => "gemm",
            AttentionArg::TensorCores => "tensor-cores",
        },
        "steps": steps,
        "profile": a.profile.then(|| r.profile.iter().map(|k| json!({
            "kernel": k.kernel,
            "instrs": k.instrs,
            "seconds_per_step": k.seconds,
        })).collect::<Vec<_>>()),
        "compare_cpu": agree.map(|g| json!({
            "loss_rel": g.loss_rel,
            "state_rel_l2": g.state_rel_l2,
            "worst_tensor": g.worst_tensor.as_ref().map(|w| &w.0),
            "worst_tensor_rel_l2": g.worst_tensor.as_ref().map(|w| w.1),
            "elements": g.elements,
        })),
    })
}

/// The time per step by kernel, with each kernel's share of the step.
fn print_profile(r: &RunReport, step_seconds: f64) {
    let timed: f64 = r.profile.iter().map(|k| k.seconds).sum();
    let rows: Vec<Vec<String>> = r
        .profile
        .iter()
        .map(|k| {
            vec![
                k.kernel.to_string(),
                k.instrs.to_string(),
                format!("{:.3} ms", k.seconds * 1e3),
                format!(
                    "{:.1}%",
                    100.0 * k.seconds / step_seconds.max(f64::MIN_POSITIVE)
                ),
            ]
        })
        .collect();
    println!("time by kernel, per step (rank 0; instructions timed one by one):");
    print!(
        "{}",
        table(&["kernel", "instructions", "time", "of the step"], &rows)
    );
    println!(
        "instructions {:.3} ms of the {:.3} ms step",
        timed * 1e3,
        step_seconds * 1e3
    );
}
