//! What an op costs to run: FLOPs, bytes moved, and an estimated time.
//!
//! Recomputation ([`crate::fit`]) trades memory for extra work, so it needs
//! a price for every op. A graph may give it per op (`flops`, and `cost` in
//! seconds, in the JSON format); where it does not, this module estimates:
//!
//! - **FLOPs** from the op's type and attributes: a matrix product
//!   (attributes `m`, `k`, `n`) costs `2·m·k·n`; attention over `batch`,
//!   `heads`, `seq`, `head_dim` costs `2·b·h·s²·d` per matrix product it
//!   holds (two forward, four backward; a fused kernel's backward also
//!   recomputes the scores, five); any other op costs a few FLOPs per
//!   element it writes ([`flops_per_element`]), elements being the output
//!   bytes over the element size.
//! - **Bytes moved**: every byte the op reads (inputs), writes (outputs)
//!   and updates (read and written).
//! - **Time**, a roofline: `max(flops / F, bytes / B)` on a device with peak
//!   arithmetic `F` and memory bandwidth `B` ([`CostModel`]; the default is
//!   an H100 SXM: 989 TFLOP/s dense bf16 and 3.35 TB/s HBM3, derated to
//!   the 60% and 80% that large kernels reach). An op's own `cost` overrides
//!   the estimate.
//!
//! Estimates rank choices; they do not predict a step's time. The fit report
//! therefore gives the added FLOPs (an exact count when the graph carries
//! them) next to the added estimated time.

use crate::error::{Error, GraphError};
use crate::graph::{Graph, OpId, Tensor};

/// The most FLOPs, and estimated seconds, the ops of one step may add up
/// to (1e300): far beyond any real step (all the world's computers do
/// about 1e27 FLOPs a year), and far enough below f64's largest value
/// that the sums recomputation adds stay finite.
pub const MAX_STEP_COST: f64 = 1e300;

/// A device's peak rates, for the roofline estimate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Floating-point operations per second an op reaches.
    pub flops_per_s: f64,
    /// Bytes per second an op moves to and from memory.
    pub bytes_per_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            flops_per_s: 0.6 * 989e12,
            bytes_per_s: 0.8 * 3.35e12,
        }
    }
}

/// FLOPs, bytes and estimated seconds of one op.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpCost {
    pub flops: f64,
    pub bytes: u64,
    pub seconds: f64,
}

impl std::ops::AddAssign for OpCost {
    fn add_assign(&mut self, o: OpCost) {
        self.flops += o.flops;
        self.bytes = self.bytes.saturating_add(o.bytes);
        self.seconds += o.seconds;
    }
}

impl CostModel {
    /// The cost of op `o` of `g`.
    pub fn op(&self, g: &Graph, o: OpId) -> OpCost {
        let flops = op_flops(g, o);
        let bytes = op_bytes(g, o);
        let seconds = g
            .op(o)
            .cost
            .unwrap_or_else(|| (flops / self.flops_per_s).max(bytes as f64 / self.bytes_per_s));
        OpCost {
            flops,
            bytes,
            seconds,
        }
    }

    /// The cost of running every op of `g` once.
    pub fn total(&self, g: &Graph) -> OpCost {
        let mut c = OpCost::default();
        for o in g.op_ids() {
            c += self.op(g, o);
        }
        c
    }

    /// [`CostModel::total`], or an error naming the op from which the
    /// step's FLOPs or estimated seconds add up to more than
    /// [`MAX_STEP_COST`] (an op's own figure or an estimate from huge
    /// attributes): what recomputation saves or adds is then meaningless.
    pub fn checked_total(&self, g: &Graph) -> Result<OpCost, Error> {
        let mut c = OpCost::default();
        for o in g.op_ids() {
            let own = self.op(g, o);
            c += own;
            // Also false for NaN.
            let within = |x: f64| x <= MAX_STEP_COST;
            if !(within(c.flops) && within(c.seconds)) {
                let what = if within(c.flops) {
                    format!("estimated seconds ({:e} s itself)", own.seconds)
                } else {
                    format!("FLOPs ({:e} itself)", own.flops)
                };
                return Err(GraphError::Other(format!(
                    "op {:?}: with it the step's {what} add up to more than 1e300, beyond any real step: check the graph's costs",
                    g.op(o).name
                ))
                .into());
            }
        }
        Ok(c)
    }
}

/// Bytes of one element of `dtype` ([`crate::dtype`]'s table; 4 when
/// unknown or of no width, `token`).
pub fn dtype_bytes(dtype: Option<&str>) -> u64 {
    crate::dtype::ElementType::named(dtype.unwrap_or("f32"))
        .map(|e| e.unpacked_bytes())
        .filter(|&b| b > 0)
        .unwrap_or(4)
}

fn elements(t: &Tensor) -> f64 {
    match &t.shape {
        Some(s) => s.iter().map(|&d| d as f64).product(),
        None => (t.size / dtype_bytes(t.dtype.as_deref())) as f64,
    }
}

/// Bytes op `o` reads and writes (updates count twice).
pub fn op_bytes(g: &Graph, o: OpId) -> u64 {
    let op = g.op(o);
    // Saturating: a graph's sizes add up within u64, but an op may read
    // one tensor several times, and updates count twice.
    let size = |t: &crate::TensorId| g.tensor(*t).size;
    let sum = |ts: &[crate::TensorId]| ts.iter().map(size).fold(0u64, u64::saturating_add);
    sum(&op.inputs)
        .saturating_add(sum(&op.outputs))
        .saturating_add(sum(&op.updates).saturating_mul(2))
}

/// FLOPs per element written, for ops that are not matrix products.
pub fn flops_per_element(op_type: &str) -> f64 {
    let base = op_type.trim_end_matches("_backward");
    let backward = base.len() != op_type.len();
    let f = match base {
        "layernorm" | "rmsnorm" | "batchnorm" | "group_norm" => 8.0,
        "softmax" | "causal_softmax" | "cross_entropy" | "log_softmax" => 5.0,
        "gelu" | "silu" | "swiglu" | "tanh" | "sigmoid" => 8.0,
        "rope" => 6.0,
        "adamw" | "adam" => 14.0,
        "sgd" => 4.0,
        "embedding" | "copy" | "copy_to_host" | "copy_to_device" | "cast" | "transpose"
        | "reshape" | "view" | "all_gather" | "concat" | "slice" | "gather" | "scatter" => 0.0,
        _ => 1.0,
    };
    if backward { 2.0 * f } else { f }
}

/// FLOPs of op `o`: its own figure if the graph gives one, else the
/// estimate described in the module docs.
pub fn op_flops(g: &Graph, o: OpId) -> f64 {
    let op = g.op(o);
    if let Some(f) = op.flops {
        return f;
    }
    let attr = |k: &str| op.attrs.get(k).and_then(|v| v.as_f64());
    if let (Some(m), Some(k), Some(n)) = (attr("m"), attr("k"), attr("n")) {
        return 2.0 * m * k * n;
    }
    if let (Some(b), Some(h), Some(s), Some(d)) =
        (attr("batch"), attr("heads"), attr("seq"), attr("head_dim"))
        && op.op_type.contains("attention")
    {
        let products = match op.op_type.as_str() {
            "attention_scores" | "attention_values" => 1.0,
            "attention_scores_backward" | "attention_values_backward" => 2.0,
            "fused_attention" | "flash_attention" => 2.0,
            "fused_attention_backward" | "flash_attention_backward" => 5.0,
            _ => 2.0,
        };
        return products * 2.0 * b * h * s * s * d;
    }
    let written: f64 = op
        .outputs
        .iter()
        .chain(&op.updates)
        .map(|&t| g.tensor(t))
        .filter(|t| t.view_of.is_none())
        .map(elements)
        .sum();
    flops_per_element(&op.op_type) * written
}

/// Fills every op's `flops` in `g` that it does not give, with the estimate
/// (so exported graphs carry them).
pub fn fill_flops(g: &mut Graph) {
    let flops: Vec<f64> = g.op_ids().map(|o| op_flops(g, o)).collect();
    g.set_flops(&flops);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{ExampleOptions, example};

    #[test]
    fn matmuls_dominate_a_gpt2_step_and_flops_are_filled() {
        let mut g = example("gpt2-small", &ExampleOptions::default()).unwrap();
        let m = CostModel::default();
        let lin = g.op_by_name("h0.attn.c_attn").unwrap();
        // [B·T, 768] x [768, 2304] with B = 4, T = 1024 by default.
        let a = g.op(lin).attrs.clone();
        let (mm, k, n) = (
            a["m"].as_f64().unwrap(),
            a["k"].as_f64().unwrap(),
            a["n"].as_f64().unwrap(),
        );
        assert_eq!(m.op(&g, lin).flops, 2.0 * mm * k * n);
        let total = m.total(&g);
        // A training step costs about 6 FLOPs per parameter and token plus
        // attention; the matrix products carry almost all of it.
        let mm_flops: f64 = g
            .op_ids()
            .filter(|&o| g.op(o).attrs.contains_key("m"))
            .map(|o| m.op(&g, o).flops)
            .sum();
        assert!(
            mm_flops / total.flops > 0.85,
            "{mm_flops} of {}",
            total.flops
        );
        assert!(total.seconds > 0.0 && total.bytes > 0);
        fill_flops(&mut g);
        assert!(g.ops().iter().all(|o| o.flops.is_some()));
        assert_eq!(m.total(&g).flops, total.flops);
    }

    #[test]
    fn an_ops_own_cost_and_flops_win() {
        use crate::graph::{GraphBuilder, OpKind, OpSpec, TensorSpec};
        let mut b = GraphBuilder::new("c");
        let x = b.add_tensor(TensorSpec::new("x", 400).dtype("f32"));
        let y = b.add_tensor(TensorSpec::new("y", 400).dtype("f32"));
        b.add_op(OpSpec::new("a", OpKind::Forward, "gelu").outputs([x]));
        b.add_op(
            OpSpec::new("b", OpKind::Forward, "gelu")
                .inputs([x])
                .outputs([y])
                .flops(7.0)
                .cost(2.0),
        );
        let g = b.build().unwrap();
        let m = CostModel::default();
        assert_eq!(m.op(&g, OpId(0)).flops, 800.0);
        assert_eq!(m.op(&g, OpId(1)).flops, 7.0);
        assert_eq!(m.op(&g, OpId(1)).seconds, 2.0);
        assert_eq!(m.op(&g, OpId(1)).bytes, 800);
    }
}
