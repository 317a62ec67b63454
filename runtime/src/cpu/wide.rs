//! bf16 on the CPU executor. Kernels compute in f32: before an instruction
//! runs, each bf16 operand is widened into an f32 copy on the heap, the
//! kernel runs on the copies, and its bf16 outputs and updates are rounded
//! back (to nearest, ties to even) into their bytes in the arena. Storage
//! stays bf16 where the plan put it, and every op rounds its results as a
//! GPU kernel with f32 accumulation and bf16 output does. The f32 copies
//! are numerics emulation, outside the arena: memory is what the plan says
//! on a GPU, not what the CPU executor allocates for them.

use half::bf16;

/// f32 copies of one instruction's bf16 operands.
pub(super) struct Wide {
    /// Owns the copies (the pointers below point into them).
    _bufs: Vec<Vec<f32>>,
    pub input: Vec<Option<*mut f32>>,
    pub output: Vec<Option<*mut f32>>,
    pub update: Vec<Option<*mut f32>>,
    /// Where each written copy goes back: (copy, elements, arena bytes).
    back: Vec<(*mut f32, usize, *mut u8)>,
}

/// One operand: its bytes and elements, whether it is bf16, and whether
/// the kernel reads its current values (inputs, updates, and outputs an
/// input is read through in place); other outputs start as zeros.
pub(super) struct Slot {
    pub at: *mut u8,
    pub elements: usize,
    pub bf16: bool,
    pub read: bool,
}

/// Reads `n` bf16 values at `at`.
///
/// # Safety
/// `at` must point to `n` readable, 2-aligned bf16 values.
unsafe fn decode(at: *const u8, n: usize) -> Vec<f32> {
    // SAFETY: the caller's contract.
    let src = unsafe { std::slice::from_raw_parts(at as *const u16, n) };
    src.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

impl Wide {
    /// Widens the bf16 operands among `inputs` (`None`: read in place, not
    /// widened), `outputs` and `updates`; `None` if there are none.
    ///
    /// # Safety
    /// Every slot must describe live bytes of the allocation.
    pub unsafe fn new(inputs: &[Option<Slot>], outputs: &[Slot], updates: &[Slot]) -> Option<Wide> {
        let any = inputs.iter().flatten().any(|s| s.bf16)
            || outputs.iter().chain(updates).any(|s| s.bf16);
        if !any {
            return None;
        }
        let mut w = Wide {
            _bufs: Vec::new(),
            input: Vec::new(),
            output: Vec::new(),
            update: Vec::new(),
            back: Vec::new(),
        };
        let widen = |s: &Slot, bufs: &mut Vec<Vec<f32>>| -> Option<*mut f32> {
            if !s.bf16 {
                return None;
            }
            let mut v = if s.read {
                // SAFETY: the function's contract.
                unsafe { decode(s.at, s.elements) }
            } else {
                vec![0.0; s.elements]
            };
            let p = v.as_mut_ptr();
            bufs.push(v);
            Some(p)
        };
        let mut bufs = Vec::new();
        for s in inputs {
            let p = s.as_ref().and_then(|s| widen(s, &mut bufs));
            w.input.push(p);
        }
        for (list, slots) in [(&mut w.output, outputs), (&mut w.update, updates)] {
            for s in slots {
                let p = widen(s, &mut bufs);
                if let Some(p) = p {
                    w.back.push((p, s.elements, s.at));
                }
                list.push(p);
            }
        }
        w._bufs = bufs;
        Some(w)
    }

    /// Rounds the written copies back into the arena.
    ///
    /// # Safety
    /// The slots given to [`Wide::new`] must still be live and not accessed
    /// elsewhere.
    pub unsafe fn narrow(&self) {
        for &(src, n, dst) in &self.back {
            // SAFETY: `src` points into an owned copy of `n` floats; `dst`
            // to `n` bf16 values of the arena (the function's contract).
            unsafe {
                let src = std::slice::from_raw_parts(src, n);
                let dst = std::slice::from_raw_parts_mut(dst as *mut u16, n);
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = bf16::from_f32(x).to_bits();
                }
            }
        }
    }
}

/// Rounds `x` to bf16 and back (what storing it as bf16 keeps).
pub fn round_bf16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 operands are widened exactly and written back rounded to
    /// nearest even; f32 operands are left alone.
    #[test]
    fn widens_and_rounds_back() {
        let vals = [1.0f32, -2.5, 3.0e-3, 65504.0];
        let mut bytes: Vec<u16> = vals.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let mut out = vec![0u16; 4];
        let mut plain = [7.0f32; 4];
        let slot = |p: *mut u8, bf16| Slot {
            at: p,
            elements: 4,
            bf16,
            read: true,
        };
        // SAFETY: the slots point to the buffers above.
        let w = unsafe {
            Wide::new(
                &[Some(slot(bytes.as_mut_ptr() as *mut u8, true))],
                &[slot(out.as_mut_ptr() as *mut u8, true)],
                &[slot(plain.as_mut_ptr() as *mut u8, false)],
            )
        }
        .expect("bf16 operands");
        assert!(w.update[0].is_none(), "f32 stays in place");
        // SAFETY: the copies hold 4 floats.
        let (x, y) = unsafe {
            (
                std::slice::from_raw_parts(w.input[0].unwrap(), 4),
                std::slice::from_raw_parts_mut(w.output[0].unwrap(), 4),
            )
        };
        for i in 0..4 {
            assert_eq!(x[i], round_bf16(vals[i]));
            y[i] = x[i] + 1.0 / 1024.0;
        }
        // SAFETY: the buffers are still live.
        unsafe { w.narrow() };
        for i in 0..4 {
            assert_eq!(out[i], bf16::from_f32(x[i] + 1.0 / 1024.0).to_bits());
        }
        // 1 + 2⁻¹⁰ is not a bf16: it rounds to 1 (ties and below go down).
        assert_eq!(bf16::from_bits(out[0]).to_f32(), 1.0);
        assert_eq!(plain, [7.0; 4]);
    }
}
