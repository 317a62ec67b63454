//! The CUDA executor (feature `cuda`): one `cuMemAlloc`'d allocation of
//! the arena plus a documented workspace, the device operations of
//! [`crate::device`] issued on one CUDA stream per plan stream, events for
//! the cross-stream waits of [`crate::schedule`], cuBLAS for matrix
//! products, NVRTC-compiled kernels (`device/kernels.cu`) for the rest, and
//! collectives through a [`Communicator`] over device memory — NCCL for
//! several GPUs.
//!
//! CUDA, cuBLAS, NVRTC and NCCL are loaded at run time (cudarc's dynamic
//! loading): a missing library is reported as an error naming it, before
//! any call. cudarc panics on some failures (a symbol missing from an old
//! driver); [`run_cuda`] turns any such panic into an error.
//!
//! Memory measured: `cuMemGetInfo`'s free bytes are read after the context,
//! kernels, cuBLAS handles and NCCL communicator exist and before the one
//! allocation (the baseline); during each step a thread samples them every
//! few microseconds and keeps the lowest. Baseline minus that low-water mark
//! is the step's peak: the arena, the workspace (staging, a 32 MiB cuBLAS
//! workspace per computing stream, one error word), the driver's rounding of
//! the allocation to its page size, and anything a library allocated during
//! the step, even if it freed it again before the step ended.

pub mod compile;
pub mod nccl;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaStream, result as drv, sys as drv_sys,
};

use crate::binding::Bindings;
use crate::comm::Communicator;
use crate::device::{
    AttentionLowering, CollectiveOp, DevKernel, DevOp, DeviceLayout, GemmCall, Launch,
    kernel_params, lower_all,
};
use crate::error::{Result, RuntimeError};
use crate::executor::{Executor, StepReport, accessed};
use crate::program::{DType, Program, TensorIdx};
use crate::runner::{RankRun, RunConfig, RunReport, report, run_rank};
use crate::schedule::Schedule;

pub use nccl::NcclComm;

fn driver(call: &str, e: drv::DriverError) -> RuntimeError {
    let why = if e.0 == drv_sys::cudaError_enum::CUDA_ERROR_STUB_LIBRARY {
        "the libcuda.so that was loaded is the CUDA toolkit's stub (a stubs/ directory on \
         LD_LIBRARY_PATH), not the driver's; remove that directory from LD_LIBRARY_PATH"
            .to_string()
    } else {
        format!("{e:?}")
    };
    RuntimeError::Device {
        library: "CUDA",
        call: call.to_string(),
        why,
    }
}

/// The device's lowest free memory while a step runs: a thread samples
/// `cuMemGetInfo` until stopped, so memory a library allocates and frees
/// during the step is seen too (unless it lives less than one sampling
/// interval, a few microseconds).
struct Watermark {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<usize>>>,
}

impl Drop for Watermark {
    /// A step that fails part-way still stops the sampler.
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Watermark {
    fn start(ctx: &Arc<CudaContext>) -> Watermark {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ctx, flag) = (ctx.clone(), stop.clone());
        let thread = std::thread::spawn(move || -> Result<usize> {
            ctx.bind_to_thread()
                .map_err(|e| driver("cuCtxSetCurrent (memory watermark)", e))?;
            let mut low = usize::MAX;
            loop {
                let done = flag.load(std::sync::atomic::Ordering::Acquire);
                let (free, _) = drv::mem_get_info().map_err(|e| driver("cuMemGetInfo", e))?;
                low = low.min(free);
                if done {
                    return Ok(low);
                }
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
        });
        Watermark {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops sampling (after one last sample) and returns the lowest free
    /// bytes seen.
    fn finish(mut self) -> Result<usize> {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let thread = self.thread.take().expect("finish runs once");
        thread.join().unwrap_or_else(|_| {
            Err(RuntimeError::Device {
                library: "CUDA",
                call: "the memory watermark thread".into(),
                why: "it panicked".into(),
            })
        })
    }
}

fn cublas(call: &str, e: blas::CublasError) -> RuntimeError {
    RuntimeError::Device {
        library: "cuBLAS",
        call: call.to_string(),
        why: format!("{e:?}"),
    }
}

/// Checks the shared libraries the executor needs can be loaded.
pub fn check_libraries(need_nccl: bool) -> Result<()> {
    let missing = |lib: &str, what: &str| {
        RuntimeError::Unavailable(
            "CUDA",
            format!(
                "the {what} library ({lib}) could not be loaded; install it or add its directory to LD_LIBRARY_PATH"
            ),
        )
    };
    // SAFETY: these only try to open the libraries.
    unsafe {
        if !drv_sys::is_culib_present() {
            return Err(missing("libcuda.so", "CUDA driver"));
        }
        if !blas_sys::is_culib_present() {
            return Err(missing("libcublas.so", "cuBLAS"));
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(missing("libnvrtc.so", "NVRTC"));
        }
        if need_nccl && !cudarc::nccl::sys::is_culib_present() {
            return Err(missing("libnccl.so", "NCCL"));
        }
    }
    Ok(())
}

/// A device region of `len` elements of `dtype` (f32 or bf16) and the
/// stream a collective on it runs on.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice {
    pub ptr: drv_sys::CUdeviceptr,
    pub len: usize,
    pub dtype: DType,
    pub stream: drv_sys::CUstream,
}

/// The communicator of a world of one GPU: gathers and scatters are copies.
impl Communicator<DeviceSlice> for crate::comm::SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_gather(&self, shard: &DeviceSlice, full: &mut DeviceSlice) -> Result<()> {
        copy_slice("all_gather", shard, full)
    }
    fn reduce_scatter(
        &self,
        full: &DeviceSlice,
        shard: &mut DeviceSlice,
        _: crate::ReduceOp,
    ) -> Result<()> {
        copy_slice("reduce_scatter", full, shard)
    }
    fn all_reduce(&self, _: &mut DeviceSlice, _: crate::ReduceOp) -> Result<()> {
        Ok(())
    }
}

fn copy_slice(op: &'static str, src: &DeviceSlice, dst: &mut DeviceSlice) -> Result<()> {
    if src.len != dst.len {
        return Err(RuntimeError::Comm {
            op,
            rank: 0,
            why: format!("{} elements into {}", src.len, dst.len),
        });
    }
    if src.ptr != dst.ptr && src.len > 0 {
        // SAFETY: both regions lie in the executor's allocation.
        let bytes = src.dtype.size() as usize * src.len;
        unsafe { drv::memcpy_dtod_async(dst.ptr, src.ptr, bytes, dst.stream) }
            .map_err(|e| driver("cuMemcpyDtoDAsync", e))?;
    }
    Ok(())
}

/// A cuBLAS handle bound to one stream, with its workspace.
struct Blas(blas_sys::cublasHandle_t);

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle`, destroyed once.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// The one device allocation.
struct DeviceMem {
    ptr: drv_sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `malloc_sync`, freed once; streams were
        // synchronized by the executor's drop.
        let _ = unsafe { drv::free_sync(self.ptr) };
    }
}

/// Runs a [`Program`] on one GPU; see the module docs.
pub struct CudaExecutor {
    program: Program,
    layout: DeviceLayout,
    ops: Vec<Vec<DevOp>>,
    schedule: Schedule,
    ctx: Arc<CudaContext>,
    streams: Vec<Arc<CudaStream>>,
    events: Vec<Option<CudaEvent>>,
    blas: Vec<Option<Blas>>,
    funcs: HashMap<DevKernel, CudaFunction>,
    mem: Option<DeviceMem>,
    baseline_free: usize,
    rank: usize,
    steps_done: u64,
    /// With profiling on: a timing event before and after each
    /// instruction, on its stream.
    timing: Option<Vec<(CudaEvent, CudaEvent)>>,
}

impl CudaExecutor {
    /// Validates and lowers `program` and sets up device `ordinal` for rank
    /// `rank`: context, streams, events, kernels, cuBLAS. Allocates nothing
    /// for the program yet: create communicators, then [`Self::allocate`].
    pub fn new(program: Program, ordinal: usize, rank: usize) -> Result<CudaExecutor> {
        CudaExecutor::with_attention(program, ordinal, rank, AttentionLowering::Flash)
    }

    /// As [`Self::new`], fused attention lowered as `attention` says.
    pub fn with_attention(
        program: Program,
        ordinal: usize,
        rank: usize,
        attention: AttentionLowering,
    ) -> Result<CudaExecutor> {
        program.validate()?;
        check_libraries(false)?;
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| driver(&format!("creating a context on device {ordinal}"), e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| driver("cuDeviceGetAttribute(compute capability)", e))?;
        let attention = attention.resolved(major);
        let bindings = Bindings::new(&program)?;
        let layout = DeviceLayout::with_attention(&program, &bindings, attention);
        let ops = lower_all(&program, &bindings, &layout)?;
        let schedule = Schedule::new(&program, &bindings);
        let streams = (0..program.num_streams())
            .map(|_| ctx.new_stream().map_err(|e| driver("cuStreamCreate", e)))
            .collect::<Result<Vec<_>>>()?;
        let events = schedule
            .signals
            .iter()
            .map(|&s| {
                s.then(|| ctx.new_event(None).map_err(|e| driver("cuEventCreate", e)))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        if attention == AttentionLowering::TensorCores && major < 8 {
            return Err(RuntimeError::Unavailable(
                "CUDA",
                format!(
                    "tensor-core attention (mma.sync with bf16) needs compute capability 8.0 \
                     or later; device {ordinal} has {major}.{minor}: use the flash kernels"
                ),
            ));
        }
        let kernels = compile::compile_kernels(major, minor)?;
        let module = ctx
            .load_module(kernels.image)
            .map_err(|e| driver("cuModuleLoadData", e))?;
        let mut funcs = HashMap::new();
        for k in DevKernel::ALL {
            let f = module
                .load_function(k.name())
                .map_err(|e| driver(&format!("cuModuleGetFunction({})", k.name()), e))?;
            funcs.insert(k, f);
        }
        let blas = layout
            .blas
            .iter()
            .enumerate()
            .map(|(s, ws)| {
                ws.map(|_| {
                    let h = blas::create_handle().map_err(|e| cublas("cublasCreate", e))?;
                    let h = Blas(h);
                    // SAFETY: a live handle and stream.
                    unsafe { blas::set_stream(h.0, streams[s].cu_stream() as _) }
                        .map_err(|e| cublas("cublasSetStream", e))?;
                    Ok(h)
                })
                .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CudaExecutor {
            program,
            layout,
            ops,
            schedule,
            ctx,
            streams,
            events,
            blas,
            funcs,
            mem: None,
            baseline_free: 0,
            rank,
            steps_done: 0,
            timing: None,
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream collectives of stream `s` run on.
    pub fn stream(&self, s: usize) -> &Arc<CudaStream> {
        &self.streams[s]
    }
    pub fn layout(&self) -> &DeviceLayout {
        &self.layout
    }

    /// Reads the baseline free memory, then makes the one allocation
    /// (arena + workspace), zeroes it and hands the cuBLAS workspaces out.
    pub fn allocate(&mut self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        self.ctx
            .synchronize()
            .map_err(|e| driver("cuCtxSynchronize", e))?;
        let (free, _) = drv::mem_get_info().map_err(|e| driver("cuMemGetInfo", e))?;
        self.baseline_free = free;
        let bytes = self.layout.total as usize;
        // SAFETY: a plain allocation, freed by `DeviceMem`.
        let ptr = match unsafe { drv::malloc_sync(bytes) } {
            Ok(p) => p,
            Err(e) if e.0 == drv_sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(RuntimeError::OutOfMemory {
                    device: format!("cuda:{}", self.ctx.ordinal()),
                    bytes: bytes as u64,
                    what: format!(
                        "the arena ({} bytes) and workspace ({} bytes); {free} bytes were free",
                        self.layout.arena,
                        self.layout.workspace()
                    ),
                });
            }
            Err(e) => return Err(driver("cuMemAlloc", e)),
        };
        self.mem = Some(DeviceMem {
            ptr,
            ctx: self.ctx.clone(),
        });
        // SAFETY: inside the allocation just made.
        unsafe { drv::memset_d8_sync(ptr, 0, bytes) }.map_err(|e| driver("cuMemsetD8", e))?;
        for (h, ws) in self.blas.iter().zip(&self.layout.blas) {
            if let (Some(h), Some(off)) = (h, ws) {
                // SAFETY: the workspace lies in the allocation and only this
                // handle (bound to one stream) uses it.
                unsafe {
                    blas_sys::cublasSetWorkspace_v2(
                        h.0,
                        (ptr + off) as *mut c_void,
                        crate::device::CUBLAS_WORKSPACE as usize,
                    )
                }
                .result()
                .map_err(|e| cublas("cublasSetWorkspace", e))?;
            }
        }
        Ok(())
    }

    fn base(&self) -> Result<drv_sys::CUdeviceptr> {
        self.mem.as_ref().map(|m| m.ptr).ok_or_else(|| {
            RuntimeError::InvalidProgram(
                "the executor has not allocated its memory yet (call allocate)".into(),
            )
        })
    }

    /// The address of tensor `t`, which must hold `len` elements of one of
    /// `dtypes`.
    fn checked(&self, t: TensorIdx, dtypes: &[DType], len: usize) -> Result<u64> {
        Ok(self.base()? + accessed(&self.program, t, dtypes, Some(len))?.offset)
    }

    fn launch(&self, l: &Launch, base: u64, stream: &CudaStream, step: u64) -> Result<()> {
        let f = &self.funcs[&l.kernel];
        let mut vals = kernel_params(l, base, step);
        // Each parameter is read from the start of its 16-byte slot: 4-byte
        // values sit in the low half of the first word (little-endian).
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v.as_mut_ptr() as *mut c_void)
            .collect();
        // SAFETY: the arguments match the kernel's signature in kernels.cu
        // (checked on the host by the emulator tests) and point into the
        // allocation.
        unsafe {
            drv::launch_kernel(
                f.cu_function(),
                (l.grid, 1, 1),
                (l.block, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| driver(&format!("cuLaunchKernel({})", l.kernel.name()), e))
    }

    fn gemm(&self, g: &GemmCall, base: u64, s: usize) -> Result<()> {
        let h = self.blas[s].as_ref().ok_or_else(|| {
            RuntimeError::InvalidProgram(format!(
                "stream {s} runs a matrix product but has no cuBLAS handle"
            ))
        })?;
        let op = |t| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let ty = |d: DType| {
            if d == DType::BF16 {
                blas_sys::cudaDataType::CUDA_R_16BF
            } else {
                blas_sys::cudaDataType::CUDA_R_32F
            }
        };
        let (a, b, c) = (
            (base + g.a) as *const c_void,
            (base + g.b) as *const c_void,
            (base + g.c) as *mut c_void,
        );
        let (alpha, beta) = (
            &g.alpha as *const f32 as *const c_void,
            &g.beta as *const f32 as *const c_void,
        );
        let compute = blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        // SAFETY: pointers into the allocation with the shapes and dtypes
        // the lowering computed; alpha and beta (f32, as the compute type
        // wants) live on the host for the call.
        unsafe {
            if g.batch == 1 {
                blas::gemm_ex(
                    h.0,
                    op(g.transa),
                    op(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    alpha,
                    a,
                    ty(g.ab),
                    g.lda,
                    b,
                    ty(g.ab),
                    g.ldb,
                    beta,
                    c,
                    ty(g.c_dtype),
                    g.ldc,
                    compute,
                    algo,
                )
                .map_err(|e| cublas("cublasGemmEx", e))
            } else {
                blas::gemm_strided_batched_ex(
                    h.0,
                    op(g.transa),
                    op(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    alpha,
                    a,
                    ty(g.ab),
                    g.lda,
                    g.stride_a,
                    b,
                    ty(g.ab),
                    g.ldb,
                    g.stride_b,
                    beta,
                    c,
                    ty(g.c_dtype),
                    g.ldc,
                    g.stride_c,
                    g.batch,
                    compute,
                    algo,
                )
                .map_err(|e| cublas("cublasGemmStridedBatchedEx", e))
            }
        }
    }

    /// Each instruction's seconds from its timing events (after the step).
    fn instr_seconds(&self) -> Result<Vec<f64>> {
        let Some(timing) = &self.timing else {
            return Ok(Vec::new());
        };
        timing
            .iter()
            .map(|(a, b)| {
                a.elapsed_ms(b)
                    .map(|ms| ms as f64 / 1e3)
                    .map_err(|e| driver("cuEventElapsedTime", e))
            })
            .collect()
    }
}

impl Executor for CudaExecutor {
    type Buffer = DeviceSlice;

    fn program(&self) -> &Program {
        &self.program
    }
    fn rank(&self) -> usize {
        self.rank
    }
    /// The one device allocation (arena + workspace, the cuBLAS one
    /// included).
    fn allocated_bytes(&self) -> u64 {
        self.layout.total
    }

    /// Writes float tensor `t` (rounded to bf16 on the host, when it is
    /// bf16).
    fn write_f32(&mut self, t: TensorIdx, v: &[f32]) -> Result<()> {
        let at = self.checked(t, &[DType::F32, DType::BF16], v.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: the tensor lies in the allocation; the device is idle.
        if self.program.tensor(t).dtype == DType::BF16 {
            let h: Vec<u16> = v
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect();
            unsafe { drv::memcpy_htod_sync(at, &h) }
        } else {
            unsafe { drv::memcpy_htod_sync(at, v) }
        }
        .map_err(|e| driver("cuMemcpyHtoD", e))
    }
    fn write_i32(&mut self, t: TensorIdx, v: &[i32]) -> Result<()> {
        let at = self.checked(t, &[DType::I32], v.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: as above.
        unsafe { drv::memcpy_htod_sync(at, v) }.map_err(|e| driver("cuMemcpyHtoD", e))
    }
    fn read_f32(&self, t: TensorIdx) -> Result<Vec<f32>> {
        let n = self
            .program
            .tensors
            .get(t.index())
            .map_or(0, |x| x.elements() as usize);
        let at = self.checked(t, &[DType::F32, DType::BF16], n)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        if self.program.tensor(t).dtype == DType::BF16 {
            let mut h = vec![0u16; n];
            // SAFETY: as above.
            unsafe { drv::memcpy_dtoh_sync(&mut h, at) }.map_err(|e| driver("cuMemcpyDtoH", e))?;
            return Ok(h
                .into_iter()
                .map(|b| half::bf16::from_bits(b).to_f32())
                .collect());
        }
        let mut v = vec![0.0f32; n];
        // SAFETY: as above.
        unsafe { drv::memcpy_dtoh_sync(&mut v, at) }.map_err(|e| driver("cuMemcpyDtoH", e))?;
        Ok(v)
    }

    /// Times each instruction of the following steps with a pair of CUDA
    /// events on its stream.
    fn set_profiling(&mut self, on: bool) -> Result<()> {
        self.timing = if on {
            let timed = Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT);
            let event = || {
                self.ctx
                    .new_event(timed)
                    .map_err(|e| driver("cuEventCreate", e))
            };
            Some(
                (0..self.ops.len())
                    .map(|_| Ok((event()?, event()?)))
                    .collect::<Result<Vec<_>>>()?,
            )
        } else {
            None
        };
        Ok(())
    }

    /// Runs one step; [`StepReport::used_bytes`] is the device memory it
    /// used, from the watermark.
    fn step(&mut self, comm: &dyn Communicator<DeviceSlice>) -> Result<StepReport> {
        let base = self.base()?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver("cuCtxSetCurrent", e))?;
        let ew = base + self.layout.error_word;
        // SAFETY: the error word lies in the allocation; the device is idle.
        unsafe { drv::memset_d8_sync(ew, 0, 4) }.map_err(|e| driver("cuMemsetD8", e))?;
        let step = self.steps_done + 1;
        let watermark = Watermark::start(&self.ctx);
        let start = Instant::now();
        for (j, ops) in self.ops.iter().enumerate() {
            let s = self.program.instrs[j].stream.index();
            let stream = &self.streams[s];
            for w in &self.schedule.waits[j] {
                let ev = self.events[w.index()]
                    .as_ref()
                    .expect("waited-for instructions signal");
                stream
                    .wait(ev)
                    .map_err(|e| driver("cuStreamWaitEvent", e))?;
            }
            if let Some(timing) = &self.timing {
                timing[j]
                    .0
                    .record(stream)
                    .map_err(|e| driver("cuEventRecord", e))?;
            }
            for op in ops {
                match op {
                    DevOp::Launch(l) => self.launch(l, base, stream, step)?,
                    DevOp::Gemm(g) => self.gemm(g, base, s)?,
                    // SAFETY (memset, copy): regions inside the allocation.
                    DevOp::Memset { at, bytes } => unsafe {
                        drv::memset_d8_async(base + at, 0, *bytes as usize, stream.cu_stream())
                    }
                    .map_err(|e| driver("cuMemsetD8Async", e))?,
                    DevOp::Copy { src, dst, bytes } => unsafe {
                        drv::memcpy_dtod_async(
                            base + dst,
                            base + src,
                            *bytes as usize,
                            stream.cu_stream(),
                        )
                    }
                    .map_err(|e| driver("cuMemcpyDtoDAsync", e))?,
                    DevOp::Collective(c) => {
                        let sl = |at: u64, len: u64, dtype: DType| DeviceSlice {
                            ptr: base + at,
                            len: len as usize,
                            dtype,
                            stream: stream.cu_stream(),
                        };
                        let w = comm.world_size() as u64;
                        match *c {
                            CollectiveOp::AllGather {
                                send,
                                recv,
                                count,
                                dtype,
                            } => comm.all_gather(
                                &sl(send, count, dtype),
                                &mut sl(recv, w * count, dtype),
                            )?,
                            CollectiveOp::ReduceScatter {
                                send,
                                recv,
                                count,
                                op,
                                dtype,
                            } => comm.reduce_scatter(
                                &sl(send, w * count, dtype),
                                &mut sl(recv, count, dtype),
                                op,
                            )?,
                            CollectiveOp::AllReduce {
                                buf,
                                count,
                                op,
                                dtype,
                            } => comm.all_reduce(&mut sl(buf, count, dtype), op)?,
                        }
                    }
                }
            }
            if let Some(timing) = &self.timing {
                timing[j]
                    .1
                    .record(stream)
                    .map_err(|e| driver("cuEventRecord", e))?;
            }
            if let Some(ev) = &self.events[j] {
                ev.record(stream).map_err(|e| driver("cuEventRecord", e))?;
            }
        }
        for s in &self.streams {
            s.synchronize()
                .map_err(|e| driver("cuStreamSynchronize (running the step)", e))?;
        }
        let seconds = start.elapsed().as_secs_f64();
        let free = watermark.finish()?;
        let mut code = [0i32; 1];
        // SAFETY: as above.
        unsafe { drv::memcpy_dtoh_sync(&mut code, ew) }.map_err(|e| driver("cuMemcpyDtoH", e))?;
        if code[0] != 0 {
            let ins = &self.program.instrs[code[0] as usize - 1];
            return Err(RuntimeError::Kernel {
                instr: ins.name.clone(),
                kernel: ins.kernel.name(),
                why: "an index (token id or target) is out of range".into(),
            });
        }
        self.steps_done = step;
        Ok(StepReport {
            seconds,
            step,
            instr_seconds: self.instr_seconds()?,
            used_bytes: self.baseline_free.saturating_sub(free) as u64,
        })
    }
}

impl Drop for CudaExecutor {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }
}

/// Runs `cfg.steps` steps of `p` on GPUs `first_gpu ..` (one thread per
/// rank, NCCL between them when there are several).
pub fn run_cuda(p: &Program, cfg: &RunConfig, first_gpu: usize) -> Result<RunReport> {
    caught(|| run_cuda_inner(p, cfg, first_gpu))
}

/// Runs `f`, turning a panic into an error.
fn caught<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| Err(panicked(p)))
}

fn panicked(payload: Box<dyn std::any::Any + Send>) -> RuntimeError {
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    RuntimeError::Device {
        library: "cudarc",
        call: "a CUDA library call".into(),
        why: format!("it panicked: {msg}"),
    }
}

fn one_rank(
    p: &Program,
    cfg: &RunConfig,
    gpu: usize,
    rank: usize,
    nccl: Option<(cudarc::nccl::sys::ncclUniqueId, Duration, &AtomicBool)>,
) -> Result<RankRun> {
    let mut ex = CudaExecutor::with_attention(p.clone(), gpu, rank, cfg.attention)?;
    let world = p.world_size as usize;
    let comm: Box<dyn Communicator<DeviceSlice>> = match nccl {
        None => Box::new(crate::comm::SingleRank),
        Some((id, timeout, failed)) => Box::new(NcclComm::new(
            ex.context(),
            rank,
            world,
            id,
            timeout,
            failed,
        )?),
    };
    ex.allocate()?;
    let run = run_rank(&mut ex, comm.as_ref(), cfg);
    drop(comm);
    run
}

/// Runs every rank on its own thread, NCCL between them: rank `r` on GPU
/// `first_gpu + r % gpus` (its own GPU unless ranks share them).
fn run_ranks(p: &Program, cfg: &RunConfig, first_gpu: usize, gpus: usize) -> Result<Vec<RankRun>> {
    let timeout = nccl::init_timeout()?;
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| nccl::error("ncclGetUniqueId", e))?;
    // Set by a rank that fails, so the others stop waiting for it in
    // NCCL's set-up.
    let failed = &AtomicBool::new(false);
    let nccl = Some((id, timeout, failed));
    let outcomes = std::thread::scope(|s| {
        let hs: Vec<_> = (0..p.world_size as usize)
            .map(|r| {
                s.spawn(move || {
                    let run = caught(|| one_rank(p, cfg, first_gpu + r % gpus, r, nccl));
                    if run.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    (Instant::now(), run)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|e| (Instant::now(), Err(panicked(e))))
            })
            .collect()
    });
    first_failure(outcomes)
}

/// Every rank's run, or the error to report, named by rank: the earliest
/// failure other than an NCCL set-up timeout (a timeout follows another
/// rank's failure), else the earliest timeout. `outcomes[r]` is when rank
/// `r`'s thread finished and how.
fn first_failure<T>(outcomes: Vec<(Instant, Result<T>)>) -> Result<Vec<T>> {
    let (runs, mut failed): (Vec<_>, Vec<_>) = outcomes
        .into_iter()
        .enumerate()
        .partition(|(_, (_, r))| r.is_ok());
    failed.sort_by_key(|(rank, (at, r))| {
        let timeout = matches!(r, Err(RuntimeError::CommInitTimeout { .. }));
        (timeout, *at, *rank)
    });
    if let Some((rank, (_, Err(e)))) = failed.into_iter().next() {
        return Err(in_rank(rank, e));
    }
    Ok(runs.into_iter().filter_map(|(_, (_, r))| r.ok()).collect())
}

/// `e` as rank `rank`'s error, unless it names its rank already.
fn in_rank(rank: usize, e: RuntimeError) -> RuntimeError {
    match e {
        RuntimeError::Comm { .. }
        | RuntimeError::CommInitTimeout { .. }
        | RuntimeError::Rank { .. } => e,
        e => RuntimeError::Rank {
            rank,
            error: Box::new(e),
        },
    }
}

fn run_cuda_inner(p: &Program, cfg: &RunConfig, first_gpu: usize) -> Result<RunReport> {
    let world = p.world_size as usize;
    check_libraries(world > 1)?;
    // Every rank needs its own GPU: a rank without one would leave the
    // others waiting in NCCL's set-up forever.
    let count = CudaContext::device_count().map_err(|e| driver("cuDeviceGetCount", e))? as usize;
    // NCCL 2.30 and later can put several ranks on one GPU when asked
    // (NCCL_MULTI_RANK_GPU_ENABLE=1): then ranks share GPUs in turn.
    let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v == "1");
    if shared && world > 1 && first_gpu < count {
        return Ok(report(
            run_ranks(p, cfg, first_gpu, count - first_gpu)?,
            cfg,
            p,
        ));
    }
    if first_gpu + world > count {
        return Err(RuntimeError::Unavailable(
            "enough GPUs",
            format!(
                "world size {world} from GPU {first_gpu} needs GPUs {first_gpu}..{}, but this machine has {count}",
                first_gpu + world - 1
            ),
        ));
    }
    let per_rank: Vec<RankRun> = if world == 1 {
        vec![one_rank(p, cfg, first_gpu, 0, None)?]
    } else {
        run_ranks(p, cfg, first_gpu, world)?
    };
    Ok(report(per_rank, cfg, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeout(rank: usize) -> RuntimeError {
        RuntimeError::CommInitTimeout {
            rank,
            world: 3,
            timeout: Duration::from_secs(1),
        }
    }

    fn oom() -> RuntimeError {
        RuntimeError::OutOfMemory {
            device: "GPU 1".into(),
            bytes: 8,
            what: "the arena".into(),
        }
    }

    #[test]
    fn all_ranks_ok_gives_runs_in_rank_order() {
        let t = Instant::now();
        let runs = first_failure(vec![(t, Ok(0)), (t, Ok(1)), (t, Ok(2))]);
        assert_eq!(runs, Ok(vec![0, 1, 2]));
    }

    #[test]
    fn a_real_failure_wins_over_earlier_timeouts() {
        let t = Instant::now();
        let later = t + Duration::from_secs(5);
        let outcomes: Vec<(Instant, Result<u8>)> = vec![
            (t, Err(timeout(0))),
            (later, Err(oom())),
            (t, Err(timeout(2))),
        ];
        let e = first_failure(outcomes).unwrap_err();
        assert_eq!(
            e,
            RuntimeError::Rank {
                rank: 1,
                error: Box::new(oom())
            }
        );
        assert!(
            e.to_string().starts_with("rank 1: out of GPU 1 memory"),
            "{e}"
        );
    }

    #[test]
    fn the_earliest_real_failure_is_reported() {
        let t = Instant::now();
        let later = t + Duration::from_secs(1);
        let outcomes: Vec<(Instant, Result<u8>)> = vec![
            (later, Err(RuntimeError::InvalidProgram("late".into()))),
            (t, Err(RuntimeError::InvalidProgram("first".into()))),
            (t, Ok(2)),
        ];
        let e = first_failure(outcomes).unwrap_err();
        assert_eq!(e.to_string(), "rank 1: invalid program: first");
    }

    #[test]
    fn only_timeouts_report_the_earliest_unwrapped() {
        let t = Instant::now();
        let outcomes: Vec<(Instant, Result<u8>)> = vec![
            (t + Duration::from_millis(3), Err(timeout(0))),
            (t, Err(timeout(1))),
        ];
        assert_eq!(first_failure(outcomes), Err(timeout(1)));
    }

    #[test]
    fn errors_naming_their_rank_are_not_wrapped() {
        let comm = RuntimeError::Comm {
            op: "all_gather",
            rank: 2,
            why: "x".into(),
        };
        assert_eq!(in_rank(2, comm.clone()), comm);
        assert!(matches!(
            in_rank(0, oom()),
            RuntimeError::Rank { rank: 0, .. }
        ));
    }

    #[test]
    fn panics_become_errors() {
        let r: Result<()> = caught(|| panic!("boom"));
        assert!(r.unwrap_err().to_string().contains("it panicked: boom"));
    }
}
