//! The modeled time of a step in an order: one compute stream and one copy
//! stream each way, copies overlapped with compute.
//!
//! Walking the order, each op starts when its stream is free and the
//! values it reads are written (their last writer has finished):
//! - a compute op runs on the compute stream, one after another;
//! - a copy to the host starts once its input is written and the
//!   device-to-host stream is free. It is the last use of its input, whose
//!   bytes the plan frees at the copy's place in the order, so the compute
//!   op after that place waits for the copy to end (a stall when the copy
//!   was placed too soon);
//! - a copy to the device takes bytes the plan gives it at its place, so
//!   it starts once the compute stream has reached that place (every op
//!   before it has finished) and the host-to-device stream is free; only
//!   the ops that read its output wait for it.
//!
//! The step ends when every stream has finished.

use crate::graph::{COPY_TO_DEVICE, COPY_TO_HOST, Graph, OpId};

use super::device::Device;

/// Where the modeled time goes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timing {
    /// The step's end.
    pub seconds: f64,
    /// The compute ops' own seconds, summed (the step's time with nothing
    /// to wait for).
    pub compute_seconds: f64,
    /// Seconds each copy stream is busy.
    pub to_host_seconds: f64,
    pub to_device_seconds: f64,
    /// Bytes each way.
    pub to_host_bytes: u64,
    pub to_device_bytes: u64,
}

/// The modeled time of `g` run in `order` on `dev` (module docs).
pub fn simulate(g: &Graph, order: &[OpId], dev: &Device) -> Timing {
    let mut ready = vec![0.0f64; g.num_tensors()];
    let (mut compute, mut d2h, mut h2d) = (0.0f64, 0.0f64, 0.0f64);
    let mut t = Timing::default();
    for &o in order {
        let op = g.op(o);
        let dur = dev.op_seconds(g, o);
        let inputs_ready = op
            .inputs
            .iter()
            .chain(&op.updates)
            .map(|&x| ready[g.root(x).index()])
            .fold(0.0, f64::max);
        let finish = match op.op_type.as_str() {
            COPY_TO_HOST => {
                let f = inputs_ready.max(d2h) + dur;
                d2h = f;
                compute = compute.max(f);
                t.to_host_seconds += dur;
                t.to_host_bytes += g.tensor(op.inputs[0]).size;
                f
            }
            COPY_TO_DEVICE => {
                let f = inputs_ready.max(h2d).max(compute) + dur;
                h2d = f;
                t.to_device_seconds += dur;
                t.to_device_bytes += g.tensor(op.inputs[0]).size;
                f
            }
            _ => {
                let f = inputs_ready.max(compute) + dur;
                compute = f;
                t.compute_seconds += dur;
                f
            }
        };
        for &x in op.outputs.iter().chain(&op.updates) {
            ready[g.root(x).index()] = finish;
        }
    }
    t.seconds = compute.max(d2h).max(h2d);
    t
}
