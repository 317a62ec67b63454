//! Benchmarks over many graphs, and the record of memplan's arenas (the
//! "peak record", `fixtures/peaks.json`).
//!
//! `memplan bench` plans every graph it is given and sets memplan's arena
//! beside the lower bound and every baseline ([`crate::baselines::all`]):
//! one [`Row`] per graph, a [`Summary`] with geometric means. Graphs come
//! from [`Source`]s: graph files, folders of them, and built-in examples
//! (`example:gpt2-small`).
//!
//! # The peak record
//! Peak memory is exact and deterministic, so it is tracked like a test
//! result: a [`PeakRecord`] (`fixtures/peaks.json`) holds, for each recorded
//! graph, memplan's arena and the lower bound. [`check_record`]
//! re-plans every recorded graph and reports each [`Verdict`]; the
//! regression test fails when an arena grew or a bound shrank, with no
//! tolerance. When arenas improve, `memplan bench --update fixtures/peaks.json`
//! rewrites the record ([`PeakRecord::merge`] refuses to record a worse
//! figure unless asked to).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::baselines::{self, Baseline};
use crate::error::Error;
use crate::example_spec::ExampleSpec;
use crate::graph::Graph;
use crate::models::ExampleOptions;
use crate::pipeline::Options;
use crate::transforms::Transforms;

/// The prefix that names a built-in example instead of a file.
pub const EXAMPLE_PREFIX: &str = crate::example_spec::PREFIX;

/// Where one benchmarked graph comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A built-in example: `example:NAME[,key=value...]`
    /// ([`ExampleSpec::parse`]): the same graph as the CLI's `--example
    /// NAME` with the matching flags.
    Example {
        /// The spec as written, e.g. `example:gpt2-small,batch=4`.
        spec: String,
        name: String,
        opts: ExampleOptions,
        /// Split and shard as these say ([`crate::transforms`]).
        transforms: Transforms,
    },
    /// A graph file, anything [`crate::io::load_graph`] reads.
    File(PathBuf),
}

impl Source {
    /// Reads `arg`: an example spec when it starts with `example:`, else a
    /// file path.
    pub fn parse(arg: &str) -> Result<Source, Error> {
        if !arg.starts_with(EXAMPLE_PREFIX) {
            return Ok(Source::File(PathBuf::from(arg)));
        }
        let ExampleSpec {
            name,
            opts,
            transforms,
        } = ExampleSpec::parse(arg)?;
        Ok(Source::Example {
            spec: arg.to_string(),
            name,
            opts,
            transforms,
        })
    }

    /// Builds or reads the graph.
    pub fn load(&self) -> Result<Graph, Error> {
        match self {
            Source::Example {
                name,
                opts,
                transforms,
                ..
            } => transforms.apply(crate::models::example(name, opts)?),
            Source::File(p) => crate::io::load_graph(p),
        }
    }

    /// How the source is written on the command line and in the record.
    pub fn label(&self) -> String {
        match self {
            Source::Example { spec, .. } => spec.clone(),
            Source::File(p) => p.display().to_string(),
        }
    }
}

/// One source to benchmark, and whether it was found by walking a folder
/// (such a file is skipped, with a warning, when it is not a graph).
#[derive(Clone, Debug)]
pub struct Input {
    pub source: Source,
    pub from_folder: bool,
}

/// Turns command-line arguments into inputs: example specs, files, and
/// folders, walked recursively in name order.
pub fn expand(args: &[String]) -> Result<Vec<Input>, Error> {
    let mut out = Vec::new();
    for arg in args {
        let source = Source::parse(arg)?;
        match &source {
            Source::File(p) if p.is_dir() => {
                let mut files = Vec::new();
                walk(p, &mut files)?;
                files.sort();
                out.extend(files.into_iter().map(|f| Input {
                    source: Source::File(f),
                    from_folder: true,
                }));
            }
            _ => out.push(Input {
                source,
                from_folder: false,
            }),
        }
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), Error> {
    let io = |source| Error::Io {
        path: dir.to_path_buf(),
        source,
    };
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let hidden = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'));
        if hidden {
            continue;
        }
        if path.is_dir() {
            walk(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

/// One graph's benchmark: memplan against the bound and the baselines.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// Where the graph came from ([`Source::label`]).
    pub source: String,
    /// The graph's own name.
    pub graph: String,
    pub ops: usize,
    pub tensors: usize,
    /// Bytes of every tensor that owns memory (a fingerprint of the graph).
    pub total_bytes: u64,
    pub lower_bound_bytes: u64,
    pub lower_bound_kind: String,
    /// Every baseline's footprint, in [`baselines::all`]'s order.
    pub baselines: Vec<Baseline>,
    /// memplan's arena.
    pub arena_bytes: u64,
    /// The most bytes live at once in memplan's order.
    pub max_live_bytes: u64,
    pub order_source: String,
    pub layout_source: String,
    /// Seconds memplan spent planning.
    pub solve_seconds: f64,
    /// Seconds spent computing the baselines.
    pub baseline_seconds: f64,
    /// The planner's time budget.
    pub time_limit_seconds: f64,
    /// Chunks of the graph memplan planned (`Options::split`; 1: the
    /// graph as given). Every figure of the row is that graph's.
    pub split_chunks: u64,
}

impl Row {
    /// memplan's arena over the lower bound (1.0 is optimal).
    pub fn ratio_to_lower_bound(&self) -> f64 {
        ratio(self.arena_bytes, self.lower_bound_bytes)
    }
    /// The baseline with the smallest footprint.
    pub fn best_baseline(&self) -> Option<&Baseline> {
        self.baselines.iter().min_by_key(|b| b.footprint_bytes)
    }
    /// memplan's arena over the smallest baseline footprint (below 1.0: memplan
    /// needs less than every baseline).
    pub fn ratio_to_best_baseline(&self) -> Option<f64> {
        self.best_baseline()
            .map(|b| ratio(self.arena_bytes, b.footprint_bytes))
    }
    /// The strongest eager configuration ([`baselines::best_eager`]).
    pub fn best_eager(&self) -> Option<&Baseline> {
        baselines::best_eager(&self.baselines)
    }
    /// memplan's arena over the best eager configuration's footprint.
    pub fn ratio_to_best_eager(&self) -> Option<f64> {
        self.best_eager()
            .map(|b| ratio(self.arena_bytes, b.footprint_bytes))
    }
    /// A baseline's footprint by name.
    pub fn baseline(&self, name: &str) -> Option<u64> {
        self.baselines
            .iter()
            .find(|b| b.name == name)
            .map(|b| b.footprint_bytes)
    }
}

/// `a / b`, with `0 / 0 = 1` (an empty graph is at its bound).
pub fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        if a == 0 { 1.0 } else { f64::INFINITY }
    } else {
        a as f64 / b as f64
    }
}

/// Geometric mean of positive finite values (`None` when there are none).
pub fn geomean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for v in values {
        if v.is_finite() && v > 0.0 {
            sum += v.ln();
            n += 1;
        }
    }
    (n > 0).then(|| (sum / n as f64).exp())
}

/// Plans `g` (split as `opts.split` asks, [`crate::split::plan`]: kept
/// where that lowers the arena), checks the plan with the independent
/// checker, and measures every baseline on the step memplan planned
/// (split or not: eager with a chunked loss).
pub fn run(g: &Graph, source: &str, opts: &Options) -> Result<Row, Error> {
    let split;
    let (g, plan, split_chunks) = match opts.split {
        crate::pipeline::Split::Off => {
            let plan = crate::plan(g, opts)?;
            crate::checker::check(g, &plan)?;
            (g, plan, 1)
        }
        _ => {
            // split::plan checks its plan against the split graph.
            let (sg, plan, rep) = crate::split::plan(g, opts)?;
            split = sg;
            (&split, plan, rep.chunks)
        }
    };
    let start = Instant::now();
    let baselines = baselines::all(g);
    let baseline_seconds = start.elapsed().as_secs_f64();
    let s = &plan.stats;
    Ok(Row {
        source: source.to_string(),
        graph: g.name.clone(),
        ops: g.num_ops(),
        tensors: g.num_tensors(),
        total_bytes: g.total_bytes(),
        lower_bound_bytes: s.lower_bound_bytes,
        lower_bound_kind: s.lower_bound_kind.clone(),
        baselines,
        arena_bytes: plan.arena_bytes,
        max_live_bytes: s.max_live_bytes,
        order_source: s.order_source.clone(),
        layout_source: s.layout_source.clone(),
        solve_seconds: s.solve_seconds,
        baseline_seconds,
        time_limit_seconds: opts.time_limit.as_secs_f64(),
        split_chunks,
    })
}

/// Geometric means over many rows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub graphs: usize,
    /// Geometric mean of memplan's arena over the lower bound.
    pub geomean_ratio_to_lower_bound: Option<f64>,
    /// Geometric mean of memplan's arena over the best baseline.
    pub geomean_ratio_to_best_baseline: Option<f64>,
    /// Geometric mean of memplan's arena over the best eager configuration.
    pub geomean_ratio_to_best_eager: Option<f64>,
    /// For each baseline (first-seen order): the geometric mean of its
    /// footprint over the lower bound, over the graphs that have it.
    pub baselines: Vec<BaselineSummary>,
    pub total_solve_seconds: f64,
    pub total_baseline_seconds: f64,
}

/// One baseline across rows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BaselineSummary {
    pub name: String,
    /// How many graphs have this baseline.
    pub graphs: usize,
    pub geomean_ratio_to_lower_bound: Option<f64>,
}

/// Names of every baseline in `rows`, in first-seen order.
pub fn baseline_names(rows: &[Row]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for r in rows {
        for b in &r.baselines {
            if !names.contains(&b.name) {
                names.push(b.name.clone());
            }
        }
    }
    names
}

/// Summarises `rows`.
pub fn summarize(rows: &[Row]) -> Summary {
    let baselines = baseline_names(rows)
        .into_iter()
        .map(|name| {
            let ratios: Vec<f64> = rows
                .iter()
                .filter_map(|r| r.baseline(&name).map(|p| ratio(p, r.lower_bound_bytes)))
                .collect();
            BaselineSummary {
                graphs: ratios.len(),
                geomean_ratio_to_lower_bound: geomean(ratios),
                name,
            }
        })
        .collect();
    Summary {
        graphs: rows.len(),
        geomean_ratio_to_lower_bound: geomean(rows.iter().map(Row::ratio_to_lower_bound)),
        geomean_ratio_to_best_baseline: geomean(
            rows.iter().filter_map(Row::ratio_to_best_baseline),
        ),
        geomean_ratio_to_best_eager: geomean(rows.iter().filter_map(Row::ratio_to_best_eager)),
        baselines,
        total_solve_seconds: rows.iter().map(|r| r.solve_seconds).sum(),
        total_baseline_seconds: rows.iter().map(|r| r.baseline_seconds).sum(),
    }
}

// ---------------------------------------------------------------------------
// The peak record.

/// `format` of a peak record file.
pub const RECORD_FORMAT: &str = "memplan-peaks";
/// `version` of a peak record file this memplan reads and writes.
pub const RECORD_VERSION: u64 = 1;

/// The peak record: memplan's arena and the lower bound per graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakRecord {
    pub format: String,
    pub version: u64,
    /// A line for people who open the file.
    #[serde(default)]
    pub note: String,
    pub entries: Vec<PeakEntry>,
}

/// One recorded graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeakEntry {
    /// `example:...`, or a graph file's path relative to the record's
    /// folder (so the record works in any checkout).
    pub source: String,
    /// The graph's name.
    pub graph: String,
    /// The graph's fingerprint: when any of these change, the graph itself
    /// changed and its figures are not comparable.
    pub ops: usize,
    pub tensors: usize,
    pub total_bytes: u64,
    /// memplan's arena: must not grow (`peak_bytes` in records written
    /// before it had its name).
    #[serde(alias = "peak_bytes")]
    pub arena_bytes: u64,
    /// The lower bound: must not shrink.
    pub lower_bound_bytes: u64,
    pub lower_bound_kind: String,
    /// Informational: the most bytes live at once in memplan's order.
    pub max_live_bytes: u64,
    /// The planner's time budget the figures were made with.
    pub time_limit_seconds: f64,
}

const RECORD_NOTE: &str = "memplan's arena and lower bound per graph; tests/peaks.rs fails when an arena grows or a bound shrinks. Rewrite with: memplan bench --update fixtures/peaks.json";

impl Default for PeakRecord {
    fn default() -> Self {
        PeakRecord {
            format: RECORD_FORMAT.into(),
            version: RECORD_VERSION,
            note: RECORD_NOTE.into(),
            entries: Vec::new(),
        }
    }
}

impl PeakRecord {
    /// Reads a record file.
    pub fn read(path: &Path) -> Result<PeakRecord, Error> {
        let text = crate::io::read_text(path)?;
        let rec: PeakRecord = serde_json::from_str(&text).map_err(|e| Error::Parse {
            path: path.to_path_buf(),
            line: e.line(),
            column: e.column(),
            msg: e.to_string(),
        })?;
        let bad = |msg: String| Error::Parse {
            path: path.to_path_buf(),
            line: 0,
            column: 0,
            msg,
        };
        if rec.format != RECORD_FORMAT {
            return Err(bad(format!(
                "format is {:?}, expected {RECORD_FORMAT:?}",
                rec.format
            )));
        }
        if rec.version != RECORD_VERSION {
            return Err(bad(format!(
                "unsupported version {} (this memplan reads version {RECORD_VERSION})",
                rec.version
            )));
        }
        let mut seen = std::collections::HashSet::new();
        for e in &rec.entries {
            if !seen.insert(e.source.as_str()) {
                return Err(bad(format!("source {:?} is recorded twice", e.source)));
            }
            if !(e.time_limit_seconds.is_finite() && e.time_limit_seconds >= 0.0) {
                return Err(bad(format!(
                    "{:?}: time_limit_seconds must be a non-negative number",
                    e.source
                )));
            }
        }
        Ok(rec)
    }

    /// Writes the record, entries sorted by source.
    pub fn write(&self, path: &Path) -> Result<(), Error> {
        let mut rec = self.clone();
        rec.entries.sort_by(|a, b| a.source.cmp(&b.source));
        let mut text = serde_json::to_string_pretty(&rec).expect("a record serializes");
        text.push('\n');
        std::fs::write(path, text).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The entry for `source`.
    pub fn entry(&self, source: &str) -> Option<&PeakEntry> {
        self.entries.iter().find(|e| e.source == source)
    }

    /// Puts fresh figures into the record, entry by entry. A figure that is
    /// worse than recorded (arena larger, bound smaller) or a graph whose
    /// fingerprint changed is refused unless `accept_worse`; the refused
    /// verdicts come back and the record is left unchanged for them.
    pub fn merge(&mut self, fresh: Vec<PeakEntry>, accept_worse: bool) -> Vec<Verdict> {
        let mut refused = Vec::new();
        for new in fresh {
            match self.entries.iter_mut().find(|e| e.source == new.source) {
                None => self.entries.push(new),
                Some(old) => {
                    let v = compare(old, &new);
                    if v.is_failure() && !accept_worse {
                        refused.push(v);
                    } else {
                        *old = new;
                    }
                }
            }
        }
        refused
    }
}

impl PeakEntry {
    /// The entry for a benchmarked row; `source` as it should be recorded.
    pub fn from_row(row: &Row, source: String) -> PeakEntry {
        PeakEntry {
            source,
            graph: row.graph.clone(),
            ops: row.ops,
            tensors: row.tensors,
            total_bytes: row.total_bytes,
            arena_bytes: row.arena_bytes,
            lower_bound_bytes: row.lower_bound_bytes,
            lower_bound_kind: row.lower_bound_kind.clone(),
            max_live_bytes: row.max_live_bytes,
            time_limit_seconds: row.time_limit_seconds,
        }
    }

    fn fingerprint(&self) -> (usize, usize, u64) {
        (self.ops, self.tensors, self.total_bytes)
    }
}

/// How fresh figures compare with the recorded ones.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Peak and bound as recorded.
    Same { source: String },
    /// The arena shrank or the bound grew (or both), nothing got worse: the
    /// record can be tightened with `memplan bench --update`.
    Improved { old: PeakEntry, new: PeakEntry },
    /// The arena grew or the bound shrank.
    Regressed { old: PeakEntry, new: PeakEntry },
    /// The graph is not the one recorded (ops, tensors or bytes differ).
    GraphChanged { old: PeakEntry, new: PeakEntry },
}

impl Verdict {
    /// Whether this verdict should fail a regression check.
    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            Verdict::Regressed { .. } | Verdict::GraphChanged { .. }
        )
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = |old: u64, new: u64| {
            format!(
                "{old} -> {new} bytes ({:+} bytes)",
                new as i128 - old as i128
            )
        };
        match self {
            Verdict::Same { source } => write!(f, "{source}: as recorded"),
            Verdict::Improved { old, new } | Verdict::Regressed { old, new } => {
                let word = if self.is_failure() {
                    "REGRESSED"
                } else {
                    "improved"
                };
                write!(
                    f,
                    "{}: {word}: arena {}, lower bound {}",
                    old.source,
                    d(old.arena_bytes, new.arena_bytes),
                    d(old.lower_bound_bytes, new.lower_bound_bytes)
                )?;
                if old.lower_bound_kind != new.lower_bound_kind {
                    write!(f, " ({} -> {})", old.lower_bound_kind, new.lower_bound_kind)?;
                }
                Ok(())
            }
            Verdict::GraphChanged { old, new } => write!(
                f,
                "{}: the graph changed (ops {} -> {}, tensors {} -> {}, bytes {} -> {}); its figures are not comparable: re-record it with memplan bench --update ... --accept-worse",
                old.source,
                old.ops,
                new.ops,
                old.tensors,
                new.tensors,
                old.total_bytes,
                new.total_bytes
            ),
        }
    }
}

/// Compares fresh figures with recorded ones for the same source.
pub fn compare(old: &PeakEntry, new: &PeakEntry) -> Verdict {
    let (old, new) = (old.clone(), new.clone());
    if old.fingerprint() != new.fingerprint() {
        Verdict::GraphChanged { old, new }
    } else if new.arena_bytes > old.arena_bytes || new.lower_bound_bytes < old.lower_bound_bytes {
        Verdict::Regressed { old, new }
    } else if new.arena_bytes < old.arena_bytes || new.lower_bound_bytes > old.lower_bound_bytes {
        Verdict::Improved { old, new }
    } else {
        Verdict::Same { source: old.source }
    }
}

/// Resolves a recorded source against the record's folder.
pub fn recorded_source(source: &str, record_dir: &Path) -> Result<Source, Error> {
    if source.starts_with(EXAMPLE_PREFIX) {
        Source::parse(source)
    } else {
        Ok(Source::File(record_dir.join(source)))
    }
}

/// How `source` is written in a record kept in `record_dir`: example specs
/// as they are, files relative to the record's folder. A file outside that
/// folder cannot be recorded (the record would only work on this machine).
pub fn record_source(source: &Source, record_dir: &Path) -> Result<String, Error> {
    let Source::File(p) = source else {
        return Ok(source.label());
    };
    let canon = |q: &Path| {
        q.canonicalize().map_err(|e| Error::Io {
            path: q.to_path_buf(),
            source: e,
        })
    };
    let (file, dir) = (canon(p)?, canon(record_dir)?);
    let rel = file.strip_prefix(&dir).map_err(|_| {
        Error::InvalidArgument(format!(
            "{}: a recorded graph file must lie under the record's folder {} (copy it there first)",
            p.display(),
            record_dir.display()
        ))
    })?;
    Ok(rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/"))
}

/// Re-plans one recorded graph with the recorded time budget; returns the
/// fresh figures (no baselines are computed).
pub fn replan(entry: &PeakEntry, record_dir: &Path) -> Result<PeakEntry, Error> {
    let src = recorded_source(&entry.source, record_dir)?;
    let g = src.load()?;
    let opts = Options {
        time_limit: Duration::from_secs_f64(entry.time_limit_seconds),
        ..Options::default()
    };
    let plan = crate::plan(&g, &opts)?;
    crate::checker::check(&g, &plan)?;
    Ok(PeakEntry {
        source: entry.source.clone(),
        graph: g.name.clone(),
        ops: g.num_ops(),
        tensors: g.num_tensors(),
        total_bytes: g.total_bytes(),
        arena_bytes: plan.arena_bytes,
        lower_bound_bytes: plan.stats.lower_bound_bytes,
        lower_bound_kind: plan.stats.lower_bound_kind.clone(),
        max_live_bytes: plan.stats.max_live_bytes,
        time_limit_seconds: entry.time_limit_seconds,
    })
}

/// Re-plans every graph in the record at `path` and compares. A graph
/// whose bound only fell back to the solver's part bound because the
/// clock ran out ([`bound_fell_back`]) is re-planned once more before its
/// verdict counts.
pub fn check_record(path: &Path) -> Result<Vec<Verdict>, Error> {
    let rec = PeakRecord::read(path)?;
    let dir = record_dir(path);
    rec.entries
        .iter()
        .map(|e| {
            let v = compare(e, &replan(e, &dir)?);
            if bound_fell_back(&v) {
                return Ok(compare(e, &replan(e, &dir)?));
            }
            Ok(v)
        })
        .collect()
}

/// Whether a regression is only the lower bound, fallen back to the
/// solver's part bound: past the deadline the pipeline skips the min-cut
/// floor ([`crate::pipeline`]), so a plan whose work-bounded layout ends
/// after the deadline on a loaded machine reports the weaker bound though
/// nothing in the planner changed. The arena must be as recorded or better.
pub fn bound_fell_back(v: &Verdict) -> bool {
    matches!(v, Verdict::Regressed { old, new }
        if new.arena_bytes <= old.arena_bytes
            && new.lower_bound_kind == "part-bound"
            && old.lower_bound_kind != "part-bound")
}

/// The folder recorded file paths are relative to.
pub fn record_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_specs_take_fsdp_and_precision_keys() {
        let spec = "example:llama-tiny,world=2,prefetch=2,noreshard,reduce=bf16,mixed";
        let Source::Example {
            opts, transforms, ..
        } = Source::parse(spec).unwrap()
        else {
            panic!("an example");
        };
        let fsdp = &transforms.fsdp;
        assert!(opts.mixed_precision);
        assert_eq!(fsdp.world, 2);
        assert_eq!(fsdp.prefetch, 2);
        assert!(!fsdp.reshard_after_forward && fsdp.reduce_in_compute_dtype);
        let g = Source::parse(spec).unwrap().load().unwrap();
        assert_eq!(g.name, "llama-tiny-b2-mixed-fsdp2");
        // split=K is the CLI's --split K: the same graph.
        let split = Source::parse("example:llama-tiny,split=4")
            .unwrap()
            .load()
            .unwrap();
        let unsplit = crate::models::example("llama-tiny", &ExampleOptions::default()).unwrap();
        let by_hand = crate::split::split_graph(&unsplit, 4).unwrap();
        assert_eq!(split.ops().len(), by_hand.ops().len());
        assert!(split.ops().len() > unsplit.ops().len());
        // Both: sharded, then split (the CLI's --world-size 2 --split 4).
        let both = Source::parse("example:llama-tiny,split=4,world=2")
            .unwrap()
            .load()
            .unwrap();
        let mut fsdp = crate::models::fsdp::FsdpOptions::new(2);
        fsdp.prefetch = 1;
        let sharded = crate::transforms::Transforms {
            split_chunks: None,
            fsdp,
        }
        .apply(unsplit.clone())
        .unwrap();
        let by_hand = crate::split::split_graph(&sharded, 4).unwrap();
        assert_eq!(both.ops().len(), by_hand.ops().len());
        assert!(both.ops().len() > sharded.ops().len());
        let e = Source::parse("example:llama-tiny,reduce=f16")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown option"), "{e}");
    }

    #[test]
    fn parses_sources() {
        assert!(
            matches!(Source::parse("graphs/a.json").unwrap(), Source::File(p) if p == Path::new("graphs/a.json"))
        );
        let Source::Example {
            name, opts, spec, ..
        } = Source::parse("example:gpt2-small,batch=4,checkpoint,dtype=bf16").unwrap()
        else {
            panic!("not an example");
        };
        assert_eq!(name, "gpt2-small");
        assert_eq!(spec, "example:gpt2-small,batch=4,checkpoint,dtype=bf16");
        assert_eq!(opts.batch, Some(4));
        assert!(opts.checkpoint);
        assert_eq!(opts.dtype, Some(crate::models::DType::BF16));
        for bad in [
            "example:gpt9",
            "example:gpt2-tiny,batch=0",
            "example:gpt2-tiny,batch",
            "example:gpt2-tiny,colour=red",
            "example:gpt2-tiny,dtype=f8",
        ] {
            let e = Source::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn summary_uses_geometric_means() {
        assert!((geomean([2.0, 8.0]).unwrap() - 4.0).abs() < 1e-12);
        assert_eq!(geomean([]), None);
        let g = crate::models::example("mlp", &ExampleOptions::default()).unwrap();
        let row = run(&g, "example:mlp", &Options::default()).unwrap();
        assert!(row.lower_bound_bytes <= row.max_live_bytes);
        assert!(row.max_live_bytes <= row.arena_bytes);
        // Never worse than the program-order arena.
        assert!(row.arena_bytes <= row.baseline("program-order+greedy").unwrap());
        let mut other = row.clone();
        other.arena_bytes = row.arena_bytes * 4;
        let s = summarize(&[row.clone(), other]);
        assert_eq!(s.graphs, 2);
        let expect = (row.ratio_to_lower_bound() * row.ratio_to_lower_bound() * 4.0).sqrt();
        assert!((s.geomean_ratio_to_lower_bound.unwrap() - expect).abs() < 1e-9);
        assert_eq!(s.baselines.len(), row.baselines.len());
        assert!(s.baselines.iter().all(|b| b.graphs == 2));
    }

    fn entry(peak: u64, bound: u64) -> PeakEntry {
        PeakEntry {
            source: "example:mlp".into(),
            graph: "mlp".into(),
            ops: 10,
            tensors: 20,
            total_bytes: 1000,
            arena_bytes: peak,
            lower_bound_bytes: bound,
            lower_bound_kind: "op-footprint".into(),
            max_live_bytes: peak,
            time_limit_seconds: 1.0,
        }
    }

    #[test]
    fn verdicts_have_no_tolerance() {
        let old = entry(500, 400);
        assert!(matches!(
            compare(&old, &entry(500, 400)),
            Verdict::Same { .. }
        ));
        assert!(matches!(
            compare(&old, &entry(499, 400)),
            Verdict::Improved { .. }
        ));
        assert!(matches!(
            compare(&old, &entry(500, 401)),
            Verdict::Improved { .. }
        ));
        assert!(compare(&old, &entry(501, 400)).is_failure());
        assert!(compare(&old, &entry(500, 399)).is_failure());
        // Better arena but worse bound is still a regression.
        assert!(compare(&old, &entry(450, 399)).is_failure());
        let mut changed = entry(400, 300);
        changed.ops += 1;
        let v = compare(&old, &changed);
        assert!(matches!(v, Verdict::GraphChanged { .. }));
        assert!(v.to_string().contains("graph changed"));
    }

    #[test]
    fn a_bound_fallen_back_at_the_deadline_is_told_apart() {
        let mut old = entry(500, 400);
        old.lower_bound_kind = "min-cut".into();
        let mut fell = entry(500, 390);
        fell.lower_bound_kind = "part-bound".into();
        let v = compare(&old, &fell);
        assert!(v.is_failure() && bound_fell_back(&v), "{v}");
        assert!(v.to_string().contains("(min-cut -> part-bound)"), "{v}");
        // A worse arena, or a weaker bound of the same kind, is a regression.
        let mut worse = fell.clone();
        worse.arena_bytes = 501;
        assert!(!bound_fell_back(&compare(&old, &worse)));
        let mut same_kind = entry(500, 390);
        same_kind.lower_bound_kind = "min-cut".into();
        assert!(!bound_fell_back(&compare(&old, &same_kind)));
        assert!(!bound_fell_back(&compare(&old, &old)));
    }

    #[test]
    fn merge_refuses_worse_figures_unless_asked() {
        let mut rec = PeakRecord {
            entries: vec![entry(500, 400)],
            ..Default::default()
        };
        let refused = rec.merge(vec![entry(600, 400)], false);
        assert_eq!(refused.len(), 1);
        assert_eq!(rec.entries[0].arena_bytes, 500);
        assert!(rec.merge(vec![entry(450, 410)], false).is_empty());
        assert_eq!(rec.entries[0].arena_bytes, 450);
        assert!(rec.merge(vec![entry(600, 400)], true).is_empty());
        assert_eq!(rec.entries[0].arena_bytes, 600);
        let mut other = entry(1, 1);
        other.source = "example:gpt2-tiny".into();
        rec.merge(vec![other], false);
        assert_eq!(rec.entries.len(), 2);
    }

    #[test]
    fn record_round_trips_and_detects_a_regression() {
        let dir = std::env::temp_dir().join(format!("memplan-peaks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let g = crate::models::example("mlp", &ExampleOptions::default()).unwrap();
        let row = run(&g, "example:mlp", &Options::default()).unwrap();
        let mut rec = PeakRecord::default();
        rec.entries
            .push(PeakEntry::from_row(&row, "example:mlp".into()));
        let path = dir.join("peaks.json");
        rec.write(&path).unwrap();
        assert_eq!(PeakRecord::read(&path).unwrap(), rec);
        let v = check_record(&path).unwrap();
        assert!(matches!(v[..], [Verdict::Same { .. }]), "{v:?}");
        // A record claiming a smaller arena than memplan reaches must fail.
        rec.entries[0].arena_bytes -= 1;
        rec.write(&path).unwrap();
        let v = check_record(&path).unwrap();
        assert!(v[0].is_failure(), "{v:?}");
        // Files outside the record's folder cannot be recorded.
        let outside =
            std::env::temp_dir().join(format!("memplan-outside-{}.json", std::process::id()));
        std::fs::write(&outside, "{}").unwrap();
        let e = record_source(&Source::File(outside.clone()), &dir).unwrap_err();
        assert!(e.to_string().contains("must lie under"), "{e}");
        let inside = dir.join("sub");
        std::fs::create_dir_all(&inside).unwrap();
        std::fs::write(inside.join("g.json"), "{}").unwrap();
        assert_eq!(
            record_source(&Source::File(inside.join("g.json")), &dir).unwrap(),
            "sub/g.json"
        );
        std::fs::remove_file(outside).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_records_are_refused_with_the_file_named() {
        let dir = std::env::temp_dir().join(format!("memplan-badpeaks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("peaks.json");
        std::fs::write(
            &path,
            "{\"format\": \"memplan-peaks\", \"version\": 9, \"entries\": []}",
        )
        .unwrap();
        let e = PeakRecord::read(&path).unwrap_err().to_string();
        assert!(e.contains("peaks.json") && e.contains("version 9"), "{e}");
        std::fs::write(&path, "{\"format\": \"memplan-peaks\"").unwrap();
        let e = PeakRecord::read(&path).unwrap_err().to_string();
        assert!(e.contains("peaks.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
