//! A plan: the order ops run in, every tensor's offset in one arena, and the
//! reuses taken. Also its JSON form (`memplan-plan`, version 1).

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::error::{Error, PlanFormatError};
use crate::graph::{Graph, OpId, TensorId};

pub const PLAN_FORMAT: &str = "memplan-plan";
pub const PLAN_VERSION: u64 = 1;

/// A memory plan for one graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Every op once, in the order they run.
    pub order: Vec<OpId>,
    /// Offset of every tensor that occupies memory; `None` for views and
    /// zero-sized tensors.
    pub offsets: Vec<Option<u64>>,
    /// Bytes of the one arena every tensor lives in.
    pub arena_bytes: u64,
    /// Taken reuses: `(output, input)`, the output lives in the input's bytes.
    /// `input` is a tensor that occupies memory (a root).
    pub reuses: Vec<(TensorId, TensorId)>,
    /// How the plan was made and how good it is.
    pub stats: PlanStats,
}

/// Figures that describe a plan. All byte counts include every tensor in the
/// arena (parameters and optimizer state too).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanStats {
    /// The arena size: what the step needs.
    pub peak_bytes: u64,
    /// The most bytes live at once in this order (the best any layout of
    /// this order can do).
    pub max_live_bytes: u64,
    /// A lower bound over every valid order (the min-cut floor when
    /// computed, else the simple bound).
    pub lower_bound_bytes: u64,
    /// Which bound `lower_bound_bytes` is.
    #[serde(default)]
    pub lower_bound_kind: String,
    /// The simple bound over every valid order (bytes made live by
    /// ancestry alone), never above `lower_bound_bytes`; kept to show how
    /// much the min-cut floor adds. When the time limit left no time for
    /// it, the solver's part bound stands in (`lower_bound_kind`
    /// `part-bound`, `time_limit_hit`).
    #[serde(default)]
    pub simple_bound_bytes: u64,
    /// Seconds spent computing the bounds (part of `solve_seconds`).
    #[serde(default)]
    pub bound_seconds: f64,
    /// Seconds spent planning.
    pub solve_seconds: f64,
    /// Which algorithm produced the order.
    #[serde(default)]
    pub order_source: String,
    /// Which algorithm produced the layout.
    #[serde(default)]
    pub layout_source: String,
    /// The time limit cut the planning short (a search, heuristics, a
    /// layout or the bound stopped at it): the plan is the best found by
    /// then, valid and checked like any other. Written only when true.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub time_limit_hit: bool,
}

impl PlanStats {
    /// `peak / lower bound - 1`: how far the plan may be from optimal.
    pub fn gap(&self) -> f64 {
        if self.lower_bound_bytes == 0 {
            0.0
        } else {
            self.peak_bytes as f64 / self.lower_bound_bytes as f64 - 1.0
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    pub format: String,
    pub version: u64,
    #[serde(default)]
    pub graph: String,
    pub arena_bytes: u64,
    pub order: Vec<String>,
    pub tensors: Vec<OffsetRecord>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reuse: Vec<crate::io::json::ReuseRecord>,
    #[serde(default)]
    pub stats: PlanStats,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OffsetRecord {
    pub id: String,
    pub offset: u64,
}

impl Plan {
    /// The file form, naming ops and tensors by id.
    pub fn to_file(&self, g: &Graph) -> PlanFile {
        PlanFile {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            graph: g.name.clone(),
            arena_bytes: self.arena_bytes,
            order: self.order.iter().map(|&o| g.op(o).name.clone()).collect(),
            tensors: self
                .offsets
                .iter()
                .enumerate()
                .filter_map(|(i, o)| {
                    o.map(|offset| OffsetRecord {
                        id: g.tensor(TensorId(i as u32)).name.clone(),
                        offset,
                    })
                })
                .collect(),
            reuse: self
                .reuses
                .iter()
                .map(|&(o, i)| crate::io::json::ReuseRecord {
                    output: g.tensor(o).name.clone(),
                    input: g.tensor(i).name.clone(),
                })
                .collect(),
            stats: self.stats.clone(),
        }
    }

    /// JSON text of the plan.
    pub fn to_json(&self, g: &Graph) -> String {
        serde_json::to_string_pretty(&self.to_file(g)).expect("plan serializes")
    }

    /// Reads a plan's JSON text against its graph. Only the form is checked
    /// here (known ids, no duplicates); [`crate::checker::check`] judges the
    /// plan itself.
    pub fn from_json(text: &str, g: &Graph, path: &std::path::Path) -> Result<Plan, Error> {
        let file: PlanFile = serde_json::from_str(text).map_err(|e| Error::Parse {
            path: path.to_path_buf(),
            line: e.line(),
            column: e.column(),
            msg: e.to_string(),
        })?;
        Plan::from_file(file, g).map_err(|source| Error::PlanFormat {
            path: Some(path.to_path_buf()),
            source,
        })
    }

    pub fn from_file(file: PlanFile, g: &Graph) -> Result<Plan, PlanFormatError> {
        if file.format != PLAN_FORMAT {
            return Err(PlanFormatError::WrongFormat {
                found: file.format,
                expected: PLAN_FORMAT.into(),
            });
        }
        if file.version != PLAN_VERSION {
            return Err(PlanFormatError::UnsupportedVersion {
                found: file.version,
                supported: PLAN_VERSION,
            });
        }
        let order = file
            .order
            .iter()
            .map(|n| {
                g.op_by_name(n)
                    .ok_or_else(|| PlanFormatError::UnknownOp(n.clone()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut offsets = vec![None; g.num_tensors()];
        let mut seen = HashSet::new();
        for r in &file.tensors {
            let t = g
                .tensor_by_name(&r.id)
                .ok_or_else(|| PlanFormatError::UnknownTensor(r.id.clone()))?;
            if !seen.insert(t) {
                return Err(PlanFormatError::DuplicateTensor(r.id.clone()));
            }
            offsets[t.index()] = Some(r.offset);
        }
        let find = |n: &str| {
            g.tensor_by_name(n)
                .ok_or_else(|| PlanFormatError::UnknownReuseTensor(n.to_string()))
        };
        let reuses = file
            .reuse
            .iter()
            .map(|r| Ok((find(&r.output)?, find(&r.input)?)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Plan {
            order,
            offsets,
            arena_bytes: file.arena_bytes,
            reuses,
            stats: file.stats,
        })
    }

    /// The step of every op in this plan's order.
    pub fn steps(&self, g: &Graph) -> Vec<usize> {
        let mut pos = vec![usize::MAX; g.num_ops()];
        for (i, &o) in self.order.iter().enumerate() {
            if o.index() < pos.len() {
                pos[o.index()] = i;
            }
        }
        pos
    }

    /// Map from reused input to the output that took its bytes.
    pub fn reuse_map(&self) -> HashMap<TensorId, TensorId> {
        self.reuses.iter().map(|&(o, i)| (i, o)).collect()
    }
}
