//! Floating-point operations of HLO instructions, for the cost model
//! (`memplan fit` prices recomputation by them; docs/hlo.md, "FLOPs").
//!
//! - `dot`: 2 × output elements × the product of the lhs contracting
//!   dimensions (one multiply and one add per term).
//! - `convolution`: 2 × output elements × kernel elements / the kernel's
//!   output-feature size (`o` in `dim_labels`), which is the window size
//!   times the input features of one group, so grouped and depthwise
//!   convolutions come out right.
//! - `fusion`, `call`, `custom-call` with a called computation, `map`,
//!   `async-start`: the FLOPs of the called computation's instructions.
//! - `while`: one trip of its body and condition (the trip count is not in
//!   the text); `conditional`: its most expensive branch.
//! - `reduce`, `reduce-window`, `scatter`, `select-and-scatter`, `sort`:
//!   one per input element; elementwise arithmetic and anything else that
//!   computes: one per output element.
//! - Data movement (`parameter`, `constant`, `tuple`, `get-tuple-element`,
//!   `bitcast`, `copy`, `reshape`, `transpose`, `broadcast`, slices,
//!   concatenation, padding, collectives, ...): zero.
//!
//! Nesting is followed to a fixed depth; deeper calls count zero.

use super::parser::{CompIdx, Computation, Instr, Module, is_collective};
use super::shape::Shape;

const MAX_DEPTH: usize = 16;

fn elements(s: &Shape) -> f64 {
    s.leaves()
        .iter()
        .map(|(_, a)| a.elements().unwrap_or(0) as f64)
        .sum()
}

fn operand_shape<'m>(comp: &'m Computation, ins: &Instr, k: usize) -> Option<&'m Shape> {
    ins.operands.get(k).map(|o| &comp.instrs[o.index()].shape)
}

fn dot(comp: &Computation, ins: &Instr) -> f64 {
    let Some(lhs) = operand_shape(comp, ins, 0).and_then(Shape::as_array) else {
        return 0.0;
    };
    let dims = lhs.dim_sizes();
    let k: f64 = ins
        .lhs_contracting_dims
        .iter()
        .map(|&d| dims.get(d as usize).copied().unwrap_or(1) as f64)
        .product();
    2.0 * elements(&ins.shape) * k
}

fn convolution(comp: &Computation, ins: &Instr) -> f64 {
    let Some(kernel) = operand_shape(comp, ins, 1).and_then(Shape::as_array) else {
        return 0.0;
    };
    let dims = kernel.dim_sizes();
    let kernel_elements: f64 = dims.iter().map(|&d| d as f64).product();
    // `b01f_01io->b01f`: the kernel's labels are the middle part.
    let o = ins
        .dim_labels
        .as_deref()
        .and_then(|l| l.split(['_', '-']).nth(1))
        .and_then(|k| k.find('o'))
        .and_then(|i| dims.get(i).copied())
        .unwrap_or(1)
        .max(1) as f64;
    2.0 * elements(&ins.shape) * kernel_elements / o
}

fn called(m: &Module, ins: &Instr, attr: &str, depth: usize) -> f64 {
    ins.called_all(attr)
        .map(|c| computation(m, c, depth + 1))
        .sum()
}

/// FLOPs of every instruction of computation `c`.
pub fn computation(m: &Module, c: CompIdx, depth: usize) -> f64 {
    if depth > MAX_DEPTH {
        return 0.0;
    }
    let comp = &m.computations[c.index()];
    comp.instrs
        .iter()
        .map(|i| instruction(m, comp, i, depth))
        .sum()
}

/// FLOPs of one instruction of `comp` (see the module docs).
pub fn instruction(m: &Module, comp: &Computation, ins: &Instr, depth: usize) -> f64 {
    let input_elements = || {
        (0..ins.operands.len())
            .filter_map(|k| operand_shape(comp, ins, k))
            .map(elements)
            .sum::<f64>()
    };
    match ins.opcode.as_str() {
        "dot" => dot(comp, ins),
        "convolution" => convolution(comp, ins),
        "fusion" | "call" | "map" | "async-start" => {
            called(m, ins, "calls", depth).max(called(m, ins, "to_apply", depth))
        }
        "custom-call" => called(m, ins, "calls", depth),
        "while" => called(m, ins, "body", depth) + called(m, ins, "condition", depth),
        "conditional" => ins
            .called
            .iter()
            .map(|&(_, c)| computation(m, c, depth + 1))
            .fold(0.0, f64::max),
        "reduce" | "reduce-window" | "scatter" | "select-and-scatter" | "sort" => input_elements(),
        "parameter"
        | "constant"
        | "tuple"
        | "get-tuple-element"
        | "bitcast"
        | "copy"
        | "reshape"
        | "transpose"
        | "broadcast"
        | "slice"
        | "dynamic-slice"
        | "dynamic-update-slice"
        | "concatenate"
        | "pad"
        | "reverse"
        | "gather"
        | "iota"
        | "copy-start"
        | "copy-done"
        | "after-all"
        | "partition-id"
        | "replica-id"
        | "bitcast-convert"
        | "opt-barrier"
        | "optimization-barrier"
        | "domain"
        | "get-dimension-size"
        | "set-dimension-size"
        | "async-done"
        | "async-update"
        | "send"
        | "send-done"
        | "recv"
        | "recv-done"
        | "infeed"
        | "outfeed"
        | "rng-get-and-update-state" => 0.0,
        op if is_collective(op) => 0.0,
        _ => elements(&ins.shape),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::hlo::parse_module;

    fn entry_flops(text: &str) -> Vec<(String, f64)> {
        let m = parse_module(text).unwrap();
        let comp = &m.computations[m.entry.index()];
        comp.instrs
            .iter()
            .map(|i| (i.name.clone(), instruction(&m, comp, i, 0)))
            .collect()
    }

    #[test]
    fn dots_convolutions_fusions_and_loops_are_counted() {
        let text = r#"HloModule t

%fused (p0: f32[8,16], p1: f32[16,32]) -> f32[8,32] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  %d = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %e = f32[8,32]{1,0} exponential(%d)
}

ENTRY %main (a: f32[8,16], b: f32[16,32], x: f32[2,10,10,3], k: f32[3,3,3,4], g: f32[2,10,10,4], dk: f32[3,3,1,4]) -> f32[8,32] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[16,32]{1,0} parameter(1)
  %x = f32[2,10,10,3]{3,2,1,0} parameter(2)
  %k = f32[3,3,3,4]{3,2,1,0} parameter(3)
  %g = f32[2,10,10,4]{3,2,1,0} parameter(4)
  %dk = f32[3,3,1,4]{3,2,1,0} parameter(5)
  %dot.1 = f32[8,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %conv = f32[2,10,10,4]{3,2,1,0} convolution(%x, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  %dw = f32[2,10,10,4]{3,2,1,0} convolution(%g, %dk), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, feature_group_count=4
  %f = f32[8,32]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused
  %t = f32[32,8]{1,0} transpose(%f), dimensions={1,0}
  ROOT %add = f32[8,32]{1,0} add(%dot.1, %f)
}
"#;
        let f: std::collections::HashMap<_, _> = entry_flops(text).into_iter().collect();
        assert_eq!(f["dot.1"], 2.0 * 8.0 * 32.0 * 16.0);
        // 2 · (2·10·10·4 outputs) · (3·3·3 window × input features)
        assert_eq!(f["conv"], 2.0 * 800.0 * 27.0);
        // Depthwise: one input feature per group.
        assert_eq!(f["dw"], 2.0 * 800.0 * 9.0);
        assert_eq!(f["f"], 2.0 * 8.0 * 32.0 * 16.0 + 256.0);
        assert_eq!(f["t"], 0.0);
        assert_eq!(f["add"], 256.0);
        assert_eq!(f["a"], 0.0);
    }
}
