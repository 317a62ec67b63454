//! The CPU kernels against finite differences and hand-computed values, and
//! every in-place form against its out-of-place form.

use memplan_runtime::cpu::kernels as k;
use memplan_runtime::init::{hash_key, normal};
use memplan_runtime::{AdamParams, Attention, ChunkLayout};

fn rand(key: &str, n: usize, std: f32) -> Vec<f32> {
    let h = hash_key(1, key);
    (0..n).map(|i| std * normal(h, i as u64)).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Checks `analytic` against central differences of `loss` at `x`, on a
/// few coordinates.
fn check_grad(what: &str, x: &[f32], analytic: &[f32], loss: impl Fn(&[f32]) -> f64) {
    let n = x.len();
    let picks: Vec<usize> = (0..n).step_by((n / 23).max(1)).collect();
    let mut worst = 0.0f64;
    for i in picks {
        let h = 1e-2f32 * (1.0 + x[i].abs());
        let mut xp = x.to_vec();
        xp[i] += h;
        let mut xm = x.to_vec();
        xm[i] -= h;
        let num = (loss(&xp) - loss(&xm)) / (2.0 * h as f64);
        let err =
            (num - analytic[i] as f64).abs() / (1e-2 + num.abs().max(analytic[i].abs() as f64));
        worst = worst.max(err);
        assert!(
            err < 3e-2,
            "{what}[{i}]: analytic {} vs numeric {num}",
            analytic[i]
        );
    }
    assert!(worst.is_finite());
}

#[test]
fn gelu_backward_is_the_derivative() {
    let x = rand("x", 50, 2.0);
    let r = rand("r", 50, 1.0);
    let mut dx = vec![0.0; 50];
    k::gelu_backward(Some(&r), &x, &mut dx);
    check_grad("gelu", &x, &dx, |x| {
        let mut y = vec![0.0; 50];
        k::gelu(Some(x), &mut y);
        dot(&y, &r)
    });
    // In place: dx computed into the buffer that holds dy.
    let mut inplace = r.clone();
    k::gelu_backward(None, &x, &mut inplace);
    assert_eq!(inplace, dx);
    let mut y = vec![0.0; 50];
    k::gelu(Some(&x), &mut y);
    let mut y2 = x.clone();
    k::gelu(None, &mut y2);
    assert_eq!(y, y2);
    // GPT-2's tanh approximation at a known point.
    assert!((k::gelu_scalar(1.0) - 0.841_192).abs() < 1e-5);
}

#[test]
fn relu_and_add_in_place_match() {
    let a = rand("a", 40, 1.0);
    let b = rand("b", 40, 1.0);
    let mut c = vec![0.0; 40];
    k::add(Some(&a), Some(&b), &mut c);
    let mut c0 = a.clone();
    k::add(None, Some(&b), &mut c0);
    let mut c1 = b.clone();
    k::add(Some(&a), None, &mut c1);
    assert_eq!(c, c0);
    assert_eq!(c, c1);
    let mut r = vec![0.0; 40];
    k::relu(Some(&a), &mut r);
    assert!(r.iter().zip(&a).all(|(&r, &a)| r == a.max(0.0)));
    let mut dr = vec![0.0; 40];
    k::relu_backward(Some(&b), &a, &mut dr);
    let mut dr2 = b.clone();
    k::relu_backward(None, &a, &mut dr2);
    assert_eq!(dr, dr2);
    assert!(
        dr.iter()
            .zip(&a)
            .zip(&b)
            .all(|((&d, &a), &b)| d == if a > 0.0 { b } else { 0.0 })
    );
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let (rows, cols) = (70, 24); // more rows than one reduction chunk
    let x = rand("x", rows * cols, 1.5);
    let g = rand("g", cols, 1.0);
    let b = rand("b", cols, 1.0);
    let r = rand("r", rows * cols, 1.0);
    let fwd = |x: &[f32], g: &[f32], b: &[f32]| {
        let mut y = vec![0.0; rows * cols];
        let (mut m, mut s) = (vec![0.0; rows], vec![0.0; rows]);
        k::layernorm(x, g, b, &mut y, &mut m, &mut s, cols, 1e-5);
        (y, m, s)
    };
    let (y, mean, rstd) = fwd(&x, &g, &b);
    // y has zero mean and unit variance per row before the affine part.
    let (mut dx, mut dg, mut db) = (vec![0.0; rows * cols], vec![0.0; cols], vec![0.0; cols]);
    k::layernorm_backward(
        Some(&r),
        &x,
        &mean,
        &rstd,
        &g,
        &mut dx,
        &mut dg,
        &mut db,
        cols,
    );
    check_grad("layernorm dx", &x, &dx, |x| dot(&fwd(x, &g, &b).0, &r));
    check_grad("layernorm dgamma", &g, &dg, |g| dot(&fwd(&x, g, &b).0, &r));
    check_grad("layernorm dbeta", &b, &db, |b| dot(&fwd(&x, &g, b).0, &r));
    let mut dx2 = r.clone();
    let (mut dg2, mut db2) = (vec![9.0; cols], vec![9.0; cols]);
    k::layernorm_backward(
        None, &x, &mean, &rstd, &g, &mut dx2, &mut dg2, &mut db2, cols,
    );
    assert_eq!((dx, dg, db), (dx2, dg2, db2));
    assert!(y.iter().all(|v| v.is_finite()));
}

#[test]
fn linear_backward_matches_finite_differences() {
    let (m, kk, n) = (5, 7, 6);
    let x = rand("x", m * kk, 1.0);
    let w = rand("w", kk * n, 1.0);
    let b = rand("b", n, 1.0);
    let r = rand("r", m * n, 1.0);
    let fwd = |x: &[f32], w: &[f32], b: &[f32]| {
        let mut y = vec![0.0; m * n];
        k::linear(x, w, b, &mut y, m, kk, n);
        dot(&y, &r)
    };
    let mut dx = vec![0.0; m * kk];
    k::linear_backward_data(&r, &w, &mut dx, m, kk, n);
    let (mut dw, mut db) = (vec![0.0; kk * n], vec![0.0; n]);
    k::linear_backward_weight(&r, &x, &mut dw, &mut db, m, kk, n);
    check_grad("linear dx", &x, &dx, |x| fwd(x, &w, &b));
    check_grad("linear dw", &w, &dw, |w| fwd(&x, w, &b));
    check_grad("linear db", &b, &db, |b| fwd(&x, &w, b));
}

#[test]
fn attention_backward_matches_finite_differences() {
    let a = Attention::mha(2, 2, 5, 3, (1.0 / 3f32.sqrt()) as f64);
    let (bsz, t, c) = (2usize, 5usize, 6usize);
    let qkv = rand("qkv", bsz * t * 3 * c, 1.0);
    let r = rand("r", bsz * t * c, 1.0);
    let nprob = bsz * 2 * t * t;
    let fwd = |qkv: &[f32]| {
        let mut s = vec![0.0; nprob];
        k::attention_scores(qkv, &mut s, &a);
        let mut p = vec![0.0; nprob];
        k::causal_softmax(Some(&s), &mut p, &a);
        let mut att = vec![0.0; bsz * t * c];
        k::attention_values(&p, qkv, &mut att, &a);
        (s, p, att)
    };
    let (s, p, _) = fwd(&qkv);
    // Causal: rows sum to one over j <= i, zero above.
    for (row, pr) in p.chunks(t).enumerate() {
        let i = row % t;
        assert!((pr[..=i].iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(pr[i + 1..].iter().all(|&v| v == 0.0));
    }
    let mut dprobs = vec![0.0; nprob];
    let mut dqkv = vec![f32::NAN; bsz * t * 3 * c];
    k::attention_values_backward(&r, &p, &qkv, &mut dprobs, &mut dqkv, &a);
    let mut ds = vec![0.0; nprob];
    k::causal_softmax_backward(Some(&dprobs), &p, &mut ds, &a);
    k::attention_scores_backward(&ds, &qkv, &mut dqkv, &a);
    check_grad("attention dqkv", &qkv, &dqkv, |q| dot(&fwd(q).2, &r));
    // In-place softmax forward and backward give the same bits.
    let mut p2 = s.clone();
    k::causal_softmax(None, &mut p2, &a);
    assert_eq!(p, p2);
    let mut ds2 = dprobs.clone();
    k::causal_softmax_backward(None, &p, &mut ds2, &a);
    assert_eq!(ds, ds2);
}

#[test]
fn cross_entropy_and_its_backward() {
    let (rows, classes) = (40, 9);
    let logits = rand("l", rows * classes, 2.0);
    let targets: Vec<i32> = (0..rows).map(|r| (r * 7 % classes) as i32).collect();
    let loss = k::cross_entropy(&logits, &targets, classes).unwrap();
    // By hand for row 0.
    let row = &logits[..classes];
    let lse = row.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
    let l0 = lse - row[targets[0] as usize] as f64;
    let mut total = 0.0;
    for r in 0..rows {
        let row = &logits[r * classes..(r + 1) * classes];
        total += row.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln()
            - row[targets[r] as usize] as f64;
    }
    assert!((loss as f64 - total / rows as f64).abs() < 1e-5);
    assert!(l0 > 0.0);
    let scale = 1.0 / rows as f32;
    let mut d = vec![0.0; rows * classes];
    k::cross_entropy_backward(Some(&logits), &targets, &mut d, classes, scale).unwrap();
    check_grad("cross entropy", &logits, &d, |l| {
        k::cross_entropy(l, &targets, classes).unwrap() as f64
    });
    let mut d2 = logits.clone();
    k::cross_entropy_backward(None, &targets, &mut d2, classes, scale).unwrap();
    assert_eq!(d, d2);
    let bad = vec![classes as i32; rows];
    let e = k::cross_entropy(&logits, &bad, classes).unwrap_err();
    assert!(
        e.contains("target 9 at position 0 is outside [0, 9)"),
        "{e}"
    );
}

#[test]
fn embedding_backward_matches_finite_differences() {
    let (bsz, t, c, v) = (2usize, 4usize, 3usize, 5u64);
    let tokens: Vec<i32> = vec![1, 3, 1, 0, 4, 1, 2, 3];
    let wte = rand("wte", v as usize * c, 1.0);
    let wpe = rand("wpe", t * c, 1.0);
    let dhead = rand("dh", v as usize * c, 1.0);
    let r = rand("r", bsz * t * c, 1.0);
    let fwd = |wte: &[f32], wpe: &[f32]| {
        let mut x = vec![0.0; bsz * t * c];
        k::embedding(&tokens, wte, Some(wpe), &mut x, t, c, v).unwrap();
        dot(&x, &r)
    };
    let (mut dwte, mut dwpe) = (vec![0.0; v as usize * c], vec![0.0; t * c]);
    k::embedding_backward(&r, &tokens, None, &mut dwte, Some(&mut dwpe), bsz, t, c, v).unwrap();
    check_grad("embedding dwte", &wte, &dwte, |w| fwd(w, &wpe));
    check_grad("embedding dwpe", &wpe, &dwpe, |w| fwd(&wte, w));
    // Accumulating onto the tied head's gradient, out of place and in place.
    let mut acc = vec![0.0; v as usize * c];
    k::embedding_backward(
        &r,
        &tokens,
        Some(Some(&dhead)),
        &mut acc,
        Some(&mut dwpe),
        bsz,
        t,
        c,
        v,
    )
    .unwrap();
    let mut acc2 = dhead.clone();
    k::embedding_backward(
        &r,
        &tokens,
        Some(None),
        &mut acc2,
        Some(&mut dwpe),
        bsz,
        t,
        c,
        v,
    )
    .unwrap();
    assert_eq!(acc, acc2);
    for i in 0..acc.len() {
        assert!((acc[i] - dhead[i] - dwte[i]).abs() < 1e-6);
    }
    let mut x = vec![0.0; bsz * t * c];
    let e = k::embedding(&[0, 1, 2, 3, 4, 5, 0, 0], &wte, Some(&wpe), &mut x, t, c, v).unwrap_err();
    assert!(e.contains("token 5 at position 5"), "{e}");
}

fn adam_params(decoupled: bool, wd: f32) -> AdamParams {
    AdamParams {
        elements: 3,
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: wd as f64,
        decoupled,
        first_step: 1,
        max_norm: None,
        norm_squared: false,
    }
}

#[test]
fn adam_follows_pytorch_formulas() {
    // Two steps by hand, in f64, of PyTorch's single-tensor Adam/AdamW.
    for (decoupled, wd) in [(false, 0.0f32), (false, 0.1), (true, 0.01)] {
        let p = adam_params(decoupled, wd);
        let g = [0.5f32, -1.0, 2.0];
        let (mut w, mut m, mut v) = (vec![1.0f32, 2.0, -3.0], vec![0.0f32; 3], vec![0.0f32; 3]);
        let (mut ew, mut em, mut ev) = (vec![1.0f64, 2.0, -3.0], vec![0.0f64; 3], vec![0.0f64; 3]);
        for step in 1..=2u64 {
            let mut denom = vec![0.0f32; 3];
            k::adam(&g, None, &mut w, &mut m, &mut v, Some(&mut denom), &p, step);
            for i in 0..3 {
                let mut gi = g[i] as f64;
                if decoupled {
                    ew[i] *= 1.0 - 0.1 * wd as f64;
                } else {
                    gi += wd as f64 * ew[i];
                }
                em[i] = 0.9 * em[i] + 0.1 * gi;
                ev[i] = 0.999 * ev[i] + 0.001 * gi * gi;
                let bc1 = 1.0 - 0.9f64.powi(step as i32);
                let bc2 = 1.0 - 0.999f64.powi(step as i32);
                let d = ev[i].sqrt() / bc2.sqrt() + 1e-8;
                ew[i] -= 0.1 / bc1 * em[i] / d;
                assert!(
                    (w[i] as f64 - ew[i]).abs() < 1e-5,
                    "w {} vs {}",
                    w[i],
                    ew[i]
                );
                assert!((m[i] as f64 - em[i]).abs() < 1e-6);
                assert!((v[i] as f64 - ev[i]).abs() < 1e-6);
                assert!((denom[i] as f64 - d).abs() < 1e-5);
            }
        }
    }
}

#[test]
fn adam_clips_by_the_global_norm() {
    let mut p = adam_params(false, 0.0);
    p.max_norm = Some(1.0);
    let g = [3.0f32, 4.0, 0.0]; // norm 5
    let run = |p: &AdamParams, norm: f32, g: &[f32]| {
        let (mut w, mut m, mut v) = (vec![0.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
        k::adam(g, Some(norm), &mut w, &mut m, &mut v, None, p, 1);
        m
    };
    let m = run(&p, 5.0, &g);
    let coef = 1.0 / (5.0 + 1e-6);
    assert!((m[0] - 0.1 * 3.0 * coef).abs() < 1e-7);
    p.norm_squared = true;
    assert_eq!(run(&p, 25.0, &g), m);
    assert_eq!(k::sum_of_squares(&[&g[..2], &g[2..]]), 25.0);
}

#[test]
fn pack_places_inputs_and_zeroes_the_rest() {
    let mut out = vec![9.0; 10];
    k::pack(&[&[1.0, 2.0], &[3.0]], &[1, 6], &mut out);
    assert_eq!(out, vec![0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0]);
}

#[test]
fn chunk_cat_and_copy_out_are_inverse_with_padding() {
    // Two ranks; a has 5 elements (chunks of 3, the last padded), b has 2.
    let l = ChunkLayout {
        world: 2,
        shard: 6,
        offsets: vec![0, 4],
        chunks: vec![3, 1],
    };
    let (a, b) = ([1.0f32, 2.0, 3.0, 4.0, 5.0], [6.0f32, 7.0]);
    let mut flat = vec![9.0; 12];
    k::chunk_cat(&[&a, &b], &l, &mut flat);
    let want = [1.0, 2.0, 3.0, 0.0, 6.0, 0.0, 4.0, 5.0, 0.0, 0.0, 7.0, 0.0];
    assert_eq!(flat, want);
    let (mut a2, mut b2) = ([0.0f32; 5], [0.0f32; 2]);
    k::copy_out(&flat, &l, &mut [&mut a2[..], &mut b2[..]]);
    assert_eq!((a2, b2), (a, b));
    // Rank r's segment is rank r's dim-0 shard of each parameter.
    let pieces: Vec<_> = l.pieces(0, 5).collect();
    assert_eq!(pieces, [(0, 0, 3), (6, 3, 2)]);
}
