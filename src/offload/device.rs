//! The device an offloaded step runs on: its arithmetic and memory rates,
//! and the link to host memory, one copy engine each way.
//!
//! An op takes `max(flops / F, bytes / B)` seconds (the roofline of
//! [`crate::cost`]), with `F` the rate for its element type: f32 and f64
//! ops at the device's f32 rate (PyTorch does not use TF32 for f32 matrix
//! products by default), every other type at its 16-bit tensor rate. An
//! op's own `cost` in the graph overrides the estimate. A copy of `n`
//! bytes takes `latency + n / bandwidth` of its direction.
//!
//! Rates are the vendors' figures derated as large kernels and pinned
//! copies reach them: 60% of peak arithmetic, 80% of memory bandwidth,
//! 80% of the link's.

use crate::cost::{op_bytes, op_flops};
use crate::error::Error;
use crate::graph::{COPY_TO_DEVICE, COPY_TO_HOST, Graph, OpId};

/// A device and its link to host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    /// The preset's name, or `custom`.
    pub name: String,
    /// Arithmetic of 16-bit (and narrower) ops, FLOP/s.
    pub flops_per_s: f64,
    /// Arithmetic of f32 (and f64) ops, FLOP/s.
    pub f32_flops_per_s: f64,
    /// Device memory bandwidth, bytes/s.
    pub bytes_per_s: f64,
    /// Device to host, bytes/s.
    pub to_host_bytes_per_s: f64,
    /// Host to device, bytes/s.
    pub to_device_bytes_per_s: f64,
    /// Seconds before a copy's first byte moves.
    pub latency_s: f64,
}

/// The presets' names, for help and errors.
pub const PRESETS: &[&str] = &["h100-pcie5", "h200-pcie5", "gh200-c2c", "cpu-dev"];

/// Derating of arithmetic, memory and link peaks (module docs).
const ARITH: f64 = 0.6;
const MEMORY: f64 = 0.8;
const LINK: f64 = 0.8;

impl Device {
    /// A preset by name ([`PRESETS`]):
    /// - `h100-pcie5`: H100 SXM (989 TFLOP/s dense bf16, 67 f32, 3.35 TB/s
    ///   HBM3) with its host over PCIe 5.0 x16 (64 GB/s each way);
    /// - `h200-pcie5`: H200 (the same arithmetic, 4.8 TB/s HBM3e) over
    ///   PCIe 5.0 x16;
    /// - `gh200-c2c`: GH200 (H100's arithmetic, 4.0 TB/s HBM3) with its
    ///   Grace CPU's memory over NVLink-C2C (450 GB/s each way);
    /// - `cpu-dev`: the project's 2-core development machine, measured by
    ///   `tools/measure_cpu_device.py`: the "device" is its CPU, the host
    ///   pool a second region of its memory, the link a copy.
    pub fn preset(name: &str) -> Result<Device, Error> {
        let gpu = |name: &str, bf16: f64, f32: f64, hbm: f64, link: f64, latency: f64| Device {
            name: name.into(),
            flops_per_s: ARITH * bf16,
            f32_flops_per_s: ARITH * f32,
            bytes_per_s: MEMORY * hbm,
            to_host_bytes_per_s: LINK * link,
            to_device_bytes_per_s: LINK * link,
            latency_s: latency,
        };
        Ok(match name {
            "h100-pcie5" => gpu(name, 989e12, 67e12, 3.35e12, 64e9, 10e-6),
            "h200-pcie5" => gpu(name, 989e12, 67e12, 4.8e12, 64e9, 10e-6),
            "gh200-c2c" => gpu(name, 989e12, 67e12, 4.0e12, 450e9, 5e-6),
            // Measured by tools/measure_cpu_device.py on 2026-12-02
            // (medians; not derated): bf16 3.42e11 and f32 1.17e11 FLOP/s
            // in 2048³ products, 2.59e10 B/s read plus written by a
            // 256 MiB copy, 1.29e10 B/s copied. The latency is assumed.
            "cpu-dev" => Device {
                name: name.into(),
                flops_per_s: 3.42e11,
                f32_flops_per_s: 1.17e11,
                bytes_per_s: 2.59e10,
                to_host_bytes_per_s: 1.29e10,
                to_device_bytes_per_s: 1.29e10,
                latency_s: 2e-6,
            },
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown device preset {name:?}; known: {}",
                    PRESETS.join(", ")
                )));
            }
        })
    }

    /// This device with a link of `gbps` gigabytes per second each way
    /// (derated like the presets'); refuses 0, negative and NaN.
    pub fn with_link_gbps(mut self, gbps: f64) -> Result<Device, Error> {
        if !(gbps.is_finite() && gbps > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "--link-gbps {gbps}: the link's bandwidth must be a positive number of GB/s"
            )));
        }
        self.to_host_bytes_per_s = LINK * gbps * 1e9;
        self.to_device_bytes_per_s = LINK * gbps * 1e9;
        self.name = format!("{}+link{gbps}GBps", self.name);
        Ok(self)
    }

    /// Seconds op `o` of `g` takes (module docs); a copy's from the link.
    pub fn op_seconds(&self, g: &Graph, o: OpId) -> f64 {
        let op = g.op(o);
        match op.op_type.as_str() {
            COPY_TO_HOST => self.copy_seconds(g.tensor(op.inputs[0]).size, true),
            COPY_TO_DEVICE => self.copy_seconds(g.tensor(op.inputs[0]).size, false),
            _ => {
                if let Some(c) = op.cost {
                    return c;
                }
                let dtype = op
                    .outputs
                    .iter()
                    .chain(&op.updates)
                    .chain(&op.inputs)
                    .find_map(|&t| g.tensor(t).dtype.as_deref());
                let rate = match dtype {
                    None | Some("f32" | "float32" | "f64" | "float64") => self.f32_flops_per_s,
                    Some(_) => self.flops_per_s,
                };
                (op_flops(g, o) / rate).max(op_bytes(g, o) as f64 / self.bytes_per_s)
            }
        }
    }

    /// Seconds a copy of `bytes` takes, to the host or to the device.
    pub fn copy_seconds(&self, bytes: u64, to_host: bool) -> f64 {
        let bw = if to_host {
            self.to_host_bytes_per_s
        } else {
            self.to_device_bytes_per_s
        };
        self.latency_s + bytes as f64 / bw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_bad_links() {
        for p in PRESETS {
            let d = Device::preset(p).unwrap();
            assert!(d.flops_per_s > 0.0 && d.to_host_bytes_per_s > 0.0, "{p}");
        }
        let e = Device::preset("a100").unwrap_err().to_string();
        assert!(e.contains("a100") && e.contains("h100-pcie5"), "{e}");
        let d = Device::preset("h100-pcie5").unwrap();
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(d.clone().with_link_gbps(bad).is_err(), "{bad}");
        }
        let d = d.with_link_gbps(100.0).unwrap();
        assert_eq!(d.to_device_bytes_per_s, 80e9);
        // 1 GB at 80 GB/s plus 10 µs.
        assert!((d.copy_seconds(1_000_000_000, false) - 0.01251).abs() < 1e-9);
    }
}
