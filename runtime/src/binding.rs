//! How each instruction's operands sit on the arena: in-place pairs and
//! staged inputs.
//!
//! A plan may give an output the bytes of an input that dies at that op (a
//! taken reuse hint). [`Bindings::new`] finds, for every instruction, each
//! output that shares bytes with an input:
//! - the same bytes exactly, and the kernel supports that pair in place
//!   ([`crate::kernel::Kernel::in_place_sources`]): the pair is *aliased* and
//!   the kernel reads the input through the output;
//! - any other overlap: the input is *staged* — copied into the workspace
//!   (after the arena) before the kernel runs, so the kernel sees disjoint
//!   operands. The workspace is the largest total of staged inputs of one
//!   instruction (zero for every plan memplan makes for the built-in models,
//!   whose hints are all supported in-place pairs).
//!
//! Two written operands (outputs, updates) sharing bytes, or an update
//! sharing bytes with an input, is an error: no valid plan does that.

use crate::error::{Result, RuntimeError};
use crate::kernel::Kernel;
use crate::program::{Program, TensorIdx};

/// Alignment of staged copies in the workspace.
pub const WORKSPACE_ALIGN: u64 = 256;

/// How one instruction's operands are bound.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstrBinding {
    /// `(output position, input position)`: the output holds the input's
    /// bytes; the kernel reads that input from the output.
    pub aliased: Vec<(usize, usize)>,
    /// `(input position, workspace byte offset)`: the input is copied there
    /// first and read from the copy.
    pub staged: Vec<(usize, u64)>,
}

impl InstrBinding {
    /// The output position input `pos` is aliased to, if any.
    pub fn aliased_input(&self, pos: usize) -> Option<usize> {
        self.aliased
            .iter()
            .find(|&&(_, i)| i == pos)
            .map(|&(o, _)| o)
    }
    /// The workspace offset input `pos` is staged at, if any.
    pub fn staged_input(&self, pos: usize) -> Option<u64> {
        self.staged
            .iter()
            .find(|&&(i, _)| i == pos)
            .map(|&(_, w)| w)
    }
}

/// Bindings of every instruction of a program.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bindings {
    pub instrs: Vec<InstrBinding>,
    /// Bytes of workspace after the arena (staged inputs).
    pub workspace_bytes: u64,
}

fn overlap(a: &std::ops::Range<u64>, b: &std::ops::Range<u64>) -> bool {
    a.start < b.end && b.start < a.end && a.start < a.end && b.start < b.end
}

impl Bindings {
    /// Analyses `p`, which must have passed [`Program::validate`].
    pub fn new(p: &Program) -> Result<Bindings> {
        let mut instrs = Vec::with_capacity(p.instrs.len());
        let mut workspace = 0u64;
        for ins in &p.instrs {
            if matches!(ins.kernel, Kernel::View) {
                instrs.push(InstrBinding::default());
                continue;
            }
            let range = |t: TensorIdx| p.tensor(t).range();
            let name = |t: TensorIdx| p.tensor(t).name.clone();
            let err = |a: TensorIdx, b: TensorIdx, why| RuntimeError::Aliasing {
                instr: ins.name.clone(),
                a: name(a),
                b: name(b),
                why,
            };
            // Written operands must be disjoint from each other.
            let written: Vec<TensorIdx> = ins.outputs.iter().chain(&ins.updates).copied().collect();
            for (x, &a) in written.iter().enumerate() {
                for &b in &written[x + 1..] {
                    if overlap(&range(a), &range(b)) {
                        return Err(err(a, b, "both are written"));
                    }
                }
            }
            for &u in &ins.updates {
                for &i in &ins.inputs {
                    if overlap(&range(u), &range(i)) {
                        return Err(err(u, i, "one is updated in place"));
                    }
                }
            }
            let mut b = InstrBinding::default();
            let mut ws = 0u64;
            for (ip, &i) in ins.inputs.iter().enumerate() {
                let ri = range(i);
                let mut stage = false;
                for (op, &o) in ins.outputs.iter().enumerate() {
                    let ro = range(o);
                    if !overlap(&ri, &ro) {
                        continue;
                    }
                    let supported = ri == ro
                        && ins.kernel.in_place_sources(op).contains(&ip)
                        && !b.aliased.iter().any(|&(o2, _)| o2 == op);
                    if supported && !stage && b.aliased_input(ip).is_none() {
                        b.aliased.push((op, ip));
                    } else {
                        stage = true;
                    }
                }
                if stage {
                    // An input both aliased and overlapping another output is
                    // impossible (outputs are disjoint), so staging wins.
                    b.aliased.retain(|&(_, x)| x != ip);
                    b.staged.push((ip, ws));
                    ws += ri.end - ri.start;
                    ws = ws.div_ceil(WORKSPACE_ALIGN) * WORKSPACE_ALIGN;
                }
            }
            workspace = workspace.max(ws);
            instrs.push(b);
        }
        Ok(Bindings {
            instrs,
            workspace_bytes: workspace,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{DType, Instr, TensorDesc};

    fn prog(tensors: Vec<TensorDesc>, instrs: Vec<Instr>) -> Program {
        Program {
            name: "t".into(),
            arena_bytes: 1 << 16,
            tensors,
            instrs,
            world_size: 1,
        }
    }
    fn f32t(name: &str, n: u64, off: u64) -> TensorDesc {
        TensorDesc::new(name, DType::F32, vec![n], off)
    }

    #[test]
    fn supported_exact_pair_is_aliased() {
        let p = prog(
            vec![f32t("a", 8, 0), f32t("b", 8, 64), f32t("c", 8, 64)],
            vec![
                Instr::new("add", Kernel::Add { elements: 8 })
                    .inputs([TensorIdx(0), TensorIdx(1)])
                    .outputs([TensorIdx(2)]),
            ],
        );
        p.validate().unwrap();
        let b = Bindings::new(&p).unwrap();
        assert_eq!(b.instrs[0].aliased, vec![(0, 1)]);
        assert!(b.instrs[0].staged.is_empty());
        assert_eq!(b.workspace_bytes, 0);
    }

    #[test]
    fn unsupported_or_partial_overlap_is_staged() {
        // A matrix product's output on its input: staged.
        let mm = Kernel::MatmulNn(crate::kernel::Matmul { m: 2, k: 2, n: 2 });
        let p = prog(
            vec![f32t("a", 4, 0), f32t("b", 4, 64), f32t("c", 4, 8)],
            vec![
                Instr::new("mm", mm)
                    .inputs([TensorIdx(0), TensorIdx(1)])
                    .outputs([TensorIdx(2)]),
            ],
        );
        p.validate().unwrap();
        let b = Bindings::new(&p).unwrap();
        assert_eq!(b.instrs[0].staged, vec![(0, 0)]);
        assert!(b.instrs[0].aliased.is_empty());
        assert_eq!(b.workspace_bytes, WORKSPACE_ALIGN);
    }

    #[test]
    fn same_input_twice_aliases_once_and_stages_the_other() {
        let p = prog(
            vec![f32t("a", 8, 0), f32t("c", 8, 0)],
            vec![
                Instr::new("add", Kernel::Add { elements: 8 })
                    .inputs([TensorIdx(0), TensorIdx(0)])
                    .outputs([TensorIdx(1)]),
            ],
        );
        let b = Bindings::new(&p).unwrap();
        assert_eq!(b.instrs[0].aliased, vec![(0, 0)]);
        assert_eq!(b.instrs[0].staged, vec![(1, 0)]);
    }

    #[test]
    fn overlapping_written_operands_are_errors() {
        let lbw = Kernel::LinearBackwardWeight(crate::kernel::Matmul { m: 2, k: 2, n: 2 });
        let p = prog(
            vec![
                f32t("dy", 4, 0),
                f32t("x", 4, 64),
                f32t("dw", 4, 128),
                f32t("db", 2, 136),
            ],
            vec![
                Instr::new("lbw", lbw)
                    .inputs([TensorIdx(0), TensorIdx(1)])
                    .outputs([TensorIdx(2), TensorIdx(3)]),
            ],
        );
        p.validate().unwrap();
        let e = Bindings::new(&p).unwrap_err();
        assert!(e.to_string().contains("both are written"), "{e}");
    }
}
