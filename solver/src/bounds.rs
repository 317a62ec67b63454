//! Lower bounds on the peak over every valid order.
//!
//! [`op_footprint`]: at the step an op runs, its inputs and outputs are live,
//! and so is every persistent step input: the largest such sum over ops is a
//! lower bound for any order. Outputs that a reuse hint may place in an
//! input's bytes are not counted, so the bound stays valid whichever hints a
//! plan takes. `O(n + m)`.

use crate::problem::Problem;

/// The largest bytes any single op needs live while it runs, plus resident
/// bytes; valid for every order.
pub fn op_footprint(p: &Problem) -> u64 {
    let resident = p.resident_bytes();
    let is_resident = |b: crate::problem::BufIdx| {
        let x = p.buf(b);
        x.persistent && x.producer.is_none()
    };
    let mut best = resident;
    let mut may_reuse = vec![false; p.num_bufs()];
    for v in p.ops() {
        for r in p.reuses_of(v) {
            may_reuse[r.out.index()] = true;
        }
        let uses: u64 = p
            .uses(v)
            .filter(|&b| !is_resident(b))
            .map(|b| p.size(b))
            .sum();
        let outs: u64 = p
            .outputs(v)
            .filter(|&b| !may_reuse[b.index()])
            .map(|b| p.size(b))
            .sum();
        best = best.max(resident + uses + outs);
        for r in p.reuses_of(v) {
            may_reuse[r.out.index()] = false;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{OpClass, ProblemBuilder};

    #[test]
    fn counts_inputs_outputs_and_residents() {
        let mut b = ProblemBuilder::new();
        let a = b.add_op(OpClass::Forward);
        let c = b.add_op(OpClass::Forward);
        let w = b.add_buf(5, None, true);
        let x = b.add_buf(10, Some(a), false);
        let y = b.add_buf(7, Some(c), false);
        b.add_use(a, w);
        b.add_use(c, x);
        let _ = y;
        let p = b.build().unwrap();
        assert_eq!(op_footprint(&p), 5 + 10 + 7);
    }
}
