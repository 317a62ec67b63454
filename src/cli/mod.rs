//! Command-line front end: argument parsing (here) and one file per
//! command (`plan`, `check`, `stats`, `compare`, `export`, `alloc`, `run`,
//! `bench`, `plot`, `trace`, `fit`), each starting from what [`load`]
//! gives: the graph a command names, its time limit, its plan. `load`
//! imports no command, and no command imports another (tests/layering.rs).

/// `println!`, or `eprintln!` while a document holds standard output
/// (`-o -`): a command's summary then goes to standard error, so what
/// reaches standard output is the document alone.
macro_rules! sayln {
    ($($t:tt)*) => {
        if crate::cli::stdout_taken() {
            eprintln!($($t)*)
        } else {
            println!($($t)*)
        }
    };
}

/// `print!` as [`sayln!`] is `println!`.
macro_rules! say {
    ($($t:tt)*) => {
        if crate::cli::stdout_taken() {
            eprint!($($t)*)
        } else {
            print!($($t)*)
        }
    };
}

mod alloc;
mod bench;
mod check;
mod compare;
mod export;
mod fit;
pub mod format;
mod load;
mod plan;
mod plot;
mod progress;
mod report;
mod run;
mod stats;
mod trace;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};

/// Set once a document claims standard output (`-o -`).
static STDOUT_TAKEN: AtomicBool = AtomicBool::new(false);

/// Whether a document holds standard output (see [`sayln!`]).
pub fn stdout_taken() -> bool {
    STDOUT_TAKEN.load(Ordering::Relaxed)
}

/// Whether an output path means standard output: `-`.
pub fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// An output path as messages show it.
pub fn shown(path: &Path) -> String {
    if is_stdout(path) {
        "standard output".into()
    } else {
        path.display().to_string()
    }
}

/// Claims standard output for whichever of a command's output options is
/// `-`, so its summary goes to standard error; two documents cannot share
/// it. Call before printing anything.
pub fn claim_stdout(outputs: &[(&str, Option<&Path>)]) -> Result<()> {
    let to_stdout: Vec<&str> = outputs
        .iter()
        .filter(|(_, p)| p.is_some_and(is_stdout))
        .map(|(name, _)| *name)
        .collect();
    if to_stdout.len() > 1 {
        bail!(
            "{} all say `-`: only one of them can write to standard output",
            to_stdout.join(" and ")
        );
    }
    if !to_stdout.is_empty() {
        STDOUT_TAKEN.store(true, Ordering::Relaxed);
    }
    Ok(())
}

/// Writes a command's output document to `path`, or to standard output
/// for `-`.
pub fn write_output(path: &Path, text: &str) -> Result<()> {
    if is_stdout(path) {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())
            .and_then(|()| match text.ends_with('\n') {
                true => Ok(()),
                false => out.write_all(b"\n"),
            })
            .and_then(|()| out.flush())
            .context("writing to standard output")
    } else {
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "memplan",
    version,
    about = "Plan operator order and tensor offsets so a training step fits in less memory",
    long_about = None
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// `--clip-grad-norm`, refused at parsing unless a positive finite number.
fn clip_grad_norm(text: &str) -> Result<f64, String> {
    let x: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("expected a positive number, got {text:?}"))?;
    memplan::models::clip_grad_norm(x)
        .map_err(|_| format!("expected a positive finite number, got {text}"))
}

/// Where the graph comes from: a file, or a built-in example.
#[derive(Args, Debug, Clone, Default)]
pub struct GraphArgs {
    /// Built-in example instead of a file: gpt2-tiny, gpt2-small, gpt2-medium,
    /// gpt2-large, gpt2-xl, llama-tiny, llama3-1b, llama3-8b, llama2-7b, mlp.
    #[arg(long, value_name = "NAME")]
    pub example: Option<String>,
    /// Batch size of the example.
    #[arg(long, value_name = "N", requires = "example")]
    pub batch: Option<u64>,
    /// Sequence length of a GPT-2 or Llama example.
    #[arg(long, value_name = "N", requires = "example")]
    pub seq: Option<u64>,
    /// Number of layers of the example (a built-in example has at most
    /// 1,000,000 ops: a larger request is refused with its size).
    #[arg(long, value_name = "N", requires = "example")]
    pub layers: Option<u64>,
    /// Element type of the example: f32, bf16, f16.
    #[arg(long, value_name = "TYPE", requires = "example")]
    pub dtype: Option<String>,
    /// Activation checkpointing in every GPT-2 or Llama block.
    #[arg(long, requires = "example")]
    pub checkpoint: bool,
    /// Clip the gradients' global norm before the updates (GPT-2 and Llama
    /// examples).
    #[arg(
        long,
        value_name = "MAX",
        requires = "example",
        allow_negative_numbers = true,
        value_parser = clip_grad_norm
    )]
    pub clip_grad_norm: Option<f64>,
    /// Fused (flash-style) attention in every GPT-2 block: no [B, H, T, T]
    /// scores or probabilities, the log-sum-exp saved for the backward
    /// (Llama examples always use it).
    #[arg(long, requires = "example")]
    pub fused_attention: bool,
    /// Mixed precision (GPT-2 and Llama examples): f32 parameters and Adam
    /// moments, bf16 compute and activations (or --dtype), bf16 weight
    /// copies cast at first use, gradients cast to f32 for the update.
    #[arg(long, requires = "example")]
    pub mixed_precision: bool,
    /// XLA HLO modules: count memory as XLA's allocations hold it. Each
    /// entry parameter an output aliases (`input_output_alias`) keeps its
    /// bytes for the whole step and the output is written into them, so the
    /// plan's peak is what XLA needs for the order (docs/hlo.md). Without
    /// it, one arena, where a dead donated parameter's bytes hold anything.
    #[arg(long, conflicts_with = "example")]
    pub xla_allocations: bool,
    /// Shard the step over this many ranks (ZeRO-3 / FSDP): the graph of one
    /// rank, with all-gathers and reduce-scatters (docs/runtime.md).
    #[arg(long, value_name = "W")]
    pub world_size: Option<u64>,
    /// With --world-size: all-gathers issued this many units ahead of their
    /// use (FSDP2 prefetches 1); the plan keeps the overlap.
    #[arg(long, value_name = "N", default_value_t = 1, requires = "world_size")]
    pub prefetch: u32,
    /// With --world-size: keep each unit's gathered parameters from its
    /// forward to its backward (FSDP2's `reshard_after_forward=False`): one
    /// all-gather per unit and step instead of two.
    #[arg(long, requires = "world_size")]
    pub no_reshard_after_forward: bool,
    /// With --world-size and --mixed-precision: reduce-scatter gradients in
    /// bf16 (FSDP2's `reduce_dtype=bf16`) instead of f32.
    #[arg(long, requires = "world_size")]
    pub reduce_bf16: bool,
    /// With --world-size: shard each unit as one flat buffer (FSDP1 /
    /// ZeRO-3: ops read views of the gathered buffer, one update per unit)
    /// instead of FSDP2's per-parameter shards.
    #[arg(long, requires = "world_size")]
    pub flat_shards: bool,
    /// Split token-wise chains (the loss: LM head, cross-entropy and
    /// their backward; the row-wise regions around up projections, a
    /// block's MLP) into chunks of rows, after sharding with --world-size
    /// (docs/splitting.md). Where the command makes the plan (`plan`,
    /// `compare`, `fit`) `auto` tries 2 to 32 chunks and `K` tries K, and
    /// the split is kept only where it lowers the arena (`fit`: where it
    /// fits cheaper or smaller); the other commands read the graph split
    /// into exactly K chunks, the graph a plan made with `--split` holds
    /// (its summary names K), and refuse `auto`. `off` (the default)
    /// never splits. `--split-chunks K` is the deprecated old name.
    #[arg(long, value_name = "auto|K|off", alias = "split-chunks")]
    pub split: Option<memplan::split::Split>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Plan a graph: choose the order and every tensor's offset.
    Plan {
        /// Graph file: memplan JSON, XLA HLO text or a networkx node-link graph
        /// (Checkmate, Moccasin), optionally .gz.
        #[arg(required_unless_present = "example")]
        graph: Option<PathBuf>,
        #[command(flatten)]
        source: GraphArgs,
        /// Write the plan (JSON) here; `-`: to standard output (the summary
        /// then goes to standard error).
        #[arg(short, long, value_name = "PLAN")]
        output: Option<PathBuf>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
        /// Time budget for the whole solve, in seconds.
        #[arg(
            long,
            value_name = "S",
            allow_negative_numbers = true,
            default_value_t = 10.0
        )]
        time_limit: f64,
        /// Report where the time went and each part's size, bound, peak and gap.
        #[arg(long)]
        report: bool,
        /// Write the graph that was planned (split or not) as memplan JSON,
        /// to check or run the plan with.
        #[arg(long, value_name = "FILE")]
        graph_output: Option<PathBuf>,
    },
    /// Check a plan against its graph with the independent checker.
    Check {
        /// GRAPH PLAN, or just PLAN with --example.
        #[arg(num_args = 1..=2, value_name = "FILES", required = true)]
        files: Vec<PathBuf>,
        #[command(flatten)]
        source: GraphArgs,
        #[arg(long)]
        json: bool,
    },
    /// Print what a graph holds: ops, tensors, bytes by role.
    Stats {
        #[arg(required_unless_present = "example")]
        graph: Option<PathBuf>,
        #[command(flatten)]
        source: GraphArgs,
        #[arg(long)]
        json: bool,
    },
    /// Compare memplan with the baselines and the lower bound on one graph.
    Compare {
        #[arg(required_unless_present = "example")]
        graph: Option<PathBuf>,
        #[command(flatten)]
        source: GraphArgs,
        #[arg(long)]
        json: bool,
        /// Time budget for memplan's solve, in seconds.
        #[arg(
            long,
            value_name = "S",
            allow_negative_numbers = true,
            default_value_t = 10.0
        )]
        time_limit: f64,
    },
    /// Offsets for buffers with fixed lifetimes (MiniMalloc CSV), or the
    /// allocator's benchmark report (--report).
    Alloc(alloc::AllocArgs),
    /// Run the planned step for real (CPU, or CUDA) inside one arena.
    Run(run::RunArgs),
    /// Write a graph as memplan JSON (a built-in example or any graph file),
    /// or with --hlo an XLA module relisted in memplan's order, scheduled,
    /// for XLA to run as planned.
    Export {
        /// Graph file (memplan JSON, HLO text or node-link JSON); with --hlo,
        /// the HLO module.
        graph: Option<PathBuf>,
        #[command(flatten)]
        source: GraphArgs,
        /// Output file (.json, or .json.gz to compress; with --hlo, HLO text,
        /// .gz to compress); `-`: standard output.
        #[arg(short, long, value_name = "FILE")]
        output: PathBuf,
        /// Write the HLO module GRAPH with its entry computation in the
        /// plan's order and `is_scheduled=true`.
        #[arg(long)]
        hlo: bool,
        /// With --hlo: the plan to apply (from `memplan plan -o`); without
        /// it, the module is planned now.
        #[arg(long, value_name = "PLAN", requires = "hlo")]
        plan: Option<PathBuf>,
        /// With --hlo and no --plan: time budget for the solve, in seconds.
        #[arg(
            long,
            value_name = "S",
            allow_negative_numbers = true,
            default_value_t = 10.0
        )]
        time_limit: f64,
        /// With --hlo: do not chain the entry's instructions with control
        /// predecessors (XLA's CPU compiler then schedules them again).
        #[arg(long, requires = "hlo")]
        no_chain: bool,
    },
    /// Benchmark memplan against the lower bound and the baselines on many
    /// graphs; keep or check the peak record.
    Bench(bench::BenchArgs),
    /// Draw a plan's memory as SVG: live bytes by role, and the arena layout.
    Plot(plot::PlotArgs),
    /// Write a plan's memory timeline as a Chrome / Perfetto trace (JSON).
    Trace(trace::TraceArgs),
    /// Fit a step into a memory budget: choose what to recompute, at the
    /// least added cost, then plan; or show that nothing fits.
    Fit(fit::FitArgs),
}

/// Parses the arguments and runs; returns the process exit code.
pub fn main() -> i32 {
    if std::env::args_os().any(|a| {
        a.to_str()
            .is_some_and(|a| a == "--split-chunks" || a.starts_with("--split-chunks="))
    }) {
        eprintln!(
            "memplan: warning: --split-chunks is deprecated and goes in the next release; use --split K (the same flag on plan, compare, fit, bench and every other command)"
        );
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match run_command(cli.command) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("memplan: {}", message(&e));
            1
        }
    }
}

/// The error and its causes, each cause once: errors that already print
/// their cause (`path: cause`) do not get it appended again.
fn message(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}

/// Runs one command.
fn run_command(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Plan {
            graph,
            source,
            output,
            json,
            time_limit,
            report,
            graph_output,
        } => plan::plan(
            graph,
            &source,
            (output, graph_output),
            json,
            time_limit,
            report,
        ),
        Command::Check {
            files,
            source,
            json,
        } => check::check(files, &source, json),
        Command::Stats {
            graph,
            source,
            json,
        } => stats::stats(graph, &source, json),
        Command::Compare {
            graph,
            source,
            json,
            time_limit,
        } => compare::compare(graph, &source, json, time_limit),
        Command::Export {
            graph,
            source,
            output,
            hlo,
            plan,
            time_limit,
            no_chain,
        } => match (hlo, graph) {
            (true, Some(g)) => {
                let opts = memplan::io::hlo::ImportOptions {
                    xla_allocations: source.xla_allocations,
                    ..Default::default()
                };
                export::export_hlo(&g, plan.as_deref(), &output, time_limit, no_chain, &opts)
            }
            (true, None) => anyhow::bail!("--hlo needs the HLO module file as GRAPH"),
            (false, g) => export::export(g.as_deref(), &source, &output),
        },
        Command::Alloc(a) => alloc::run(a),
        Command::Run(args) => run::run(args),
        Command::Bench(a) => bench::run(a),
        Command::Plot(a) => plot::run(a),
        Command::Trace(a) => trace::run(a),
        Command::Fit(a) => fit::run(a),
    }
}
