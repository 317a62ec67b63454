//! Embedding memplan in a trainer: describe one training step with
//! `GraphBuilder`, plan it, check the plan, and read every tensor's offset
//! to carve the tensors out of one arena.
//!
//! Run with `cargo run --example embed`.
//!
//! The step: a two-layer MLP (`x @ w1 -> relu -> @ w2 -> loss`), its
//! backward pass, and an SGD update of each weight in place. The trainer
//! knows which elementwise ops can write into their input (ReLU's backward
//! here), and says so with a reuse hint; memplan decides whether to take it.

use memplan::graph::{GraphBuilder, OpKind, OpSpec, Role, TensorSpec};
use memplan::{Options, checker};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (batch, d_in, d_hidden, d_out) = (64u64, 512u64, 2048u64, 10u64);
    let f32_bytes = |n: u64| 4 * n;
    let mut b = GraphBuilder::new("two-layer-mlp");

    // Parameters and inputs exist before the step and survive it.
    let param = |b: &mut GraphBuilder, name: &str, shape: [u64; 2]| {
        b.add_tensor(
            TensorSpec::new(name, f32_bytes(shape[0] * shape[1]))
                .role(Role::Parameter)
                .persistent()
                .align(256)
                .dtype("f32")
                .shape(shape),
        )
    };
    let w1 = param(&mut b, "w1", [d_in, d_hidden]);
    let w2 = param(&mut b, "w2", [d_hidden, d_out]);
    let x = b.add_tensor(
        TensorSpec::new("x", f32_bytes(batch * d_in))
            .role(Role::Input)
            .persistent()
            .align(256),
    );
    // Activations and temporaries live only as long as someone needs them.
    let act = |b: &mut GraphBuilder, name: &str, elems: u64| {
        b.add_tensor(TensorSpec::new(name, f32_bytes(elems)).align(256))
    };
    let h = act(&mut b, "h", batch * d_hidden);
    let a = act(&mut b, "a", batch * d_hidden);
    let logits = act(&mut b, "logits", batch * d_out);
    let loss = b.add_tensor(TensorSpec::new("loss", 4).role(Role::Output).persistent());
    let dlogits = act(&mut b, "dlogits", batch * d_out);
    let da = act(&mut b, "da", batch * d_hidden);
    let dh = act(&mut b, "dh", batch * d_hidden);
    let grad = |b: &mut GraphBuilder, name: &str, elems: u64| {
        b.add_tensor(
            TensorSpec::new(name, f32_bytes(elems))
                .role(Role::Gradient)
                .align(256),
        )
    };
    let dw1 = grad(&mut b, "dw1", d_in * d_hidden);
    let dw2 = grad(&mut b, "dw2", d_hidden * d_out);

    // Ops in the order the framework would run them (the program order).
    let op = |kind, name: &str, ty: &str| OpSpec::new(name, kind, ty);
    use OpKind::{Backward, Forward, Optimizer};
    b.add_op(op(Forward, "fc1", "matmul").inputs([x, w1]).outputs([h]));
    b.add_op(op(Forward, "relu", "relu").inputs([h]).outputs([a]));
    b.add_op(
        op(Forward, "fc2", "matmul")
            .inputs([a, w2])
            .outputs([logits]),
    );
    b.add_op(
        op(Forward, "loss", "cross_entropy")
            .inputs([logits])
            .outputs([loss]),
    );
    b.add_op(
        op(Backward, "loss.bwd", "cross_entropy_backward")
            .inputs([logits])
            .outputs([dlogits]),
    );
    b.add_op(
        op(Backward, "fc2.dw", "matmul")
            .inputs([a, dlogits])
            .outputs([dw2]),
    );
    b.add_op(
        op(Backward, "fc2.dx", "matmul")
            .inputs([dlogits, w2])
            .outputs([da]),
    );
    // ReLU's backward may overwrite `da` in place when nothing reads it later.
    b.add_op(
        op(Backward, "relu.bwd", "relu_backward")
            .inputs([da, h])
            .outputs([dh])
            .reuse(dh, da),
    );
    b.add_op(
        op(Backward, "fc1.dw", "matmul")
            .inputs([x, dh])
            .outputs([dw1]),
    );
    // The optimizer updates the weights in place: it runs after every
    // earlier reader of each weight.
    b.add_op(
        op(Optimizer, "sgd.w1", "sgd")
            .inputs([dw1])
            .updates([w1])
            .attr("lr", 0.01),
    );
    b.add_op(
        op(Optimizer, "sgd.w2", "sgd")
            .inputs([dw2])
            .updates([w2])
            .attr("lr", 0.01),
    );

    // `build` validates everything (ids, producers, cycles, reuse hints).
    let graph = b.build()?;

    let plan = memplan::plan(&graph, &Options::default())?;
    // Never run a plan you have not checked: the checker is independent of
    // the planners.
    let report = checker::check(&graph, &plan)?;
    println!("{report}");

    let s = &plan.stats;
    println!(
        "arena {} bytes; max live {}; lower bound {} ({}); {:.1}% above the bound; planned in {:.3} s",
        plan.arena_bytes,
        s.max_live_bytes,
        s.lower_bound_bytes,
        s.lower_bound_kind,
        100.0 * plan.gap(),
        s.solve_seconds
    );
    println!(
        "program order with a static arena would need {} bytes",
        memplan::baselines::program_order_greedy(&graph).arena_bytes
    );

    // Run the ops in `plan.order`; allocate one arena of `plan.arena_bytes`
    // and give each tensor the slice at its offset. Views and zero-sized
    // tensors have no offset of their own.
    println!(
        "order: {}",
        plan.order
            .iter()
            .map(|&o| graph.op(o).name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for t in graph.tensor_ids() {
        if let Some(offset) = plan.offsets[t.index()] {
            let x = graph.tensor(t);
            println!("  {:8} [{:>8}, {:>8})", x.name, offset, offset + x.size);
        }
    }
    for &(out, inp) in &plan.reuses {
        println!(
            "  {} is written into {}'s bytes",
            graph.tensor(out).name,
            graph.tensor(inp).name
        );
    }
    Ok(())
}
