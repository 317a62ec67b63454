#!/usr/bin/env python3
"""Make XLA HLO dumps of small training steps, for memplan's HLO importer.

Each case is one full training step (forward, loss, backward, optimizer
update) written in plain JAX, jitted with the parameters and optimizer state
donated, and compiled by XLA's CPU backend with

    XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text

For every case the script keeps, gzip-compressed, in OUT/<case>/:

    before_optimizations.txt.gz                        the module as JAX emitted it
    cpu_after_optimizations.txt.gz                     fused and scheduled
    cpu_after_optimizations-memory-usage-report.txt.gz XLA's plan ("Total bytes: N")
    cpu_after_optimizations-buffer-assignment.txt.gz   XLA's buffer assignment (where
                                                       XLA wrote one)
    meta.json                                          configuration, versions,
                                                       compiled.memory_analysis()

Usage (CPU only; JAX from PyPI in a git-ignored venv):

    python3 -m venv .venv && .venv/bin/pip install "jax[cpu]"
    .venv/bin/python tools/hlo_dumps.py --out fixtures/hlo [--cases mlp,cnn,...] [--list]

The cases are small on purpose (a few hundred KiB of text): tests import
them on every run. Pass --scale N to multiply widths for bigger dumps.
"""

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile


# The cases and their shared parts. Each imports jax when it runs, after
# main has set XLA_FLAGS (the backend reads them once).


def adam_init(params):
    import jax
    import jax.numpy as jnp

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"mu": zeros, "nu": zeros, "count": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, state, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    import jax
    import jax.numpy as jnp

    count = state["count"] + 1
    mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], grads)
    nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["nu"], grads)
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)
    new = jax.tree_util.tree_map(
        lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, mu, nu
    )
    return new, {"mu": mu, "nu": nu, "count": count}


def sgd_momentum(params, grads, state, lr=1e-2, m=0.9):
    import jax

    vel = jax.tree_util.tree_map(lambda v, g: m * v + g, state, grads)
    new = jax.tree_util.tree_map(lambda p, v: p - lr * v, params, vel)
    return new, vel


def dense_init(key, sizes):
    import jax
    import jax.numpy as jnp

    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k1, key = jax.random.split(key)
        params.append({"w": jax.random.normal(k1, (a, b)) / a**0.5, "b": jnp.zeros((b,))})
    return params


def xent(logits, labels):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def train_step(loss_fn, update):
    import jax

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        params, opt_state = update(params, grads, opt_state)
        return params, opt_state, loss

    return step


def place_adam_step(mesh, pspec, params, state):
    """Puts the parameters (by `pspec`) and their Adam state (moments as
    the parameters, the count replicated) on `mesh`; returns them and the
    jit keywords that keep the step's outputs placed the same way."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    sspec = {"mu": pspec, "nu": pspec, "count": P()}
    put = lambda tree, specs: jax.tree_util.tree_map(
        lambda a, sp: jax.device_put(a, NamedSharding(mesh, sp)), tree, specs)
    shard = lambda specs: jax.tree_util.tree_map(lambda sp: NamedSharding(mesh, sp), specs)
    jit_kw = {"out_shardings": (shard(pspec), shard(sspec), NamedSharding(mesh, P()))}
    return put(params, pspec), put(state, sspec), jit_kw


def mlp(key, scale):
    import jax
    import jax.numpy as jnp

    sizes = [64 * scale, 256 * scale, 256 * scale, 256 * scale, 10]
    params = dense_init(key, sizes)

    def loss_fn(p, x, y):
        h = x
        for layer in p[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        return xent(h @ p[-1]["w"] + p[-1]["b"], y)

    x = jnp.ones((32, sizes[0]))
    y = jnp.zeros((32,), jnp.int32)
    cfg = {"sizes": sizes, "batch": 32, "opt": "adam"}
    return train_step(loss_fn, adam_update), (params, adam_init(params), x, y), cfg


def transformer(key, scale, scan=False, remat=False, batch=2):
    import jax
    import jax.numpy as jnp
    from jax import lax

    d, heads, seq, vocab, layers = 64 * scale, 4, 32, 256, 2

    def block_init(k):
        ks = jax.random.split(k, 4)
        return {
            "qkv": jax.random.normal(ks[0], (d, 3 * d)) * 0.02,
            "proj": jax.random.normal(ks[1], (d, d)) * 0.02,
            "fc": jax.random.normal(ks[2], (d, 4 * d)) * 0.02,
            "out": jax.random.normal(ks[3], (4 * d, d)) * 0.02,
            "ln1": jnp.ones((d,)),
            "ln2": jnp.ones((d,)),
        }

    ks = jax.random.split(key, layers + 1)
    blocks = [block_init(k) for k in ks[:layers]]
    if scan:
        blocks = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)
    params = {"emb": jax.random.normal(ks[-1], (vocab, d)) * 0.02, "blocks": blocks}

    def ln(x, g):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * g

    def block(h, p):
        a = ln(h, p["ln1"])
        q, k, v = jnp.split(a @ p["qkv"], 3, axis=-1)
        sh = lambda t: t.reshape(batch, seq, heads, d // heads).transpose(0, 2, 1, 3)
        q, k, v = sh(q), sh(k), sh(v)
        att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / (d // heads) ** 0.5 + mask, -1)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(batch, seq, d)
        h = h + o @ p["proj"]
        return h + jax.nn.gelu(ln(h, p["ln2"]) @ p["fc"]) @ p["out"]

    mask = jnp.where(jnp.tril(jnp.ones((seq, seq))) > 0, 0.0, -1e9)
    blk = jax.checkpoint(block) if remat else block

    def loss_fn(p, tokens, labels):
        h = p["emb"][tokens]
        if scan:
            h, _ = lax.scan(lambda c, bp: (blk(c, bp), None), h, p["blocks"])
        else:
            for bp in p["blocks"]:
                h = blk(h, bp)
        logits = h @ p["emb"].T
        return xent(logits.reshape(-1, vocab), labels.reshape(-1))

    tokens = jnp.zeros((batch, seq), jnp.int32)
    cfg = {"d": d, "heads": heads, "seq": seq, "batch": batch, "vocab": vocab,
           "layers": layers, "scan": scan, "remat": remat, "opt": "adam"}
    return train_step(loss_fn, adam_update), (params, adam_init(params), tokens, tokens), cfg


def cnn(key, scale):
    import jax
    import jax.numpy as jnp
    from jax import lax

    c = 8 * scale
    ks = jax.random.split(key, 4)
    params = {
        "c1": jax.random.normal(ks[0], (3, 3, 3, c)) * 0.1,
        "c2": jax.random.normal(ks[1], (3, 3, c, 2 * c)) * 0.1,
        "c3": jax.random.normal(ks[2], (3, 3, 2 * c, 2 * c)) * 0.1,
        "fc": jax.random.normal(ks[3], (2 * c, 10)) * 0.1,
    }
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x, w, stride=1):
        return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=dn)

    def loss_fn(p, x, y):
        h = jax.nn.relu(conv(x, p["c1"]))
        h = jax.nn.relu(conv(h, p["c2"], 2))
        h = h + jax.nn.relu(conv(h, p["c3"]))
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return xent(h.mean((1, 2)) @ p["fc"], y)

    x = jnp.ones((8, 32, 32, 3))
    y = jnp.zeros((8,), jnp.int32)
    state = jax.tree_util.tree_map(jnp.zeros_like, params)
    cfg = {"channels": c, "image": 32, "batch": 8, "opt": "sgd-momentum"}
    return train_step(loss_fn, sgd_momentum), (params, state, x, y), cfg


def cond_mlp(key, scale):
    """An MLP whose update is skipped on non-finite loss (lax.cond)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    sizes = [32 * scale, 128 * scale, 10]
    params = dense_init(key, sizes)

    def loss_fn(p, x, y):
        h = jax.nn.relu(x @ p[0]["w"] + p[0]["b"])
        return xent(h @ p[1]["w"] + p[1]["b"], y)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        new_p, new_s = adam_update(params, grads, opt_state)
        params, opt_state = lax.cond(
            jnp.isfinite(loss), lambda: (new_p, new_s), lambda: (params, opt_state)
        )
        return params, opt_state, loss

    x = jnp.ones((16, sizes[0]))
    y = jnp.zeros((16,), jnp.int32)
    cfg = {"sizes": sizes, "batch": 16, "opt": "adam", "skip_nonfinite": True}
    return step, (params, adam_init(params), x, y), cfg


def spmd(key, scale, kind, devices):
    """An MLP step partitioned by XLA's SPMD partitioner over `devices`
    CPU devices: the dumped module is one rank's program, collectives
    included.

    - `fsdp`: parameters and Adam moments sharded along their first
      dimension, the batch along the same mesh axis: XLA all-gathers each
      weight before use and reduce-scatters its gradient;
    - `dp_tp`: a 2-D mesh (data, model): the batch split over `data`,
      hidden units over `model` (Megatron-style column then row split),
      so activations are all-reduced over `model` and gradients over
      `data`."""
    import jax
    import jax.numpy as jnp

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import numpy as np

    sizes = [64 * scale, 256 * scale, 256 * scale, 16 * devices]
    params = dense_init(key, sizes)
    batch = 64 * devices
    if kind == "fsdp":
        mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
        def spec(path, leaf):
            return P("d") if leaf.ndim >= 1 and leaf.shape[0] % devices == 0 else P()
        data = P("d")
    else:
        mesh = Mesh(np.array(jax.devices()[:devices]).reshape(2, devices // 2), ("data", "model"))
        def spec(path, leaf):
            i = path[0].idx
            if leaf.ndim == 2:
                return P(None, "model") if i % 2 == 0 else P("model", None)
            return P("model") if i % 2 == 0 else P()
        data = P("data")
    state = adam_init(params)
    pspec = jax.tree_util.tree_map_with_path(spec, params)
    params, state, jit_kw = place_adam_step(mesh, pspec, params, state)
    x = jax.device_put(jnp.ones((batch, sizes[0])), NamedSharding(mesh, data))
    y = jax.device_put(jnp.zeros((batch,), jnp.int32), NamedSharding(mesh, data))

    def loss_fn(p, x, y):
        h = x
        for layer in p[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        return xent(h @ p[-1]["w"] + p[-1]["b"], y)

    cfg = {"sizes": sizes, "batch": batch, "opt": "adam", "devices": devices,
           "partitioning": kind, "mesh": dict(mesh.shape)}
    return train_step(loss_fn, adam_update), (params, state, x, y), cfg, jit_kw


def spmd_transformer(key, scale, devices):
    """The 2-block decoder, FSDP-style over `devices` CPU devices: every
    parameter and Adam moment whose first dimension divides is sharded
    along it, the batch (one sequence per device) too; XLA all-gathers
    the weights before use and reduce-scatters their gradients."""
    import jax

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import numpy as np

    step, (params, state, tokens, _), cfg = transformer(key, scale, batch=devices)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    spec = lambda leaf: P("d") if leaf.ndim >= 1 and leaf.shape[0] % devices == 0 else P()
    pspec = jax.tree_util.tree_map(spec, params)
    params, state, jit_kw = place_adam_step(mesh, pspec, params, state)
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("d")))
    cfg = dict(cfg, devices=devices, partitioning="fsdp", mesh=dict(mesh.shape))
    return step, (params, state, tokens, tokens), cfg, jit_kw


def make_cases(scale):
    """Every case: name -> (description, build), where build() returns
    (step, args, config). `step` is a pure function of (params, opt_state,
    batch...) returning (new_params, new_opt_state, loss)."""
    import jax

    key = jax.random.PRNGKey(0)
    return {
        "mlp": ("4-layer ReLU MLP, Adam", lambda: mlp(key, scale)),
        "transformer": ("2-block decoder, Adam", lambda: transformer(key, scale)),
        "transformer_scan": ("2-block decoder with lax.scan over layers (while loops)",
                             lambda: transformer(key, scale, scan=True)),
        "transformer_remat": ("2-block decoder with jax.checkpoint per block",
                              lambda: transformer(key, scale, remat=True)),
        "cnn": ("3-conv CNN with max-pool, SGD momentum", lambda: cnn(key, scale)),
        "cond_mlp": ("MLP whose update is skipped on a non-finite loss (conditional)",
                     lambda: cond_mlp(key, scale)),
        "spmd_fsdp4": ("MLP, parameters and moments sharded over 4 devices (SPMD, FSDP-style)",
                       lambda: spmd(key, scale, "fsdp", 4)),
        "spmd_dp2_tp4": ("MLP on a 2x4 mesh: data parallel x tensor parallel (SPMD)",
                         lambda: spmd(key, scale, "dp_tp", 8)),
        "spmd_transformer_fsdp8": ("2-block decoder, parameters, moments and batch sharded "
                                   "over 8 devices (SPMD, FSDP-style)",
                                   lambda: spmd_transformer(key, scale, 8)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (one sub-folder per case)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--scale", type=int, default=1, help="width multiplier")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args()

    dump = tempfile.mkdtemp(prefix="hlo_dumps_")
    # Eight host devices for the SPMD cases (the others use one).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
        + " --xla_force_host_platform_device_count=8"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # after XLA_FLAGS: the backend reads them once

    cases = make_cases(args.scale)
    if args.list:
        for name, (desc, _) in cases.items():
            print(f"{name}: {desc}")
        return
    chosen = [c for c in args.cases.split(",") if c] or list(cases)
    unknown = [c for c in chosen if c not in cases]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; known: {list(cases)}")

    for name in chosen:
        desc, build = cases[name]
        built = build()
        step, args_, cfg = built[:3]
        jit_kw = built[3] if len(built) > 3 else {}
        fn_name = f"step_{name}"
        step.__name__ = fn_name
        before = set(os.listdir(dump))
        jitted = jax.jit(step, donate_argnums=(0, 1), **jit_kw)
        compiled = jitted.lower(*args_).compile()
        ma = compiled.memory_analysis()
        new = sorted(set(os.listdir(dump)) - before)
        mine = [f for f in new if f".jit_{fn_name}." in f]
        want = {
            "before_optimizations.txt": None,
            "cpu_after_optimizations.txt": None,
            "cpu_after_optimizations-memory-usage-report.txt": None,
        }
        for f in mine:
            for suffix in want:
                if f.endswith("." + suffix):
                    want[suffix] = f
        missing = [k for k, v in want.items() if v is None]
        if missing:
            sys.exit(f"{name}: XLA wrote no {missing} in {dump} (files: {mine})")
        # XLA's buffer assignment of the optimized module (small, compressed):
        # lets the tests replay XLA's own order with XLA's sharing.
        assignment = "cpu_after_optimizations-buffer-assignment.txt"
        found = [f for f in mine if f.endswith("." + assignment)]
        if found:
            want[assignment] = found[0]
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        sizes = {}
        for suffix, f in want.items():
            src = os.path.join(dump, f)
            sizes[suffix] = os.path.getsize(src)
            with open(src, "rb") as fi, gzip.open(os.path.join(out, suffix + ".gz"), "wb", 9) as fo:
                shutil.copyfileobj(fi, fo)
        total = None
        with open(os.path.join(dump, want["cpu_after_optimizations-memory-usage-report.txt"])) as f:
            for line in f:
                if line.startswith("Total bytes:"):
                    total = int(line.split()[2])
                    break
        meta = {
            "case": name,
            "description": desc,
            "config": cfg,
            "jax_version": jax.__version__,
            "xla_total_bytes": total,
            "argument_bytes": ma.argument_size_in_bytes if ma else None,
            "output_bytes": ma.output_size_in_bytes if ma else None,
            "alias_bytes": ma.alias_size_in_bytes if ma else None,
            "temp_bytes": ma.temp_size_in_bytes if ma else None,
            "uncompressed_bytes": sizes,
        }
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"{name}: xla total {total} bytes, {sizes['cpu_after_optimizations.txt']} bytes of text -> {out}")
    shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main()
