//! A step at other batch sizes, and the largest batch that fits a budget.
//!
//! # Two captures make a line ([`BatchLine`])
//! A training step captured at batch `b1` and again at `b2` runs the same
//! ops over the same tensors; only sizes differ. Activations grow with the
//! batch, parameters, gradients and optimizer state do not, and almost
//! every size in a step is affine in the batch, `a·b + c`: activations
//! `[B, T, C]`, attention scores `[B, H, T, T]`, flattened `[B·T, C]`,
//! a loss's scalar. So two captures fix the step at every batch.
//! [`BatchLine::new`] checks that the two graphs have the same structure
//! (names, roles, producers, views, every op's reads and writes) and
//! [`BatchLine::at`] extrapolates sizes, shapes, FLOPs, costs and numeric
//! attributes (a matmul's `m`, an attention's `batch`) along the line.
//!
//! A size that shrinks as the batch grows, or grows by a fraction of a
//! byte per sample, is an error that names the tensor: such a step is not
//! linear in the batch (batch-dependent padding, a bucketed kernel), and an
//! extrapolation would be a guess. Shapes and attributes that do not fit a
//! whole-number line keep the first capture's value; they are
//! informational for planning (an executor needs a real capture).
//!
//! # The search ([`max_batch`])
//! The largest batch whose step fits a budget, three ways: PyTorch eager
//! in its best configuration at each batch (the least of the caching
//! allocator's simulated reserved bytes, with and without expandable
//! segments and the optimizer in the backward:
//! [`crate::baselines::eager_configurations`]; its default configuration
//! alone is a secondary figure), memplan's plan without recomputation, and
//! [`crate::fit::fit`] with recomputation. Each is a
//! doubling search followed by bisection, which assumes that a batch fits
//! when a larger one does (memory grows with the batch; the planners are
//! heuristics, so a rare non-monotone probe can make the answer one batch
//! short, never one that does not fit: every answer was itself probed).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::time::Duration;

use serde_json::Value;

use crate::baselines::{self, Baseline};
use crate::error::Error;
use crate::fit::{FitOptions, fit};
use crate::graph::{Graph, OpId};
use crate::pipeline::Options;

/// `base + per · batch`, in whole units.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct Affine {
    base: i128,
    per: i128,
}

impl Affine {
    /// The line through `(b1, y1)` and `(b2, y2)`, if its slope is whole.
    fn through(b1: u64, y1: u64, b2: u64, y2: u64) -> Option<Affine> {
        let db = b2 as i128 - b1 as i128;
        let dy = y2 as i128 - y1 as i128;
        if db == 0 || dy % db != 0 {
            return None;
        }
        let per = dy / db;
        let base = (y1 as i128).checked_sub(per.checked_mul(b1 as i128)?)?;
        Some(Affine { base, per })
    }

    /// The line at `batch`; `None` where it leaves `i128` (a slope near
    /// 2^64 bytes per sample at a batch near 2^64).
    fn at(self, batch: u64) -> Option<i128> {
        self.per.checked_mul(batch as i128)?.checked_add(self.base)
    }
}

/// One step captured at two batch sizes: the step at any batch (see the
/// module docs).
#[derive(Clone, Debug)]
pub struct BatchLine {
    first: Graph,
    second: Graph,
    batches: (u64, u64),
    sizes: Vec<Affine>,
}

/// The batch size a graph records in its metadata (`"batch"`), if any.
pub fn recorded_batch(g: &Graph) -> Option<u64> {
    g.metadata.get("batch").and_then(Value::as_u64)
}

fn differ(b: (u64, u64), what: String) -> Error {
    Error::Unsupported(format!(
        "the steps captured at batch {} and {} differ: {what}",
        b.0, b.1
    ))
}

impl BatchLine {
    /// The line through `first` (captured at batch `b1`) and `second` (at
    /// `b2`); an error names the first element where the two steps differ
    /// in structure or where a size is not affine in the batch.
    pub fn new(first: Graph, b1: u64, second: Graph, b2: u64) -> Result<BatchLine, Error> {
        let batches = (b1, b2);
        if b1 == b2 || b1 == 0 || b2 == 0 {
            return Err(Error::InvalidArgument(format!(
                "extrapolating over the batch needs two different positive batch sizes, got {b1} and {b2}"
            )));
        }
        same_structure(&first, &second, batches)?;
        let mut sizes = Vec::with_capacity(first.num_tensors());
        for t in first.tensor_ids() {
            let (x, y) = (first.tensor(t), second.tensor(t));
            let line = Affine::through(b1, x.size, b2, y.size)
                .filter(|l| l.per >= 0)
                .ok_or_else(|| {
                    differ(
                        batches,
                        format!(
                            "tensor {:?} has {} bytes at batch {b1} and {} at batch {b2}, which is not a size that grows by whole bytes per sample",
                            x.name, x.size, y.size
                        ),
                    )
                })?;
            sizes.push(line);
        }
        Ok(BatchLine {
            first,
            second,
            batches,
            sizes,
        })
    }

    /// The two batch sizes the line was made from.
    pub fn batches(&self) -> (u64, u64) {
        self.batches
    }

    /// The step at `batch`.
    pub fn at(&self, batch: u64) -> Result<Graph, Error> {
        let (b1, b2) = self.batches;
        let (g1, g2) = (&self.first, &self.second);
        let mut b = g1.to_builder();
        for t in g1.tensor_ids() {
            let size = self.sizes[t.index()].at(batch);
            let size = size.and_then(|s| u64::try_from(s).ok()).ok_or_else(|| {
                let bytes = size.map_or("more than 2^127".to_string(), |s| s.to_string());
                Error::Unsupported(format!(
                    "tensor {:?} would have {bytes} bytes at batch {batch} (extrapolated from batch {b1} and {b2})",
                    g1.tensor(t).name
                ))
            })?;
            let spec = b.tensor_spec_mut(t);
            spec.size = size;
            spec.shape = match (&g1.tensor(t).shape, &g2.tensor(t).shape) {
                (Some(s1), Some(s2)) => shape_at(s1, s2, self.batches, batch),
                _ => None,
            };
        }
        for o in g1.op_ids() {
            let (x, y) = (g1.op(o), g2.op(o));
            let spec = b.op_spec_mut(o);
            spec.cost = real_at(x.cost, y.cost, self.batches, batch);
            spec.flops = real_at(x.flops, y.flops, self.batches, batch);
            for (k, v) in spec.attrs.iter_mut() {
                if let Some(v2) = y.attrs.get(k) {
                    *v = value_at(v, v2, self.batches, batch);
                }
            }
        }
        let mut g = b.build()?;
        g.extra_orders = g1.extra_orders.clone();
        g.metadata = g1.metadata.clone();
        g.metadata.insert("batch".into(), batch.into());
        g.metadata
            .insert("extrapolated_from_batches".into(), vec![b1, b2].into());
        Ok(g)
    }
}

fn same_structure(g1: &Graph, g2: &Graph, b: (u64, u64)) -> Result<(), Error> {
    if g1.num_tensors() != g2.num_tensors() || g1.num_ops() != g2.num_ops() {
        let hint = if b.0.min(b.1) == 1 {
            " (frameworks can trace batch 1 differently, e.g. with squeezed dimensions: capture at two batch sizes above 1)"
        } else {
            ""
        };
        return Err(differ(
            b,
            format!(
                "{} tensors and {} ops against {} tensors and {} ops{hint}",
                g1.num_tensors(),
                g1.num_ops(),
                g2.num_tensors(),
                g2.num_ops()
            ),
        ));
    }
    for t in g1.tensor_ids() {
        let (x, y) = (g1.tensor(t), g2.tensor(t));
        let what = if x.name != y.name {
            Some("name")
        } else if x.role != y.role || x.lifetime != y.lifetime {
            Some("role or lifetime")
        } else if x.producer != y.producer || x.view_of != y.view_of {
            Some("producer or view base")
        } else if x.align != y.align || x.dtype != y.dtype {
            Some("alignment or dtype")
        } else {
            None
        };
        if let Some(w) = what {
            return Err(differ(
                b,
                format!(
                    "tensor {} ({:?} against {:?}): {w}",
                    t.index(),
                    x.name,
                    y.name
                ),
            ));
        }
    }
    for o in g1.op_ids() {
        if let Some(w) = op_difference(g1, g2, o) {
            return Err(differ(
                b,
                format!(
                    "op {} ({:?} against {:?}): {w}",
                    o.index(),
                    g1.op(o).name,
                    g2.op(o).name
                ),
            ));
        }
    }
    Ok(())
}

fn op_difference(g1: &Graph, g2: &Graph, o: OpId) -> Option<&'static str> {
    let (x, y) = (g1.op(o), g2.op(o));
    if x.name != y.name {
        Some("name")
    } else if x.kind != y.kind || x.op_type != y.op_type {
        Some("kind or type")
    } else if x.inputs != y.inputs || x.outputs != y.outputs {
        Some("inputs or outputs")
    } else if x.updates != y.updates || x.reuse != y.reuse {
        Some("in-place updates or reuse hints")
    } else if x.after != y.after || x.stream != y.stream {
        Some("control edges or stream")
    } else {
        None
    }
}

fn shape_at(s1: &[u64], s2: &[u64], b: (u64, u64), batch: u64) -> Option<Vec<u64>> {
    if s1.len() != s2.len() {
        return None;
    }
    s1.iter()
        .zip(s2)
        .map(|(&x, &y)| {
            let d = Affine::through(b.0, x, b.1, y)?.at(batch)?;
            u64::try_from(d).ok()
        })
        .collect()
}

fn real_at(x: Option<f64>, y: Option<f64>, b: (u64, u64), batch: u64) -> Option<f64> {
    let (x, y) = (x?, y?);
    let t = (batch as f64 - b.0 as f64) / (b.1 as f64 - b.0 as f64);
    Some((x + (y - x) * t).max(0.0))
}

/// A real attribute at `batch`: `1 / n` for a whole `n` on a whole-number
/// line (a mean's scale, `1 / (B·T)`), else linear.
fn float_at(x: Option<f64>, y: Option<f64>, b: (u64, u64), batch: u64) -> Option<f64> {
    let whole = |v: f64| {
        let n = (1.0 / v).round();
        (v > 0.0 && (1.0..1e15).contains(&n) && (n * v - 1.0).abs() < 1e-12).then_some(n as u64)
    };
    if let (Some(n1), Some(n2)) = (whole(x?), whole(y?))
        && let Some(n) = Affine::through(b.0, n1, b.1, n2).and_then(|l| l.at(batch))
        && n > 0
    {
        return Some(1.0 / n as f64);
    }
    real_at(x, y, b, batch)
}

/// An attribute at `batch`: whole numbers on a whole-number line, other
/// numbers as [`float_at`] says, arrays and objects element by element; anything else
/// (or a mismatch) keeps the first capture's value.
fn value_at(v1: &Value, v2: &Value, b: (u64, u64), batch: u64) -> Value {
    match (v1, v2) {
        (Value::Number(x), Value::Number(y)) if x == y => v1.clone(),
        (Value::Number(x), Value::Number(y)) => {
            if let (Some(x), Some(y)) = (x.as_u64(), y.as_u64()) {
                let at = Affine::through(b.0, x, b.1, y).and_then(|l| l.at(batch));
                match at.and_then(|a| u64::try_from(a).ok()) {
                    Some(a) => a.into(),
                    None => v1.clone(),
                }
            } else {
                float_at(x.as_f64(), y.as_f64(), b, batch).map_or(v1.clone(), Value::from)
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => Value::Array(
            x.iter()
                .zip(y)
                .map(|(p, q)| value_at(p, q, b, batch))
                .collect(),
        ),
        (Value::Object(x), Value::Object(y)) => Value::Object(
            x.iter()
                .map(|(k, p)| {
                    let q = y.get(k).map_or(p.clone(), |q| value_at(p, q, b, batch));
                    (k.clone(), q)
                })
                .collect(),
        ),
        _ => v1.clone(),
    }
}

/// The largest batch of one step that fits a budget, three ways (see the
/// module docs); `0` where not even batch 1 fits.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MaxBatch {
    pub budget_bytes: u64,
    /// PyTorch eager in its best configuration
    /// ([`crate::baselines::EAGER`]): the largest batch at which one of
    /// them fits.
    pub eager: u64,
    /// The eager configuration that needs the least at batch [`Self::eager`]
    /// (none when not even batch 1 fits).
    pub eager_configuration: Option<String>,
    /// PyTorch eager on its default caching allocator
    /// (`pytorch-reserved`).
    pub eager_default: u64,
    /// memplan's plan without recomputation.
    pub planned: u64,
    /// memplan with recomputation ([`crate::fit::fit`]).
    pub fitted: u64,
    /// The largest batch the search tried; an answer equal to it means
    /// "at least".
    pub cap: u64,
}

/// Which of the three ways a probe measures.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Way {
    Eager,
    EagerDefault,
    Planned,
    Fitted,
}

/// The largest batch up to `cap` whose step, made by `graph_at`, fits
/// `budget` each way. `opts` are the options of each fit probe (its
/// budget is replaced by `budget`); plans without recomputation get the
/// same time limit per probe.
pub fn max_batch(
    graph_at: &mut dyn FnMut(u64) -> Result<Graph, Error>,
    budget: u64,
    opts: &FitOptions,
    cap: u64,
) -> Result<MaxBatch, Error> {
    let fit_opts = FitOptions {
        budget,
        ..opts.clone()
    };
    let plan_opts = Options {
        time_limit: opts.time_limit.min(Duration::from_secs(5)),
        ..Options::default()
    };
    // Each batch's eager figures, shared by both eager ways.
    let mut eager_figures: HashMap<u64, Vec<Baseline>> = HashMap::new();
    let mut fits = |way: Way, batch: u64| -> Result<bool, Error> {
        Ok(match way {
            Way::Eager | Way::EagerDefault => {
                // A batch both eager searches probe is built and simulated once.
                let all = match eager_figures.entry(batch) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => {
                        e.insert(baselines::eager_configurations(&graph_at(batch)?))
                    }
                };
                let bytes = match way {
                    Way::Eager => baselines::best_eager(all),
                    _ => all.iter().find(|b| b.name == "pytorch-reserved"),
                };
                bytes.is_some_and(|b| b.footprint_bytes <= budget)
            }
            Way::Planned => crate::plan(&graph_at(batch)?, &plan_opts)?.arena_bytes <= budget,
            Way::Fitted => match fit(&graph_at(batch)?, &fit_opts) {
                Ok(_) => true,
                Err(Error::DoesNotFit(_)) => false,
                Err(e) => return Err(e),
            },
        })
    };
    let eager_default = largest(|b| fits(Way::EagerDefault, b), 0, cap)?;
    // A batch the default configuration fits, the best one fits.
    let eager = largest(|b| fits(Way::Eager, b), eager_default, cap)?;
    let planned = largest(|b| fits(Way::Planned, b), 0, cap)?;
    // A batch that fits without recomputation fits with it.
    let fitted = largest(|b| fits(Way::Fitted, b), planned, cap)?;
    // Every answer but 0 was probed.
    let eager_configuration = eager_figures
        .get(&eager)
        .and_then(|all| baselines::best_eager(all))
        .map(|b| b.name.clone());
    Ok(MaxBatch {
        budget_bytes: budget,
        eager,
        eager_configuration,
        eager_default,
        planned,
        fitted,
        cap,
    })
}

/// The largest batch in `known..=cap` that `fits`, given that `known`
/// fits (0: nothing known): doubling, then bisection.
fn largest(
    mut fits: impl FnMut(u64) -> Result<bool, Error>,
    known: u64,
    cap: u64,
) -> Result<u64, Error> {
    let mut lo = known.min(cap);
    let mut hi = lo.max(1);
    while hi <= cap && (hi == lo || fits(hi)?) {
        lo = hi;
        hi = hi.saturating_mul(2);
    }
    let mut hi = hi.min(cap + 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_finds_the_threshold_from_any_start() {
        for t in 0..70u64 {
            for known in [0, t / 2, t] {
                let mut calls = 0;
                let got = largest(
                    |b| {
                        calls += 1;
                        Ok(b <= t)
                    },
                    known,
                    64,
                )
                .unwrap();
                assert_eq!(got, t.min(64), "threshold {t}, known {known}");
                assert!(calls <= 16, "{calls} probes");
            }
        }
    }

    #[test]
    fn affine_lines_need_whole_slopes() {
        assert_eq!(
            Affine::through(1, 10, 3, 30),
            Some(Affine { base: 0, per: 10 })
        );
        assert_eq!(Affine::through(2, 10, 4, 11), None);
        assert_eq!(Affine::through(1, 7, 2, 7).unwrap().at(100), Some(7));
        // Lines that leave i128 are no lines, never an overflow.
        let steep = Affine::through(1, 0, 2, u64::MAX).unwrap();
        assert_eq!(steep.at(u64::MAX), None);
        assert_eq!(Affine::through(u64::MAX - 1, 0, u64::MAX, u64::MAX), None);
        assert_eq!(Affine::through(3, 1, 3, 2), None);
    }

    #[test]
    fn attributes_follow_their_line() {
        let v1: Value = serde_json::json!({"m": 128, "heads": 12, "eps": 1e-5, "dims": [2, 64],
            "mode": "a", "scale": 1.0 / 128.0, "lr": 0.5});
        let v2: Value = serde_json::json!({"m": 256, "heads": 12, "eps": 1e-5, "dims": [4, 64],
            "mode": "b", "scale": 1.0 / 256.0, "lr": 1.0});
        let at = value_at(&v1, &v2, (1, 2), 8);
        assert_eq!(
            at,
            serde_json::json!({"m": 1024, "heads": 12, "eps": 1e-5, "dims": [16, 64], "mode": "a",
                "scale": 1.0 / 1024.0, "lr": 4.0})
        );
    }
}
