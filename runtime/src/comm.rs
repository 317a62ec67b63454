//! Collectives: the [`Communicator`] trait, a single-rank implementation and
//! an in-process one (one thread per rank) for CPU runs and tests.
//!
//! Semantics match NCCL's: `all_gather` puts rank `r`'s shard at `r·S` of
//! every rank's full buffer; `reduce_scatter` gives rank `r` chunk `r` of
//! the full buffers combined over ranks; `all_reduce` combines whole
//! buffers. Sums run over ranks in rank order, so every rank gets bitwise the
//! same result.

use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Result, RuntimeError};
use crate::kernel::ReduceOp;

/// Collectives over memory of kind `M` (`[f32]` host slices on CPU, device
/// regions on CUDA). Every rank calls the same collectives in the same order.
pub trait Communicator<M: ?Sized> {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// `full[r·S .. (r+1)·S] = shard of rank r` on every rank (`S` = shard length).
    fn all_gather(&self, shard: &M, full: &mut M) -> Result<()>;
    /// `shard = op over ranks of full[rank·S .. (rank+1)·S]`.
    fn reduce_scatter(&self, full: &M, shard: &mut M, op: ReduceOp) -> Result<()>;
    /// `buf = op over ranks of buf`.
    fn all_reduce(&self, buf: &mut M, op: ReduceOp) -> Result<()>;
}

fn length_error(op: &'static str, rank: usize, why: String) -> RuntimeError {
    RuntimeError::Comm { op, rank, why }
}

/// The communicator of a world of one rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Communicator<[f32]> for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather(&self, shard: &[f32], full: &mut [f32]) -> Result<()> {
        if shard.len() != full.len() {
            return Err(length_error(
                "all_gather",
                0,
                format!("shard {} vs full {}", shard.len(), full.len()),
            ));
        }
        full.copy_from_slice(shard);
        Ok(())
    }
    fn reduce_scatter(&self, full: &[f32], shard: &mut [f32], _op: ReduceOp) -> Result<()> {
        if shard.len() != full.len() {
            return Err(length_error(
                "reduce_scatter",
                0,
                format!("shard {} vs full {}", shard.len(), full.len()),
            ));
        }
        shard.copy_from_slice(full);
        Ok(())
    }
    fn all_reduce(&self, _buf: &mut [f32], _op: ReduceOp) -> Result<()> {
        Ok(())
    }
}

/// What a rank deposited for the current collective.
#[derive(Clone)]
struct Deposit {
    op: &'static str,
    len: usize,
    data: Arc<Vec<f32>>,
}

struct State {
    slots: Vec<Option<Deposit>>,
    arrived: usize,
    generation: u64,
    /// Set when a rank leaves or fails: every waiting rank returns an error.
    aborted: Option<String>,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// Marker in the message of a rank that failed because another one did.
pub const PEER_FAILED: &str = "another rank left or failed";

/// One rank's end of an in-process group: ranks are threads of one process
/// and exchange data through shared memory. Dropping an endpoint (a rank
/// finishing or failing) makes any rank still waiting in a collective
/// return an error instead of hanging.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadComm {
    /// The endpoints of a group of `world` ranks, in rank order.
    pub fn group(world: usize) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                slots: vec![None; world],
                arrived: 0,
                generation: 0,
                aborted: None,
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock means a rank panicked while holding it; the state
        // is still consistent enough to report.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until every rank arrived; errors if the group was aborted first.
    fn barrier<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, State>,
        op: &'static str,
    ) -> Result<std::sync::MutexGuard<'a, State>> {
        let generation = st.generation;
        st.arrived += 1;
        if st.arrived == self.shared.world {
            st.arrived = 0;
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(st);
        }
        loop {
            if st.generation != generation {
                return Ok(st);
            }
            if let Some(why) = &st.aborted {
                return Err(RuntimeError::Comm {
                    op,
                    rank: self.rank,
                    why: why.clone(),
                });
            }
            st = self.shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Deposits `data`, waits for all ranks, checks they called the same
    /// collective, and returns every rank's deposit.
    fn exchange(&self, op: &'static str, data: &[f32]) -> Result<Vec<Arc<Vec<f32>>>> {
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(RuntimeError::Comm {
                op,
                rank: self.rank,
                why: why.clone(),
            });
        }
        st.slots[self.rank] = Some(Deposit {
            op,
            len: data.len(),
            data: Arc::new(data.to_vec()),
        });
        let mut st = self.barrier(st, op)?;
        let deposits: Vec<Deposit> = st
            .slots
            .iter()
            .map(|d| d.clone().expect("every rank deposited"))
            .collect();
        let mismatch = deposits
            .iter()
            .enumerate()
            .find(|(_, d)| d.op != op || d.len != data.len());
        if let Some((r, d)) = mismatch {
            let why = format!(
                "ranks disagree: rank {} called {op} with {} elements, rank {r} called {} with {}",
                self.rank,
                data.len(),
                d.op,
                d.len
            );
            st.aborted = Some(why.clone());
            self.shared.cv.notify_all();
            return Err(RuntimeError::Comm {
                op,
                rank: self.rank,
                why,
            });
        }
        // Second barrier: nobody deposits the next collective before every
        // rank has taken this one's data.
        let _st = self.barrier(st, op)?;
        Ok(deposits.into_iter().map(|d| d.data).collect())
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(format!("{PEER_FAILED} (rank {} is gone)", self.rank));
        }
        self.shared.cv.notify_all();
    }
}

fn combine(parts: &[Arc<Vec<f32>>], range: std::ops::Range<usize>, out: &mut [f32], op: ReduceOp) {
    out.copy_from_slice(&parts[0][range.clone()]);
    for p in &parts[1..] {
        for (o, &x) in out.iter_mut().zip(&p[range.clone()]) {
            *o += x;
        }
    }
    if op == ReduceOp::Avg {
        let w = parts.len() as f32;
        for o in out.iter_mut() {
            *o /= w;
        }
    }
}

impl Communicator<[f32]> for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.shared.world
    }
    fn all_gather(&self, shard: &[f32], full: &mut [f32]) -> Result<()> {
        let w = self.shared.world;
        if full.len() != shard.len() * w {
            return Err(length_error(
                "all_gather",
                self.rank,
                format!("full buffer {} != {w} × shard {}", full.len(), shard.len()),
            ));
        }
        let parts = self.exchange("all_gather", shard)?;
        for (r, p) in parts.iter().enumerate() {
            full[r * shard.len()..(r + 1) * shard.len()].copy_from_slice(p);
        }
        Ok(())
    }
    fn reduce_scatter(&self, full: &[f32], shard: &mut [f32], op: ReduceOp) -> Result<()> {
        let w = self.shared.world;
        let s = shard.len();
        if full.len() != s * w {
            return Err(length_error(
                "reduce_scatter",
                self.rank,
                format!("full buffer {} != {w} × shard {s}", full.len()),
            ));
        }
        let parts = self.exchange("reduce_scatter", full)?;
        combine(&parts, self.rank * s..(self.rank + 1) * s, shard, op);
        Ok(())
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let parts = self.exchange("all_reduce", buf)?;
        combine(&parts, 0..buf.len(), buf, op);
        Ok(())
    }
}

/// The error for rank `rank`'s panic, with its message.
fn panicked(rank: usize, payload: Box<dyn std::any::Any + Send>) -> RuntimeError {
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    RuntimeError::InvalidProgram(format!("rank {rank} panicked: {msg}"))
}

/// The most ranks [`run_ranks`] starts: one thread each, so a world size
/// of tens of thousands would exhaust memory or the system's thread limit
/// before failing.
pub const MAX_THREAD_RANKS: usize = 1024;

/// Runs `f(rank, comm)` on `world` threads, one per rank, and returns their
/// results in rank order. If ranks fail, returns the error of the first
/// rank that failed on its own (not because another rank did).
pub fn run_ranks<R, F>(world: usize, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(usize, ThreadComm) -> Result<R> + Sync,
{
    if world == 0 {
        return Err(RuntimeError::InvalidProgram(
            "world size must be at least 1".into(),
        ));
    }
    if world > MAX_THREAD_RANKS {
        return Err(RuntimeError::InvalidProgram(format!(
            "world size {world} is more ranks than the CPU executor runs ({MAX_THREAD_RANKS}): it starts one \
             thread per rank, each with its own copy of the step's tensors"
        )));
    }
    let mut comms = ThreadComm::group(world).into_iter();
    let first = comms.next().expect("a world of at least one rank");
    let mut unstarted = None;
    let results: Vec<Result<R>> = std::thread::scope(|s| {
        // Rank 0 runs on the calling thread (a world of one starts no
        // thread: a process at its thread limit still runs it), the others
        // on threads of their own. A rank whose thread cannot start (the
        // system's limit on threads or memory for their stacks) is an
        // error, not a panic: its endpoint, the later ones and rank 0's
        // are dropped, which ends the started ranks' collectives with
        // PEER_FAILED.
        let mut handles = Vec::new();
        for (i, comm) in comms.by_ref().enumerate() {
            let rank = i + 1;
            let f = &f;
            match std::thread::Builder::new().spawn_scoped(s, move || f(rank, comm)) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    unstarted = Some(RuntimeError::Unavailable(
                        "a thread for each rank",
                        format!(
                            "rank {rank} of a world of {world} could not start its thread: {e}"
                        ),
                    ));
                    break;
                }
            }
        }
        let own = if unstarted.is_none() {
            let f = &f;
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || f(0, first)))
                .unwrap_or_else(|payload| Err(panicked(0, payload)))
        } else {
            drop(first);
            Err(RuntimeError::InvalidProgram(PEER_FAILED.into()))
        };
        std::iter::once(own)
            .chain(handles.into_iter().enumerate().map(|(i, h)| {
                h.join()
                    .unwrap_or_else(|payload| Err(panicked(i + 1, payload)))
            }))
            .collect()
    });
    if let Some(e) = unstarted {
        return Err(e);
    }
    let mut first_err = None;
    let mut out = Vec::with_capacity(world);
    for r in results {
        match r {
            Ok(v) => out.push(v),
            Err(e) => {
                let secondary = e.to_string().contains(PEER_FAILED);
                match &first_err {
                    None => first_err = Some((secondary, e)),
                    Some((true, _)) if !secondary => first_err = Some((false, e)),
                    _ => {}
                }
            }
        }
    }
    match first_err {
        Some((_, e)) => Err(e),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_match_their_definitions() {
        let out = run_ranks(3, |rank, comm| {
            let shard: Vec<f32> = (0..2).map(|i| (rank * 10 + i) as f32).collect();
            let mut full = vec![0.0; 6];
            comm.all_gather(&shard, &mut full)?;
            let contrib: Vec<f32> = (0..6).map(|i| (i + rank) as f32).collect();
            let mut mine = vec![0.0; 2];
            comm.reduce_scatter(&contrib, &mut mine, ReduceOp::Sum)?;
            let mut avg = vec![rank as f32 * 3.0];
            comm.all_reduce(&mut avg, ReduceOp::Avg)?;
            Ok((full, mine, avg))
        })
        .unwrap();
        for (rank, (full, mine, avg)) in out.into_iter().enumerate() {
            assert_eq!(full, vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
            // chunk `rank` of sum over r of (i + r): 3i + 3.
            let i0 = 2 * rank;
            assert_eq!(
                mine,
                vec![3.0 * i0 as f32 + 3.0, 3.0 * (i0 + 1) as f32 + 3.0]
            );
            assert_eq!(avg, vec![3.0]);
        }
    }

    #[test]
    fn a_failing_rank_does_not_hang_the_others() {
        let err = run_ranks(3, |rank, comm| {
            if rank == 1 {
                return Err(RuntimeError::InvalidProgram("rank 1 broke".into()));
            }
            let mut x = vec![1.0f32];
            comm.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("rank 1 broke"), "{err}");
    }

    #[test]
    fn mismatched_collectives_are_reported() {
        let err = run_ranks(2, |rank, comm| {
            let mut x = vec![0.0f32; 2];
            if rank == 0 {
                comm.all_reduce(&mut x, ReduceOp::Sum)?;
            } else {
                comm.all_gather(&[1.0], &mut x)?;
            }
            Ok(())
        })
        .unwrap_err();
        assert!(err.to_string().contains("ranks disagree"), "{err}");
    }
}
