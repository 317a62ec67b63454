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

#[cfg(test)]
mod tests {
    //! The tensor-core flash kernels against the f32 flash kernels, both
    //! from `kernels.cu` (the tensor-core products through the host's
    //! emulation of `mma.sync`), on the same bf16 operands.

    use super::launch;
    use crate::device::{Arg, Buf, DevKernel, Launch};
    use crate::init::{hash_key, normal};

    /// One attention's operands in an emulated allocation: regions of f32
    /// or bf16 elements at 256-byte boundaries.
    struct Mem {
        bytes: Vec<u8>,
        start: usize,
        end: u64,
    }

    impl Mem {
        fn new() -> Mem {
            let bytes = vec![0u8; 1 << 22];
            let start = bytes.as_ptr().align_offset(16);
            Mem {
                bytes,
                start,
                end: 0,
            }
        }
        fn region(&mut self, n: usize, bf16: bool) -> Buf {
            let at = self.end;
            self.end = (at + n as u64 * if bf16 { 2 } else { 4 }).div_ceil(256) * 256;
            assert!(self.end as usize + self.start <= self.bytes.len());
            Buf { at: Some(at), bf16 }
        }
        fn slice(&mut self) -> &mut [u8] {
            &mut self.bytes[self.start..]
        }
        fn write(&mut self, b: Buf, v: &[f32]) {
            let at = self.start + b.at.unwrap() as usize;
            for (i, &x) in v.iter().enumerate() {
                if b.bf16 {
                    let h = half::bf16::from_f32(x).to_bits().to_le_bytes();
                    self.bytes[at + 2 * i..at + 2 * i + 2].copy_from_slice(&h);
                } else {
                    self.bytes[at + 4 * i..at + 4 * i + 4].copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        fn read(&self, b: Buf, n: usize) -> Vec<f32> {
            let at = self.start + b.at.unwrap() as usize;
            (0..n)
                .map(|i| {
                    if b.bf16 {
                        let h = [self.bytes[at + 2 * i], self.bytes[at + 2 * i + 1]];
                        half::bf16::from_bits(u16::from_le_bytes(h)).to_f32()
                    } else {
                        let x = &self.bytes[at + 4 * i..at + 4 * i + 4];
                        f32::from_le_bytes(x.try_into().unwrap())
                    }
                })
                .collect()
        }
    }

    /// Largest |a − b| over the largest |b|.
    fn rel(a: &[f32], b: &[f32]) -> f32 {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        d / b.iter().map(|y| y.abs()).fold(1e-30, f32::max)
    }

    /// Launches `kernel` with a block per `rows` rows of each of
    /// `blocks_of` heads, as the lowering does.
    fn run(m: &mut Mem, kernel: DevKernel, rows: u64, blocks_of: u64, args: Vec<Arg>) {
        let l = Launch {
            kernel,
            grid: (blocks_of * SEQ.div_ceil(rows)) as u32,
            block: 128,
            args,
        };
        launch(&l, m.slice(), 1).unwrap();
    }

    const SEQ: u64 = 100;

    #[test]
    fn tensor_core_flash_kernels_match_the_f32_flash_kernels() {
        for (b, heads, kvh, hd) in [
            (1u64, 4u64, 2u64, 16u64),
            (1, 2, 1, 64),
            (2, 2, 2, 32),
            (1, 2, 1, 128),
            (1, 2, 2, 80),
        ] {
            let [fwd_tc, dq_tc, dkv_tc] = DevKernel::tensor_core_attention(hd);
            let t = SEQ;
            let width = (heads + 2 * kvh) * hd;
            let n_qkv = (b * t * width) as usize;
            let n_out = (b * t * heads * hd) as usize;
            let n_lse = (b * heads * t) as usize;
            let mut m = Mem::new();
            let qkv = m.region(n_qkv, true);
            let dout = m.region(n_out, true);
            let (out_f, out_m) = (m.region(n_out, false), m.region(n_out, false));
            let (lse_f, lse_m) = (m.region(n_lse, false), m.region(n_lse, false));
            let (dq_f, dq_m) = (m.region(n_qkv, false), m.region(n_qkv, false));
            let draw = |key: &str, n: usize, std: f32| {
                let h = hash_key(7, key);
                (0..n)
                    .map(|i| std * normal(h, i as u64))
                    .collect::<Vec<_>>()
            };
            m.write(qkv, &draw("qkv", n_qkv, 1.5));
            m.write(dout, &draw("dout", n_out, 1.0));
            let sizes = [b, heads, kvh, t, hd].map(|x| Arg::I64(x as i64));
            let scale = Arg::F32(1.0 / (hd as f32).sqrt());
            let fwd = |o: Buf, l: Buf| {
                let mut a = vec![Arg::Buf(qkv), Arg::Buf(o), Arg::Buf(l)];
                a.extend(sizes);
                a.push(scale);
                a
            };
            run(
                &mut m,
                DevKernel::FlashAttnFwd,
                16,
                b * heads,
                fwd(out_f, lse_f),
            );
            run(&mut m, fwd_tc, 64, b * heads, fwd(out_m, lse_m));
            let what = format!("B {b}, H {heads}, Hkv {kvh}, D {hd}");
            let (of, om) = (m.read(out_f, n_out), m.read(out_m, n_out));
            assert!(rel(&om, &of) < 1e-5, "{what}: out {}", rel(&om, &of));
            let (lf, lm) = (m.read(lse_f, n_lse), m.read(lse_m, n_lse));
            assert!(rel(&lm, &lf) < 1e-5, "{what}: lse {}", rel(&lm, &lf));
            // Both backward passes from the f32 kernels' forward results.
            let bwd = |d: Buf| {
                let mut a = [dout, qkv, out_f, lse_f, d].map(Arg::Buf).to_vec();
                a.extend(sizes);
                a.push(scale);
                a
            };
            run(&mut m, DevKernel::FlashAttnBwdDq, 16, b * heads, bwd(dq_f));
            run(&mut m, DevKernel::FlashAttnBwdDkv, 16, b * kvh, bwd(dq_f));
            run(&mut m, dq_tc, 64, b * heads, bwd(dq_m));
            run(&mut m, dkv_tc, 64, b * kvh, bwd(dq_m));
            let (gf, gm) = (m.read(dq_f, n_qkv), m.read(dq_m, n_qkv));
            // Each of dQ, dK and dV, by columns of the packed rows.
            for (part, cols) in [
                ("dQ", 0..heads * hd),
                ("dK", heads * hd..(heads + kvh) * hd),
                ("dV", (heads + kvh) * hd..width),
            ] {
                let pick = |v: &[f32]| {
                    v.chunks(width as usize)
                        .flat_map(|r| r[cols.start as usize..cols.end as usize].to_vec())
                        .collect::<Vec<_>>()
                };
                let (a, e) = (pick(&gm), pick(&gf));
                assert!(e.iter().any(|x| x.abs() > 1e-3), "{what}: {part} is zero");
                assert!(rel(&a, &e) < 2e-5, "{what}: {part} {}", rel(&a, &e));
            }
        }
    }
}
