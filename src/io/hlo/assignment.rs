//! XLA's buffer assignment, read back: where XLA put every value, and the
//! live bytes its own order and sharing decisions realise.
//!
//! XLA writes `<module>-buffer-assignment.txt` beside an optimized module
//! (`--xla_dump_to`). It lists allocations (`allocation N: size S, ...`) and
//! under each the values placed in it with their offsets:
//!
//! ```text
//! allocation 6: size 262144, parameter 5, shape |f32[128,512]| at ShapeIndex {}, maybe-live-out:
//!  value: <2951 params.1 @0> (size=262144,offset=0): f32[128,512]{1,0}
//!  value: <3137 multiply_add_fusion.70 @0> (size=262144,offset=0): f32[128,512]{1,0}
//! ```
//!
//! A value is named after the instruction that defines it, with its shape
//! index `{i,j}` when that instruction's shape is a tuple. Two values at the
//! same bytes of the same allocation that are live at once are one value
//! written in place: XLA shared the buffer.
//!
//! [`realised_peak`] replays the module's scheduled order (the graph's
//! `xla-order`) with each tensor's bytes where XLA put them, and counts at
//! every step the bytes covered by live values (overlapping ranges once).
//! That is the max live of XLA's order under XLA's own sharing decisions,
//! an order with sharing that XLA itself realises, so memplan's lower bound
//! (which must hold for every valid order) may never be above it; a test
//! checks that on every dump, so a sharing rule XLA has and memplan lacks
//! shows up as a bound above what XLA did.

use std::collections::HashMap;

use memplan_solver as solver;

use super::HloError;
use crate::error::Error;
use crate::graph::Graph;
use crate::lower::{self, Lowered};

/// One value of the buffer assignment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placed {
    pub allocation: u32,
    /// The defining instruction.
    pub instr: String,
    /// Its shape index (empty unless the instruction's shape is a tuple).
    pub index: Vec<u32>,
    pub size: u64,
    pub offset: u64,
}

/// Parses the values of a buffer-assignment dump.
pub fn parse(text: &str) -> Result<Vec<Placed>, HloError> {
    let mut out = Vec::new();
    let mut alloc: Option<u32> = None;
    for (k, line) in text.lines().enumerate() {
        let ln = k as u32 + 1;
        let err = |msg: &str| HloError::new(ln, 1, format!("buffer assignment: {msg}"));
        if let Some(rest) = line.strip_prefix("allocation ") {
            let n = rest.split(':').next().unwrap_or("");
            alloc = Some(n.trim().parse().map_err(|_| err("an allocation number"))?);
        } else if let Some(rest) = line.trim_start().strip_prefix("value: <") {
            let a = alloc.ok_or_else(|| err("a value before any allocation"))?;
            let (inner, tail) = rest
                .split_once('>')
                .ok_or_else(|| err("a value without its closing '>'"))?;
            let mut words = inner.split_whitespace();
            let _id = words.next();
            let name = words.next().ok_or_else(|| err("a value without a name"))?;
            let (instr, index) = match name.split_once('{') {
                Some((n, idx)) => (
                    n,
                    shape_index(idx.trim_end_matches('}')).ok_or_else(|| err("a shape index"))?,
                ),
                None => (name, Vec::new()),
            };
            let num = |key: &str| -> Option<u64> {
                let s = tail.split(key).nth(1)?;
                let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
                s[..end].parse().ok()
            };
            out.push(Placed {
                allocation: a,
                instr: instr.to_string(),
                index,
                size: num("size=").ok_or_else(|| err("a value without size="))?,
                offset: num("offset=").ok_or_else(|| err("a value without offset="))?,
            });
        }
    }
    Ok(out)
}

fn shape_index(s: &str) -> Option<Vec<u32>> {
    if s.trim().is_empty() {
        return Some(Vec::new());
    }
    s.split(',').map(|p| p.trim().parse().ok()).collect()
}

/// What [`realised_peak`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Realised {
    /// Max over XLA's order of the bytes covered by live values.
    pub peak: u64,
    /// Tensors of the graph that own bytes but have no value in the dump.
    pub unplaced: Vec<String>,
}

/// The max live bytes of the graph's `xla-order` with every tensor at the
/// bytes XLA assigned it (see the module docs). `None` without an
/// `xla-order` (the module was not scheduled).
pub fn realised_peak(g: &Graph, values: &[Placed]) -> Option<Realised> {
    let (_, order) = g.extra_orders.iter().find(|(n, _)| n == "xla-order")?;
    let low = lower::lower(g, true);
    let ev = solver::evaluate(&low.problem, &Lowered::from_op_ids(order));
    let at: HashMap<String, &Placed> = values
        .iter()
        .map(|v| (super::import::tensor_name(&v.instr, &v.index), v))
        .collect();
    let steps = order.len().max(1);
    let mut live: Vec<Vec<(u32, u64, u64)>> = vec![Vec::new(); steps];
    let mut unplaced = Vec::new();
    for (b, &t) in low.tensor_of_buf.iter().enumerate() {
        let tensor = g.tensor(t);
        let Some(v) = at.get(&tensor.name) else {
            if tensor.size > 0 {
                unplaced.push(tensor.name.clone());
            }
            continue;
        };
        let (from, to) = (ev.birth[b] as usize, ev.death[b] as usize);
        for s in live.iter_mut().take(to.min(steps - 1) + 1).skip(from) {
            s.push((v.allocation, v.offset, v.offset + v.size));
        }
    }
    let peak = live.iter_mut().map(|s| covered(s)).max().unwrap_or(0);
    Some(Realised { peak, unplaced })
}

/// Bytes covered by the ranges, overlaps once.
fn covered(ranges: &mut [(u32, u64, u64)]) -> u64 {
    ranges.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u32, u64, u64)> = None;
    for &(a, lo, hi) in ranges.iter() {
        match &mut cur {
            Some((ca, _, chi)) if *ca == a && lo <= *chi => *chi = (*chi).max(hi),
            _ => {
                if let Some((_, clo, chi)) = cur {
                    total += chi - clo;
                }
                cur = Some((a, lo, hi));
            }
        }
    }
    if let Some((_, clo, chi)) = cur {
        total += chi - clo;
    }
    total
}

/// Reads the buffer assignment beside an optimized module file
/// (`X.txt[.gz]` → `X-buffer-assignment.txt[.gz]`), if there is one.
pub fn find(module: &std::path::Path) -> Result<Option<Vec<Placed>>, Error> {
    let name = module.file_name().map(|n| n.to_string_lossy().to_string());
    let Some(name) = name else { return Ok(None) };
    let stem = name
        .strip_suffix(".txt.gz")
        .or_else(|| name.strip_suffix(".txt"))
        .unwrap_or(&name);
    for ext in [".txt", ".txt.gz"] {
        let p = module.with_file_name(format!("{stem}-buffer-assignment{ext}"));
        if p.is_file() {
            let text = crate::io::read_text(&p)?;
            let vals = parse(&text).map_err(|e| Error::from(e).in_file(&p))?;
            return Ok(Some(vals));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_values_with_their_allocation() {
        let text = "BufferAssignment:\n\
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:\n \
value: <1 p @0> (size=64,offset=0): f32[16]{0}\n\
allocation 3: size 128, preallocated-temp:\n \
value: <7 t{1,0} @0> (size=32,offset=64): f32[8]{0}\n";
        let v = parse(text).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(
            (v[0].allocation, v[0].instr.as_str(), v[0].size),
            (0, "p", 64)
        );
        assert_eq!(
            (v[1].allocation, v[1].index.clone(), v[1].offset),
            (3, vec![1, 0], 64)
        );
        assert!(parse(" value: <1 p @0> (size=4,offset=0): f32[]\n").is_err());
    }

    #[test]
    fn overlapping_ranges_count_once() {
        let mut r = vec![(0, 0, 10), (0, 5, 20), (1, 0, 10), (0, 30, 40)];
        assert_eq!(covered(&mut r), 20 + 10 + 10);
    }
}
