//! A plan's JSON form (`memplan-plan`, version 1; docs/plan-format.md):
//! [`Plan::to_json`] and [`Plan::from_json`], ops and tensors named by id.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, PlanFormatError};
use crate::graph::{Graph, TensorId};
use crate::io::json::ReuseRecord;
use crate::plan::{Plan, PlanStats};

pub const PLAN_FORMAT: &str = "memplan-plan";
pub const PLAN_VERSION: u64 = 1;

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
    pub reuse: Vec<ReuseRecord>,
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
                .map(|&(o, i)| ReuseRecord {
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
}
