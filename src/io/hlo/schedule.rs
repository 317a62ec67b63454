//! Writing a module back in memplan's order: a scheduled HLO module that XLA
//! can run as planned.
//!
//! XLA keeps the order of a module marked `is_scheduled=true`: its text
//! lists every computation's instructions in execution order, and the HLO
//! parser turns that listing into the module's schedule. So applying a plan
//! is a rewrite of the entry computation's listing:
//!
//! 1. each op of the plan is the entry instruction of the same name, and
//!    they are listed in the plan's order;
//! 2. instructions that make no op in memplan's graph (parameters,
//!    constants, `tuple`, `get-tuple-element`, `bitcast`, ...) are listed
//!    just before their first user, operands and control predecessors
//!    first; the ones nobody uses go last, before the `ROOT`, which ends the
//!    listing;
//! 3. every line is copied as written (attributes, metadata, layouts), only
//!    moved; the header gains `is_scheduled=true` if it lacked it. Nested
//!    computations keep their listed order.
//!
//! The result is parsed again and its entry order compared with the one
//! intended, so a module whose text this rewrite cannot handle (two
//! instructions on one line) is refused rather than written wrong.

use std::collections::{HashMap, HashSet};

use super::parser::{InstrIdx, Module, parse_module};
use crate::error::Error;
use crate::graph::{Graph, OpId};

fn fail(msg: impl Into<String>) -> Error {
    Error::Unsupported(msg.into())
}

/// The entry computation's instructions in the order a plan runs its ops
/// (see the module docs for the instructions that make no op).
pub fn entry_order(m: &Module, g: &Graph, order: &[OpId]) -> Result<Vec<InstrIdx>, Error> {
    let entry = m.entry();
    let index: HashMap<&str, InstrIdx> = entry
        .instrs
        .iter()
        .enumerate()
        .map(|(i, ins)| (ins.name.as_str(), InstrIdx(i as u32)))
        .collect();
    let is_op: HashSet<InstrIdx> = g
        .op_ids()
        .filter_map(|o| index.get(g.op(o).name.as_str()).copied())
        .collect();
    if is_op.len() != g.num_ops() {
        return Err(fail(format!(
            "the graph has {} ops but only {} of them are instructions of the entry computation %{}: \
             was the plan made for another module?",
            g.num_ops(),
            is_op.len(),
            entry.name
        )));
    }
    let mut l = Lister {
        m,
        is_op,
        done: vec![false; entry.instrs.len()],
        out: Vec::with_capacity(entry.instrs.len()),
    };
    for &op in order {
        let i = index[g.op(op).name.as_str()];
        if l.done[i.index()] {
            return Err(fail(format!("the order runs %{} twice", g.op(op).name)));
        }
        l.emit(i, true)?;
    }
    for i in 0..entry.instrs.len() {
        let i = InstrIdx(i as u32);
        if i != entry.root {
            l.emit(i, false)?;
        }
    }
    l.emit(entry.root, false)?;
    Ok(l.out)
}

/// The listing being built.
struct Lister<'m> {
    m: &'m Module,
    is_op: HashSet<InstrIdx>,
    done: Vec<bool>,
    out: Vec<InstrIdx>,
}

impl Lister<'_> {
    /// Lists `want` after everything it needs (operands and control
    /// predecessors, depth first); with `ops_in_turn`, reaching an op not yet
    /// listed means the order runs `want` too early.
    fn emit(&mut self, want: InstrIdx, ops_in_turn: bool) -> Result<(), Error> {
        let entry = self.m.entry();
        let mut stack = vec![(want, false)];
        while let Some((i, expanded)) = stack.pop() {
            if self.done[i.index()] {
                continue;
            }
            let ins = &entry.instrs[i.index()];
            if expanded {
                self.done[i.index()] = true;
                self.out.push(i);
                continue;
            }
            if ops_in_turn && i != want && self.is_op.contains(&i) {
                return Err(fail(format!(
                    "the order runs %{} before %{}, which it needs",
                    entry.instrs[want.index()].name,
                    ins.name
                )));
            }
            stack.push((i, true));
            for &p in ins.operands.iter().chain(&ins.control_preds).rev() {
                if !self.done[p.index()] {
                    stack.push((p, false));
                }
            }
        }
        Ok(())
    }
}

/// `text` (the module `m` was parsed from) with its entry computation listed
/// in `order` and marked scheduled.
///
/// With `chain`, every entry instruction but the first also gets its
/// predecessor in the listing as a control predecessor. XLA's CPU compiler
/// schedules every module again before assigning buffers, whatever the
/// module says (`CompileCpuExecutable` calls its DFS memory scheduler
/// unconditionally); the chain leaves that scheduler a single valid order,
/// ours. The chain orders, it moves no data, so results are unchanged.
pub fn scheduled_text(
    text: &str,
    m: &Module,
    g: &Graph,
    order: &[OpId],
    chain: bool,
) -> Result<String, Error> {
    let entry = m.entry();
    if order.len() != g.num_ops() {
        return Err(fail(format!(
            "the order has {} ops, the graph {}",
            order.len(),
            g.num_ops()
        )));
    }
    let listing = entry_order(m, g, order)?;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    // 0-based line of each entry instruction; one instruction per line.
    let mut seen = HashSet::new();
    for ins in &entry.instrs {
        let l = ins.line as usize;
        if l == entry.line as usize || !seen.insert(l) || l == 0 || l > lines.len() {
            return Err(fail(format!(
                "line {l}: instruction %{} does not stand on a line of its own, so the \
                 entry computation cannot be relisted",
                ins.name
            )));
        }
    }
    let first = entry.instrs.iter().map(|i| i.line).min().unwrap_or(0) as usize;
    let mut out = String::with_capacity(text.len() + 32);
    let mut header_done = false;
    for (k, line) in lines.iter().enumerate() {
        let l = k + 1;
        if l == first {
            let mut prev: Option<&str> = None;
            for &i in &listing {
                let ins = &entry.instrs[i.index()];
                let src = lines[ins.line as usize - 1].trim_end_matches(['\n', '\r']);
                match prev.filter(|_| chain) {
                    Some(p) => out.push_str(&with_control_pred(src, p)),
                    None => out.push_str(src),
                }
                out.push('\n');
                prev = Some(&ins.name);
            }
        }
        if seen.contains(&l) {
            continue;
        }
        if !header_done && line.trim_start().starts_with("HloModule") {
            header_done = true;
            out.push_str(&scheduled_header(line, &m.name, m.is_scheduled));
            continue;
        }
        out.push_str(line);
    }
    verify(&out, m, &listing)?;
    Ok(out)
}

/// An instruction line with `%pred` added to its control predecessors.
fn with_control_pred(line: &str, pred: &str) -> String {
    const KEY: &str = "control-predecessors={";
    match line.find(KEY) {
        Some(at) => {
            let (a, b) = line.split_at(at + KEY.len());
            format!("{a}%{pred}, {b}")
        }
        None => format!("{line}, control-predecessors={{%{pred}}}"),
    }
}

/// The `HloModule` line with `is_scheduled=true`.
fn scheduled_header(line: &str, name: &str, scheduled: bool) -> String {
    if scheduled {
        return line.to_string();
    }
    let at = line
        .find(name)
        .map(|p| p + name.len())
        .unwrap_or(line.len());
    let (a, b) = line.split_at(at);
    let b = b.trim_end_matches(['\n', '\r']);
    format!("{a}, is_scheduled=true{b}\n")
}

/// The rewritten text parses, is scheduled, and lists the entry as meant.
fn verify(out: &str, m: &Module, listing: &[InstrIdx]) -> Result<(), Error> {
    let again = parse_module(out).map_err(|e| {
        fail(format!(
            "internal error: the relisted module does not parse: {e}"
        ))
    })?;
    let want: Vec<&str> = listing
        .iter()
        .map(|i| m.entry().instrs[i.index()].name.as_str())
        .collect();
    let got: Vec<&str> = again
        .entry()
        .instrs
        .iter()
        .map(|i| i.name.as_str())
        .collect();
    if !again.is_scheduled || got != want {
        return Err(fail(
            "internal error: the relisted module does not list the entry computation in the planned order",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::hlo::{ImportOptions, import::import_module};

    const TEXT: &str = "HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}\n\
\n\
ENTRY %main (p: f32[4]) -> f32[4] {\n\
  %p = f32[4]{0} parameter(0)\n\
  %a = f32[4]{0} exponential(f32[4]{0} %p)\n\
  %b = f32[4]{0} negate(f32[4]{0} %p)\n\
  %c = f32[4]{0} bitcast(f32[4]{0} %b)\n\
  ROOT %d = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %c)\n\
}\n";

    /// The module of `text`, its graph, and the ops `a`, `b`, `d`.
    fn setup(text: &str) -> (Module, Graph, [OpId; 3]) {
        let m = parse_module(text).unwrap();
        let g = import_module(&m, &ImportOptions::default()).unwrap();
        let ops = ["a", "b", "d"].map(|n| g.op_by_name(n).unwrap());
        (m, g, ops)
    }

    fn names(text: &str) -> Vec<String> {
        let m = parse_module(text).unwrap();
        m.entry().instrs.iter().map(|i| i.name.clone()).collect()
    }

    #[test]
    fn relists_the_entry_in_the_given_order() {
        let (m, g, [a, b, d]) = setup(TEXT);
        let out = scheduled_text(TEXT, &m, &g, &[b, a, d], false).unwrap();
        assert!(out.starts_with("HloModule m, is_scheduled=true, entry_computation_layout"));
        assert_eq!(names(&out), ["p", "b", "a", "c", "d"]);
        // The original order round-trips to the same text but the header.
        let same = scheduled_text(TEXT, &m, &g, &[a, b, d], false).unwrap();
        assert_eq!(same.replace(", is_scheduled=true", ""), TEXT);
    }

    #[test]
    fn refuses_an_order_that_breaks_a_dependency() {
        let (m, g, [a, b, d]) = setup(TEXT);
        let e = scheduled_text(TEXT, &m, &g, &[d, a, b], false).unwrap_err();
        assert!(e.to_string().contains("runs %d before"), "{e}");
    }

    #[test]
    fn keeps_control_predecessors() {
        let text = TEXT.replace(
            "%b = f32[4]{0} negate(f32[4]{0} %p)",
            "%b = f32[4]{0} negate(f32[4]{0} %p), control-predecessors={%a}",
        );
        let (m, g, [a, b, d]) = setup(&text);
        // The importer made the control edge a dependency of the graph.
        assert!(
            g.op(b)
                .inputs
                .iter()
                .any(|&t| g.tensor(t).producer == Some(a))
        );
        assert!(scheduled_text(&text, &m, &g, &[b, a, d], false).is_err());
        assert_eq!(
            names(&scheduled_text(&text, &m, &g, &[a, b, d], false).unwrap()),
            ["p", "a", "b", "c", "d"]
        );
    }

    #[test]
    fn a_chain_leaves_one_order() {
        let (m, g, [a, b, d]) = setup(TEXT);
        let out = scheduled_text(TEXT, &m, &g, &[b, a, d], true).unwrap();
        let again = parse_module(&out).unwrap();
        let e = again.entry();
        let preds: Vec<Vec<&str>> = e
            .instrs
            .iter()
            .map(|i| {
                i.control_preds
                    .iter()
                    .map(|p| e.instrs[p.index()].name.as_str())
                    .collect()
            })
            .collect();
        assert_eq!(preds, [vec![], vec!["p"], vec!["b"], vec!["a"], vec!["c"]]);
        // An existing control predecessor is kept beside the chain's.
        assert_eq!(
            with_control_pred("%x = f32[] negate(%y), control-predecessors={%z}", "w"),
            "%x = f32[] negate(%y), control-predecessors={%w, %z}"
        );
    }
}
