//! A step at other batch sizes from two captures (`memplan::batch`), and
//! the largest batch that fits a budget.

use std::time::Duration;

use memplan::batch::{BatchLine, max_batch, recorded_batch};
use memplan::fit::FitOptions;
use memplan::models::{ExampleOptions, example};
use memplan::{Graph, checker};

fn at(name: &str, batch: u64, mixed: bool, fused: bool) -> Graph {
    example(
        name,
        &ExampleOptions {
            batch: Some(batch),
            layers: Some(2),
            mixed_precision: mixed,
            fused_attention: fused,
            ..Default::default()
        },
    )
    .unwrap()
}

/// Every size, shape, FLOP count and attribute the line gives at `batch`
/// equals what the model builds at that batch.
fn assert_same_step(got: &Graph, want: &Graph) {
    assert_eq!(got.num_tensors(), want.num_tensors());
    for t in want.tensor_ids() {
        let (x, y) = (got.tensor(t), want.tensor(t));
        assert_eq!(x.name, y.name);
        assert_eq!(x.size, y.size, "size of {}", y.name);
        assert_eq!(x.shape, y.shape, "shape of {}", y.name);
    }
    for o in want.op_ids() {
        let (x, y) = (got.op(o), want.op(o));
        let (fx, fy) = (x.flops.unwrap(), y.flops.unwrap());
        assert!(
            (fx - fy).abs() <= 1e-9 * fy.max(1.0),
            "{}: {fx} vs {fy}",
            y.name
        );
        assert_eq!(x.attrs, y.attrs, "attributes of {}", y.name);
    }
    assert_eq!(got.program_order(), want.program_order());
}

#[test]
fn two_captures_give_the_step_at_every_batch() {
    for (name, mixed, fused) in [
        ("gpt2-tiny", false, false),
        ("gpt2-tiny", false, true),
        ("llama-tiny", true, true),
        ("mlp", false, false),
    ] {
        let (g1, g2) = (at(name, 1, mixed, fused), at(name, 2, mixed, fused));
        assert_eq!(recorded_batch(&g2), Some(2));
        let line = BatchLine::new(g1, 1, g2, 2).unwrap();
        for b in [1, 3, 7, 16] {
            let g = line.at(b).unwrap();
            assert_eq!(recorded_batch(&g), Some(b));
            assert_same_step(&g, &at(name, b, mixed, fused));
        }
        // From two other batches, backwards to batch 1.
        let line =
            BatchLine::new(at(name, 5, mixed, fused), 5, at(name, 3, mixed, fused), 3).unwrap();
        assert_same_step(&line.at(1).unwrap(), &at(name, 1, mixed, fused));
    }
}

#[test]
fn steps_that_are_not_one_line_are_refused_by_name() {
    let e = BatchLine::new(
        at("mlp", 1, false, false),
        1,
        at("gpt2-tiny", 2, false, false),
        2,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("batch 1 and 2 differ"), "{e}");
    let e = BatchLine::new(at("mlp", 1, false, false), 1, at("mlp", 2, false, false), 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("two different positive batch sizes"), "{e}");
    // Sizes that shrink as the batch grows: the captures were swapped.
    let e = BatchLine::new(at("mlp", 4, false, false), 1, at("mlp", 2, false, false), 2)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor") && e.contains("whole bytes per sample"),
        "{e}"
    );
    // A whole slope that reaches below zero bytes at a small batch.
    let line =
        BatchLine::new(at("mlp", 2, false, false), 4, at("mlp", 4, false, false), 6).unwrap();
    let e = line.at(1).unwrap_err().to_string();
    assert!(e.contains("would have -"), "{e}");
}

#[test]
fn the_largest_batch_from_two_captures_is_the_models_own() {
    let budget = 300 << 20;
    let opts = FitOptions {
        time_limit: Duration::from_secs(3),
        ..FitOptions::default()
    };
    let line = BatchLine::new(
        at("gpt2-tiny", 1, false, false),
        1,
        at("gpt2-tiny", 2, false, false),
        2,
    )
    .unwrap();
    let from_line = max_batch(&mut |b| line.at(b), budget, &opts, 256).unwrap();
    let from_model = max_batch(
        &mut |b| Ok(at("gpt2-tiny", b, false, false)),
        budget,
        &opts,
        256,
    )
    .unwrap();
    assert_eq!(from_line.eager, from_model.eager);
    assert_eq!(from_line.eager_default, from_model.eager_default);
    assert_eq!(from_line.planned, from_model.planned);
    let r = from_line;
    assert!(
        r.eager >= 1 && r.eager <= r.planned && r.planned <= r.fitted,
        "{r:?}"
    );
    assert!(r.fitted < r.cap, "{r:?}");
    // Each answer fits, and the batch above it does not.
    let g = at("gpt2-tiny", r.planned, false, false);
    let p = memplan::plan(&g, &memplan::Options::default()).unwrap();
    checker::check(&g, &p).unwrap();
    assert!(p.arena_bytes <= budget);
    // Eager: at its answer one configuration fits, the one named; above
    // it none does; the default configuration alone fits no more.
    let eager_at = |b| memplan::baselines::eager_configurations(&at("gpt2-tiny", b, false, false));
    let here = eager_at(r.eager);
    let best = memplan::baselines::best_eager(&here).unwrap();
    assert!(best.footprint_bytes <= budget, "{best:?}");
    assert_eq!(r.eager_configuration.as_deref(), Some(best.name.as_str()));
    let above = eager_at(r.eager + 1);
    assert!(
        memplan::baselines::best_eager(&above)
            .unwrap()
            .footprint_bytes
            > budget
    );
    assert!(r.eager_default >= 1 && r.eager_default <= r.eager, "{r:?}");
    let reserved =
        |b| memplan::baselines::pytorch_caching(&at("gpt2-tiny", b, false, false)).max_reserved;
    assert!(reserved(r.eager_default) <= budget && reserved(r.eager_default + 1) > budget);
    let f = memplan::fit::fit(
        &at("gpt2-tiny", r.fitted, false, false),
        &FitOptions { budget, ..opts },
    )
    .unwrap();
    checker::check(&f.graph, &f.plan).unwrap();
    assert!(f.plan.arena_bytes <= budget);
}
