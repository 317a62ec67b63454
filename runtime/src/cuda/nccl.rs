//! NCCL collectives over device memory (one communicator per rank; ranks
//! are threads of one process, one GPU each, sharing the unique id).
//!
//! Set-up cannot hang. Each rank creates its communicator non-blocking
//! (`ncclCommInitRankConfig` with `blocking = 0`) and polls
//! `ncclCommGetAsyncError` every millisecond until it is ready, has failed,
//! or [`DEFAULT_INIT_TIMEOUT`] (120 s; `MEMPLAN_NCCL_INIT_TIMEOUT_S` sets
//! another, in seconds) has passed, or until another rank of the run has
//! failed (a flag the ranks share: a rank that fails before joining stops
//! the others' wait at once). Then the communicator is aborted and the error
//! names the rank, the world size and the time waited, and
//! [`super::run_cuda`] reports the failed rank's own error rather than the
//! waits it cut short.
//!
//! On a non-blocking communicator every NCCL call may return before its
//! work is on the stream, so each collective then polls (within the same
//! limit) until NCCL has enqueued it. A communicator that failed or is still
//! busy is aborted when dropped, a ready one destroyed.

use std::ffi::{OsStr, c_int};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl, sys};

use super::DeviceSlice;
use crate::comm::Communicator;
use crate::error::{Result, RuntimeError};
use crate::kernel::ReduceOp;
use crate::program::DType;

/// How long a rank waits for the others to join by default.
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(120);
/// The environment variable that overrides [`DEFAULT_INIT_TIMEOUT`]
/// (seconds, a positive number, fractions allowed).
pub const INIT_TIMEOUT_ENV: &str = "MEMPLAN_NCCL_INIT_TIMEOUT_S";
/// The pause between two polls of a communicator being set up.
const INIT_POLL: Duration = Duration::from_millis(1);

pub(super) fn error(call: &str, e: nccl::NcclError) -> RuntimeError {
    RuntimeError::Device {
        library: "NCCL",
        call: call.to_string(),
        why: format!("{:?}", e.0),
    }
}

/// The set-up timeout: `MEMPLAN_NCCL_INIT_TIMEOUT_S` if set, else
/// [`DEFAULT_INIT_TIMEOUT`].
pub fn init_timeout() -> Result<Duration> {
    parse_timeout(std::env::var_os(INIT_TIMEOUT_ENV).as_deref())
}

fn parse_timeout(value: Option<&OsStr>) -> Result<Duration> {
    let Some(value) = value else {
        return Ok(DEFAULT_INIT_TIMEOUT);
    };
    value
        .to_str()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            RuntimeError::InvalidSetting(format!(
                "{INIT_TIMEOUT_ENV}={value:?}: expected a positive number of seconds"
            ))
        })
}

/// `NCCL_CONFIG_INITIALIZER` (every option undefined, so NCCL's default)
/// with `blocking = 0`. cudarc has no initializer, so this spells out its
/// `ncclConfig_t` (NCCL 2.30's); a field cudarc adds breaks the build here
/// instead of staying 0, which NCCL would read as a value. An older NCCL
/// reads only the fields it knows (it takes the smaller of the two sizes).
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef, // NCCL_API_MAGIC
        version: 2_30_00,   // NCCL_VERSION(2, 30, 0): the layout above
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Where a non-blocking communicator's last operation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Ready,
    Busy,
    Failed(sys::ncclResult_t),
}

fn state(comm: sys::ncclComm_t) -> State {
    use sys::ncclResult_t::{ncclInProgress, ncclSuccess};
    let mut status = ncclSuccess;
    // SAFETY: `comm` is a live communicator; NCCL writes `status`.
    let r = unsafe { sys::ncclCommGetAsyncError(comm, &mut status) };
    match (r, status) {
        (ncclSuccess, ncclSuccess) => State::Ready,
        (ncclSuccess, ncclInProgress) => State::Busy,
        (ncclSuccess, e) | (e, _) => State::Failed(e),
    }
}

/// Polls `comm` until it is not busy, `limit` has passed since `since`, or
/// `give_up` is set (then it stays busy), sleeping `pause` between polls
/// (yielding if `None`).
fn wait(
    comm: sys::ncclComm_t,
    since: Instant,
    limit: Duration,
    pause: Option<Duration>,
    give_up: &AtomicBool,
) -> State {
    loop {
        match state(comm) {
            State::Busy if since.elapsed() < limit && !give_up.load(Ordering::Relaxed) => {
                match pause {
                    Some(p) => std::thread::sleep(p),
                    None => std::thread::yield_now(),
                }
            }
            s => return s,
        }
    }
}

/// The result code of a call through cudarc's `result` wrappers.
fn code<T>(r: std::result::Result<T, nccl::NcclError>) -> sys::ncclResult_t {
    r.map_or_else(|e| e.0, |_| sys::ncclResult_t::ncclSuccess)
}

/// One rank's NCCL communicator (non-blocking; see the module docs).
pub struct NcclComm {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    timeout: Duration,
}

// SAFETY: an NCCL communicator may be used from the thread that owns it;
// the executor never shares it between threads.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the group `id` as `rank` of `world` on `ctx`'s device. Returns
    /// when every rank has joined, or fails after `timeout` or as soon as
    /// `another_failed` is set (a rank that failed before joining).
    pub fn new(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        id: sys::ncclUniqueId,
        timeout: Duration,
        another_failed: &AtomicBool,
    ) -> Result<NcclComm> {
        ctx.bind_to_thread().map_err(|e| RuntimeError::Device {
            library: "CUDA",
            call: "cuCtxSetCurrent".into(),
            why: format!("{e:?}"),
        })?;
        let since = Instant::now();
        let mut config = nonblocking_config();
        let mut comm = std::ptr::null_mut();
        // SAFETY: NCCL writes `comm` and copies `config` during the call.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, world as i32, id, rank as i32, &mut config)
        };
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            // NCCL has freed the communicator already.
            return Err(error("ncclCommInitRankConfig", nccl::NcclError(r)));
        }
        // From here a failure drops (aborts) the communicator.
        let comm = NcclComm {
            comm,
            rank,
            world,
            timeout,
        };
        match wait(comm.comm, since, timeout, Some(INIT_POLL), another_failed) {
            State::Ready => Ok(comm),
            State::Failed(e) => Err(error("ncclCommInitRankConfig", nccl::NcclError(e))),
            State::Busy => Err(RuntimeError::CommInitTimeout {
                rank,
                world,
                timeout: since.elapsed().min(timeout),
            }),
        }
    }

    /// Waits until NCCL has enqueued the collective `op` that `call`
    /// started with result `r`.
    fn enqueued(&self, op: &'static str, call: &str, r: sys::ncclResult_t) -> Result<()> {
        let since = Instant::now();
        let state = match r {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => wait(
                self.comm,
                since,
                self.timeout,
                None,
                &AtomicBool::new(false),
            ),
            e => State::Failed(e),
        };
        match state {
            State::Ready => Ok(()),
            State::Failed(e) => Err(error(call, nccl::NcclError(e))),
            State::Busy => Err(RuntimeError::Comm {
                op,
                rank: self.rank,
                why: format!(
                    "{call} was not enqueued within {:?}; another rank probably failed",
                    self.timeout
                ),
            }),
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitRankConfig, released once. Destroying
        // a failed or busy communicator would return its error or wait.
        let _ = unsafe {
            match state(self.comm) {
                State::Ready => sys::ncclCommDestroy(self.comm),
                _ => sys::ncclCommAbort(self.comm),
            }
        };
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

/// NCCL's name for a collective's dtype (f32 or bf16: the lowering emits
/// no other).
fn nccl_type(d: DType) -> sys::ncclDataType_t {
    if d == DType::BF16 {
        sys::ncclDataType_t::ncclBfloat16
    } else {
        sys::ncclDataType_t::ncclFloat32
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
        let r = code(unsafe {
            nccl::all_gather(
                shard.ptr as *const _,
                full.ptr as *mut _,
                shard.len,
                nccl_type(shard.dtype),
                self.comm,
                full.stream as _,
            )
        });
        self.enqueued("all_gather", "ncclAllGather", r)
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
        let r = code(unsafe {
            nccl::reduce_scatter(
                full.ptr as *const _,
                shard.ptr as *mut _,
                shard.len,
                nccl_type(shard.dtype),
                red(op),
                self.comm,
                shard.stream as _,
            )
        });
        self.enqueued("reduce_scatter", "ncclReduceScatter", r)
    }
    fn all_reduce(&self, buf: &mut DeviceSlice, op: ReduceOp) -> Result<()> {
        // SAFETY: as above (in place).
        let r = code(unsafe {
            nccl::all_reduce(
                buf.ptr as *const _,
                buf.ptr as *mut _,
                buf.len,
                nccl_type(buf.dtype),
                red(op),
                self.comm,
                buf.stream as _,
            )
        });
        self.enqueued("all_reduce", "ncclAllReduce", r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &str) -> Result<Duration> {
        parse_timeout(Some(OsStr::new(v)))
    }

    #[test]
    fn timeout_defaults_when_unset() {
        assert_eq!(parse_timeout(None), Ok(DEFAULT_INIT_TIMEOUT));
    }

    #[test]
    fn timeout_parses_seconds() {
        assert_eq!(parse("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse(" 0.25 "), Ok(Duration::from_millis(250)));
    }

    #[test]
    fn timeout_rejects_what_is_not_a_positive_number() {
        for bad in ["", "abc", "0", "-1", "NaN", "inf", "1e-12", "10s"] {
            let e = parse(bad).expect_err(bad);
            assert!(matches!(e, RuntimeError::InvalidSetting(_)), "{bad}: {e}");
            assert!(e.to_string().contains(INIT_TIMEOUT_ENV), "{e}");
        }
    }

    #[test]
    fn config_is_the_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafebeef, 23000, 0));
        assert_eq!((c.minCTAs, c.maxCTAs), (c_int::MIN, c_int::MIN));
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn timeout_error_names_rank_world_and_limit() {
        let e = RuntimeError::CommInitTimeout {
            rank: 1,
            world: 4,
            timeout: Duration::from_secs(120),
        };
        let msg = e.to_string();
        for part in ["rank 1 of 4", "120s", "never joined", INIT_TIMEOUT_ENV] {
            assert!(msg.contains(part), "{msg}");
        }
    }
}
