//! NCCL collectives over device memory (one communicator per rank; ranks
//! are threads of one process, one GPU each, sharing the unique id).

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl, sys};

use super::DeviceSlice;
use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::kernel::ReduceOp;

pub(super) fn error(call: &str, e: nccl::NcclError) -> RuntimeError {
    RuntimeError::Device {
        library: "NCCL",
        call: call.to_string(),
        why: format!("{:?}", e.0),
    }
}

/// One rank's NCCL communicator.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from the thread that owns it;
// the executor never shares it between threads.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the group `id` as `rank` of `world` on `ctx`'s device. Blocks
    /// until every rank has joined.
    pub fn new(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        id: sys::ncclUniqueId,
    ) -> Result<NcclComm> {
        ctx.bind_to_thread().map_err(|e| RuntimeError::Device {
            library: "CUDA",
            call: "cuCtxSetCurrent".into(),
            why: format!("{e:?}"),
        })?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success.
        unsafe { nccl::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32) }
            .map_err(|e| error("ncclCommInitRank", e))?;
        Ok(NcclComm {
            // SAFETY: initialized above.
            comm: unsafe { comm.assume_init() },
            rank,
            world,
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitRank, destroyed once.
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

fn red(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

impl NcclComm {
    fn check(&self, op: &'static str, ok: bool, why: impl FnOnce() -> String) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(RuntimeError::Comm {
                op,
                rank: self.rank,
                why: why(),
            })
        }
    }
}

impl Communicator<DeviceSlice> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_gather(&self, shard: &DeviceSlice, full: &mut DeviceSlice) -> Result<()> {
        self.check("all_gather", full.len == shard.len * self.world, || {
            format!("full {} != {} × shard {}", full.len, self.world, shard.len)
        })?;
        // SAFETY: device regions of the executor's allocation, on its stream.
        unsafe {
            nccl::all_gather(
                shard.ptr as *const _,
                full.ptr as *mut _,
                shard.len,
                sys::ncclDataType_t::ncclFloat32,
                self.comm,
                full.stream as _,
            )
        }
        .map(|_| ())
        .map_err(|e| error("ncclAllGather", e))
    }
    fn reduce_scatter(
        &self,
        full: &DeviceSlice,
        shard: &mut DeviceSlice,
        op: ReduceOp,
    ) -> Result<()> {
        self.check("reduce_scatter", full.len == shard.len * self.world, || {
            format!("full {} != {} × shard {}", full.len, self.world, shard.len)
        })?;
        // SAFETY: as above.
        unsafe {
            nccl::reduce_scatter(
                full.ptr as *const _,
                shard.ptr as *mut _,
                shard.len,
                sys::ncclDataType_t::ncclFloat32,
                red(op),
                self.comm,
                shard.stream as _,
            )
        }
        .map(|_| ())
        .map_err(|e| error("ncclReduceScatter", e))
    }
    fn all_reduce(&self, buf: &mut DeviceSlice, op: ReduceOp) -> Result<()> {
        // SAFETY: as above (in place).
        unsafe {
            nccl::all_reduce(
                buf.ptr as *const _,
                buf.ptr as *mut _,
                buf.len,
                sys::ncclDataType_t::ncclFloat32,
                red(op),
                self.comm,
                buf.stream as _,
            )
        }
        .map(|_| ())
        .map_err(|e| error("ncclAllReduce", e))
    }
}
