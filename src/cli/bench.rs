//! `memplan bench`: memplan against the lower bound and the baselines on
//! many graphs, and the peak record (`--update`, `--check`).

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Value, json};

use memplan::Options;
use memplan::bench::{self, Input, PeakEntry, PeakRecord, Row, Summary, Verdict, baseline_names};

use super::format::{grouped, human_bytes, table};

/// Every GPT-2 preset, in size order (added by `--presets`).
pub const GPT2_PRESETS: [&str; 5] = [
    "example:gpt2-tiny",
    "example:gpt2-small",
    "example:gpt2-medium",
    "example:gpt2-large",
    "example:gpt2-xl",
];

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Graph files, folders of graph files (walked recursively; files that
    /// are not graphs are skipped with a warning), or built-in examples
    /// written `example:NAME[,batch=N,seq=N,layers=N,dtype=T,clip=X,world=N,prefetch=N,noreshard,flat,reduce=bf16,checkpoint,fused,mixed]`.
    #[arg(value_name = "PATH")]
    pub paths: Vec<String>,
    /// Add every built-in GPT-2 preset (gpt2-tiny, -small, -medium, -large, -xl).
    #[arg(long)]
    pub presets: bool,
    /// Print the results as JSON.
    #[arg(long, conflicts_with = "markdown")]
    pub json: bool,
    /// Print the table as Markdown.
    #[arg(long)]
    pub markdown: bool,
    /// Time budget of each solve, in seconds (default 10; with --update or
    /// --check and no value, each recorded graph's own budget).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub time_limit: Option<f64>,
    /// Write memplan's arenas and lower bounds into this record (created if
    /// missing). Without PATHs, re-benchmarks every graph the record holds.
    #[arg(long, value_name = "RECORD", conflicts_with = "check")]
    pub update: Option<PathBuf>,
    /// With --update: record figures even when worse than recorded, or when
    /// the graph itself changed.
    #[arg(long, requires = "update")]
    pub accept_worse: bool,
    /// Re-plan every graph of this record (no baselines) and fail if an
    /// arena grew or a lower bound shrank.
    #[arg(long, value_name = "RECORD")]
    pub check: Option<PathBuf>,
    /// Split token-wise chains (the loss chain, row-wise MLP regions) of
    /// every graph as `memplan plan --split` does: `auto` tries 2 to 32
    /// chunks, `K` tries K, a split kept only where it lowers the arena;
    /// the baselines then run the split step too (docs/splitting.md). A record
    /// holds unsplit graphs: record a split one as
    /// `example:NAME,split=K`.
    #[arg(long, value_name = "auto|K|off", alias = "split-chunks", conflicts_with_all = ["update", "check"])]
    pub split: Option<memplan::split::Split>,
}

fn progress() -> bool {
    std::io::stderr().is_terminal()
}

fn budget(s: f64) -> Result<Duration> {
    super::load::time_limit(s)
}

/// One graph to benchmark: where it comes from, its time budget, and the
/// source it is recorded under (with `--update`).
struct Job {
    input: Input,
    limit: Duration,
    recorded_as: Option<String>,
}

/// The record `--update` writes: its path, its folder, what it holds.
type Record = (PathBuf, PathBuf, PeakRecord);

/// What the benchmark produced: rows, fresh record entries, and the files
/// of folders that were not graphs.
struct Results {
    rows: Vec<Row>,
    fresh: Vec<PeakEntry>,
    skipped: Vec<(String, String)>,
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(rec) = &a.check {
        if !a.paths.is_empty() || a.presets {
            bail!("--check re-plans the graphs its record holds: give no PATHs with it");
        }
        return check(rec, a.json);
    }
    let (todo, record) = jobs(&a)?;
    let start = Instant::now();
    let res = run_jobs(todo, a.split)?;
    let wall = start.elapsed().as_secs_f64();
    print_results(&a, &res, wall)?;
    match record {
        Some(record) => write_record(record, res.fresh, a.accept_worse),
        None => Ok(()),
    }
}

/// The graphs to run, with their budgets, and the record to update.
fn jobs(a: &BenchArgs) -> Result<(Vec<Job>, Option<Record>)> {
    let default_budget = budget(a.time_limit.unwrap_or(10.0))?;
    let mut todo: Vec<Job> = Vec::new();
    let mut record = None;
    if let Some(path) = &a.update {
        let rec = if path.exists() {
            PeakRecord::read(path)?
        } else {
            PeakRecord::default()
        };
        let dir = bench::record_dir(path);
        if a.paths.is_empty() && !a.presets {
            if rec.entries.is_empty() {
                bail!(
                    "{}: the record holds no graphs yet: give the graphs to record",
                    path.display()
                );
            }
            for e in &rec.entries {
                let source = bench::recorded_source(&e.source, &dir)?;
                let limit = match a.time_limit {
                    Some(_) => default_budget,
                    None => budget(e.time_limit_seconds)?,
                };
                let input = Input {
                    source,
                    from_folder: false,
                };
                let recorded_as = Some(e.source.clone());
                todo.push(Job {
                    input,
                    limit,
                    recorded_as,
                });
            }
        }
        record = Some((path.clone(), dir, rec));
    }
    let mut args = a.paths.clone();
    if a.presets {
        args.extend(GPT2_PRESETS.iter().map(|s| s.to_string()));
    }
    for input in bench::expand(&args)? {
        let recorded_as = match &record {
            Some((_, dir, _)) => Some(bench::record_source(&input.source, dir)?),
            None => None,
        };
        let limit = match (&record, &recorded_as, a.time_limit) {
            (Some((_, _, rec)), Some(src), None) => match rec.entry(src) {
                Some(e) => budget(e.time_limit_seconds)?,
                None => default_budget,
            },
            _ => default_budget,
        };
        todo.push(Job {
            input,
            limit,
            recorded_as,
        });
    }
    if todo.is_empty() {
        bail!("nothing to benchmark: give graph files, folders, example:NAME, or --presets");
    }
    Ok((todo, record))
}

/// Plans every graph; files of a folder that are not graphs are skipped.
fn run_jobs(todo: Vec<Job>, split: Option<memplan::split::Split>) -> Result<Results> {
    let mut res = Results {
        rows: Vec::new(),
        fresh: Vec::new(),
        skipped: Vec::new(),
    };
    let total = todo.len();
    for (k, job) in todo.into_iter().enumerate() {
        let label = job.input.source.label();
        let g = match job.input.source.load() {
            Ok(g) => g,
            Err(e) if job.input.from_folder => {
                eprintln!("memplan bench: skipping {label}: not a graph memplan reads ({e})");
                res.skipped.push((label, e.to_string()));
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("loading {label}")),
        };
        if progress() {
            eprint!(
                "[{}/{total}] {label}: {} ops, {} tensors ... ",
                k + 1,
                g.num_ops(),
                g.num_tensors()
            );
        }
        let opts = Options {
            time_limit: job.limit,
            split: split.unwrap_or_default(),
            ..Options::default()
        };
        let row = bench::run(&g, &label, &opts).with_context(|| format!("benchmarking {label}"))?;
        if progress() {
            eprintln!("planned in {:.2} s", row.solve_seconds);
        }
        if let Some(src) = job.recorded_as {
            res.fresh.push(PeakEntry::from_row(&row, src));
        }
        res.rows.push(row);
    }
    Ok(res)
}

fn print_results(a: &BenchArgs, res: &Results, wall: f64) -> Result<()> {
    let summary = bench::summarize(&res.rows);
    if a.json {
        let doc = to_json(&res.rows, &summary, &res.skipped, wall);
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else if a.markdown {
        print!("{}", markdown(&res.rows, &summary));
    } else {
        print!("{}", text(&res.rows, &summary));
        println!(
            "{} graphs in {wall:.1} s (solves {:.1} s, baselines {:.1} s)",
            res.rows.len(),
            summary.total_solve_seconds,
            summary.total_baseline_seconds
        );
    }
    Ok(())
}

/// Merges the fresh entries into the record and writes it; figures worse
/// than recorded are refused unless `accept_worse`.
fn write_record(record: Record, fresh: Vec<PeakEntry>, accept_worse: bool) -> Result<()> {
    let (path, _, mut rec) = record;
    let before = rec.clone();
    let refused = rec.merge(fresh, accept_worse);
    rec.write(path.as_path())
        .with_context(|| format!("writing {}", path.display()))?;
    let changed = rec
        .entries
        .iter()
        .filter(|e| before.entry(&e.source) != Some(*e))
        .count();
    eprintln!(
        "{}: {} graphs recorded, {changed} changed or added",
        path.display(),
        rec.entries.len()
    );
    if !refused.is_empty() {
        for v in &refused {
            eprintln!("  refused: {v}");
        }
        bail!(
            "{} figures are worse than recorded and were not written (pass --accept-worse to record them anyway)",
            refused.len()
        );
    }
    Ok(())
}

fn check(path: &Path, as_json: bool) -> Result<()> {
    let start = Instant::now();
    let verdicts = bench::check_record(path)?;
    let failures = verdicts.iter().filter(|v| v.is_failure()).count();
    let improved = verdicts
        .iter()
        .filter(|v| matches!(v, Verdict::Improved { .. }))
        .count();
    if as_json {
        let list: Vec<Value> = verdicts.iter().map(verdict_json).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"record": path.display().to_string(),
                "verdicts": list, "failures": failures, "improved": improved}))?
        );
    } else {
        for v in &verdicts {
            println!("{v}");
        }
        println!(
            "{}: {} graphs re-planned in {:.1} s: {failures} worse, {improved} improved",
            path.display(),
            verdicts.len(),
            start.elapsed().as_secs_f64()
        );
        if improved > 0 && failures == 0 {
            println!(
                "arenas improved: record them with memplan bench --update {}",
                path.display()
            );
        }
    }
    if failures > 0 {
        bail!("{failures} recorded graphs got worse (see above)");
    }
    Ok(())
}

fn verdict_json(v: &Verdict) -> Value {
    let (kind, old, new) = match v {
        Verdict::Same { source } => return json!({"source": source, "verdict": "same"}),
        Verdict::Improved { old, new } => ("improved", old, new),
        Verdict::Regressed { old, new } => ("regressed", old, new),
        Verdict::GraphChanged { old, new } => ("graph_changed", old, new),
    };
    json!({"source": old.source, "verdict": kind, "recorded": old, "now": new})
}

fn to_json(rows: &[Row], s: &Summary, skipped: &[(String, String)], wall: f64) -> Value {
    let graphs: Vec<Value> = rows
        .iter()
        .map(|r| {
            let b: serde_json::Map<String, Value> = r
                .baselines
                .iter()
                .map(|b| {
                    (
                        b.name.clone(),
                        json!({"footprint_bytes": b.footprint_bytes,
                               "peak_bytes": b.footprint_bytes,
                               "description": b.description,
                               "ratio_to_lower_bound": bench::ratio(b.footprint_bytes, r.lower_bound_bytes)}),
                    )
                })
                .collect();
            json!({
                "source": r.source,
                "graph": r.graph,
                "ops": r.ops,
                "tensors": r.tensors,
                "total_bytes": r.total_bytes,
                "lower_bound_bytes": r.lower_bound_bytes,
                "lower_bound_kind": r.lower_bound_kind,
                "baselines": b,
                "best_baseline": r.best_baseline().map(|b| b.name.clone()),
                "arena_bytes": r.arena_bytes,
                "peak_bytes": r.arena_bytes,
                "max_live_bytes": r.max_live_bytes,
                "ratio_to_lower_bound": r.ratio_to_lower_bound(),
                "ratio_to_best_baseline": r.ratio_to_best_baseline(),
                "best_eager": r.best_eager().map(|b| b.name.clone()),
                "ratio_to_best_eager": r.ratio_to_best_eager(),
                "solve_seconds": r.solve_seconds,
                "baseline_seconds": r.baseline_seconds,
                "time_limit_seconds": r.time_limit_seconds,
                "split_chunks": r.split_chunks,
                "order_source": r.order_source,
                "layout_source": r.layout_source,
            })
        })
        .collect();
    json!({
        "graphs": graphs,
        "summary": s,
        "skipped": skipped.iter().map(|(p, why)| json!({"path": p, "reason": why})).collect::<Vec<_>>(),
        "wall_seconds": wall,
    })
}

/// Header and cells of the table shared by the text and Markdown forms.
fn cells(rows: &[Row], s: &Summary) -> (Vec<String>, Vec<Vec<String>>) {
    let names = baseline_names(rows);
    let mut header: Vec<String> = ["graph", "ops", "tensors", "lower bound"]
        .iter()
        .map(|h| h.to_string())
        .collect();
    header.extend(names.iter().cloned());
    header.extend(
        [
            "memplan",
            "vs bound",
            "vs best baseline",
            "vs best eager",
            "solve",
        ]
        .iter()
        .map(|h| h.to_string()),
    );
    let mut out = Vec::new();
    for r in rows {
        // Graphs of the same name (two dumps of one step) are told apart by
        // where they came from.
        let same_name = rows.iter().filter(|o| o.graph == r.graph).count();
        let name = if same_name > 1 {
            r.source.clone()
        } else {
            r.graph.clone()
        };
        // memplan's figures (and the bound) of a split graph say so.
        let name = match r.split_chunks {
            1 => name,
            k => format!("{name} (split {k})"),
        };
        let mut c = vec![
            name,
            grouped(r.ops as u64),
            grouped(r.tensors as u64),
            human_bytes(r.lower_bound_bytes),
        ];
        for n in &names {
            c.push(r.baseline(n).map(human_bytes).unwrap_or_else(|| "-".into()));
        }
        c.push(human_bytes(r.arena_bytes));
        c.push(format!("{:.3}", r.ratio_to_lower_bound()));
        c.push(
            r.ratio_to_best_baseline()
                .map(|x| format!("{x:.3}"))
                .unwrap_or_else(|| "-".into()),
        );
        c.push(
            r.ratio_to_best_eager()
                .map(|x| format!("{x:.3}"))
                .unwrap_or_else(|| "-".into()),
        );
        c.push(format!("{:.2} s", r.solve_seconds));
        out.push(c);
    }
    let gm = |x: Option<f64>| x.map(|v| format!("×{v:.3}")).unwrap_or_else(|| "-".into());
    let mut c = vec![
        format!("geomean ({} graphs)", s.graphs),
        String::new(),
        String::new(),
        "×1.000".into(),
    ];
    for b in &s.baselines {
        c.push(gm(b.geomean_ratio_to_lower_bound));
    }
    c.push(gm(s.geomean_ratio_to_lower_bound));
    c.push(
        s.geomean_ratio_to_lower_bound
            .map(|v| format!("{v:.3}"))
            .unwrap_or_else(|| "-".into()),
    );
    c.push(
        s.geomean_ratio_to_best_baseline
            .map(|v| format!("{v:.3}"))
            .unwrap_or_else(|| "-".into()),
    );
    c.push(
        s.geomean_ratio_to_best_eager
            .map(|v| format!("{v:.3}"))
            .unwrap_or_else(|| "-".into()),
    );
    c.push(format!("{:.2} s", s.total_solve_seconds));
    out.push(c);
    (header, out)
}

const FOOTNOTE: &str = "Each figure is the memory a side needs: an arena for memplan and the layouts, reserved bytes for the simulated caching allocator, max live bytes for program-order and pytorch-allocated; vs bound = memplan / lower bound, vs best baseline = memplan / smallest baseline, vs best eager = memplan / the least reserved of the simulated PyTorch eager configurations (pytorch-reserved, pytorch-expandable-segments, eager-optimizer-in-backward[-expandable-segments]). The geomean row gives each column's geometric mean of figure / lower bound and the total solve time.";

fn text(rows: &[Row], s: &Summary) -> String {
    let (header, body) = cells(rows, s);
    let h: Vec<&str> = header.iter().map(|x| x.as_str()).collect();
    let mut out = table(&h, &body);
    out.push_str(FOOTNOTE);
    out.push('\n');
    out
}

fn markdown(rows: &[Row], s: &Summary) -> String {
    let (header, body) = cells(rows, s);
    let mut out = format!("| {} |\n", header.join(" | "));
    let align: Vec<&str> = (0..header.len())
        .map(|i| if i == 0 { ":--" } else { "--:" })
        .collect();
    out.push_str(&format!("| {} |\n", align.join(" | ")));
    let last = body.len().saturating_sub(1);
    for (i, r) in body.iter().enumerate() {
        let r: Vec<String> = if i == last {
            r.iter()
                .map(|c| {
                    if c.is_empty() {
                        c.clone()
                    } else {
                        format!("**{c}**")
                    }
                })
                .collect()
        } else {
            r.clone()
        };
        out.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    out.push('\n');
    out.push_str(FOOTNOTE);
    out.push('\n');
    out
}
