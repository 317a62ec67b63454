//! Cross-stream synchronization from byte ranges.
//!
//! Instructions are issued in program order, each on its stream; a stream
//! runs its instructions in order. Two instructions on different streams
//! must not overlap in time when they touch the same bytes and at least one
//! of them writes (read-after-write, write-after-read, write-after-write):
//! in a planned arena that covers both true data dependencies and the reuse
//! of bytes by a later tensor. [`Schedule::new`] finds, for every
//! instruction, the latest earlier instruction of each *other* stream it
//! conflicts with (or must follow by `after`); waiting for that one covers
//! every earlier one on the same stream. A CUDA backend records an event
//! after each instruction someone waits for and makes the waiting stream
//! wait on it. Staged copies count as accesses of the workspace, which
//! follows the arena.
//!
//! Cost: O(n²·a²) in the worst case for `n` instructions of `a` operands
//! (each instruction scans back until every other stream is settled);
//! programs on one stream cost nothing.

use crate::binding::Bindings;
use crate::kernel::Kernel;
use crate::program::{InstrIdx, Program};

/// One byte range an instruction touches.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Access {
    lo: u64,
    hi: u64,
    write: bool,
}

/// Which instructions wait for which, across streams.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// For each instruction, the instructions of other streams it waits for.
    pub waits: Vec<Vec<InstrIdx>>,
    /// Whether each instruction must signal (record an event) because a
    /// later one waits for it.
    pub signals: Vec<bool>,
}

fn accesses(p: &Program, b: &Bindings) -> Vec<Vec<Access>> {
    p.instrs
        .iter()
        .zip(&b.instrs)
        .map(|(ins, bind)| {
            let mut acc = Vec::new();
            if matches!(ins.kernel, Kernel::View) {
                return acc;
            }
            let mut push = |r: std::ops::Range<u64>, write| {
                if r.start < r.end {
                    acc.push(Access {
                        lo: r.start,
                        hi: r.end,
                        write,
                    });
                }
            };
            for (pos, &t) in ins.inputs.iter().enumerate() {
                let r = p.tensor(t).range();
                if let Some(w) = bind.staged_input(pos) {
                    let ws = p.arena_bytes + w;
                    push(ws..ws + (r.end - r.start), true);
                }
                push(r, false);
            }
            for &t in ins.outputs.iter().chain(&ins.updates) {
                push(p.tensor(t).range(), true);
            }
            acc
        })
        .collect()
}

fn conflict(a: &[Access], b: &[Access]) -> bool {
    a.iter().any(|x| {
        b.iter()
            .any(|y| (x.write || y.write) && x.lo < y.hi && y.lo < x.hi)
    })
}

impl Schedule {
    /// The waits of `p` bound by `b`.
    pub fn new(p: &Program, b: &Bindings) -> Schedule {
        let n = p.instrs.len();
        let streams = p.num_streams() as usize;
        let mut waits = vec![Vec::new(); n];
        let mut signals = vec![false; n];
        if streams <= 1 {
            return Schedule { waits, signals };
        }
        let acc = accesses(p, b);
        for j in 0..n {
            let sj = p.instrs[j].stream.index();
            let mut settled = vec![false; streams];
            settled[sj] = true;
            let mut left = streams - 1;
            let after = &p.instrs[j].after;
            for i in (0..j).rev() {
                if left == 0 {
                    break;
                }
                let si = p.instrs[i].stream.index();
                if settled[si] {
                    continue;
                }
                if after.contains(&InstrIdx(i as u32)) || conflict(&acc[i], &acc[j]) {
                    settled[si] = true;
                    left -= 1;
                    waits[j].push(InstrIdx(i as u32));
                    signals[i] = true;
                }
            }
            waits[j].sort();
        }
        Schedule { waits, signals }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::ReduceOp;
    use crate::program::{DType, Instr, TensorDesc, TensorIdx};

    #[test]
    fn waits_only_where_bytes_are_shared_across_streams() {
        let t = |n: &str, off| TensorDesc::new(n, DType::F32, vec![4], off);
        // a(0) -> gelu -> b(16); comm on stream 1 reduces c(32) in place;
        // then add reads b and writes d at c's old bytes? No: d at 48.
        // Then a gelu on stream 0 writes into c's bytes (reuse after comm).
        let tensors = vec![t("a", 0), t("b", 16), t("c", 32), t("d", 48), t("e", 32)];
        let g = |n: &str, i: u32, o: u32| {
            Instr::new(n, Kernel::Gelu { elements: 4 })
                .inputs([TensorIdx(i)])
                .outputs([TensorIdx(o)])
        };
        let instrs = vec![
            g("g0", 0, 1),
            Instr::new(
                "ar",
                Kernel::AllReduce {
                    world: 1,
                    op: ReduceOp::Sum,
                },
            )
            .updates([TensorIdx(2)])
            .stream(1),
            g("g1", 1, 3),
            // writes e over c's bytes: must wait for the all-reduce.
            g("g2", 3, 4),
        ];
        let p = Program {
            name: "t".into(),
            arena_bytes: 64,
            tensors,
            instrs,
            world_size: 1,
        };
        p.validate().unwrap();
        let b = Bindings::new(&p).unwrap();
        let s = Schedule::new(&p, &b);
        assert_eq!(s.waits[0], vec![]);
        assert_eq!(s.waits[1], vec![]);
        assert_eq!(s.waits[2], vec![]);
        assert_eq!(s.waits[3], vec![InstrIdx(1)]);
        assert_eq!(s.signals, vec![false, true, false, false]);
    }
}
