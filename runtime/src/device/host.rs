//! `kernels.cu` itself, compiled for the host (feature `host-kernels`; see
//! `host_kernels.cpp` for how CUDA's threads, barriers, warp shuffles and
//! atomics are stood in for). The emulator can launch these instead of its
//! Rust mirrors ([`super::emulate::Emulator::use_host_kernels`]), so the
//! device tests check the CUDA source's own indexing, tiling, bf16
//! rounding and reductions against the CPU executor.

use std::ffi::{CString, c_char, c_int, c_void};

use super::{Launch, kernel_params};
use crate::error::{Result, RuntimeError};

unsafe extern "C" {
    fn memplan_host_launch(
        name: *const c_char,
        grid: u32,
        block: u32,
        params: *mut *mut c_void,
    ) -> c_int;
}

fn failed(l: &Launch, why: String) -> RuntimeError {
    RuntimeError::Device {
        library: "host kernels",
        call: format!("launch of {}", l.kernel.name()),
        why,
    }
}

/// Runs launch `l` of `kernels.cu` on `mem`, the emulated device
/// allocation (offsets are into it); `step` is the step number
/// [`super::Arg::Step`] counts from.
///
/// The kernels read and write `mem` through raw pointers wherever the
/// lowering's offsets say: `l` must come from lowering a validated program
/// for a layout of `mem`'s size (what the emulator does).
pub fn launch(l: &Launch, mem: &mut [u8], step: u64) -> Result<()> {
    let base = mem.as_mut_ptr() as u64;
    if base % 16 != 0 {
        return Err(failed(
            l,
            format!("memory at {base:#x} is not 16-byte aligned"),
        ));
    }
    let mut vals = kernel_params(l, base, step);
    let mut params: Vec<*mut c_void> = vals
        .iter_mut()
        .map(|v| v.as_mut_ptr() as *mut c_void)
        .collect();
    let name = CString::new(l.kernel.name()).expect("kernel names have no NUL");
    // SAFETY: the parameters match the kernel's signature (the slots are
    // laid out as for cuLaunchKernel) and point into `mem`, which outlives
    // the call; see the function's contract.
    let rc = unsafe { memplan_host_launch(name.as_ptr(), l.grid, l.block, params.as_mut_ptr()) };
    match rc {
        0 => Ok(()),
        1 => Err(failed(l, "the host build has no such kernel".into())),
        _ => Err(failed(l, format!("bad block size {}", l.block))),
    }
}
