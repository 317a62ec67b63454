#!/usr/bin/env python3
"""Run an XLA module in memplan's order on XLA's own CPU compiler, and compare
results and XLA's memory report with the module as XLA ordered it.

    .venv/bin/pip install "jax[cpu]" pypjrt lammps-jax-pjrt-cpu
    cargo build --release --bin memplan
    .venv/bin/python tools/xla_run_scheduled.py fixtures/hlo/mlp/cpu_after_optimizations.txt.gz

What it does, for one optimized module (`*_after_optimizations.txt[.gz]`):

1. `memplan plan MODULE -o plan.json --json`: memplan's order and its
   predicted peak; `memplan export --hlo MODULE --plan plan.json`: the module
   relisted in that order, `is_scheduled=true`, its entry instructions chained
   with control predecessors.
2. Compiles the original and the relisted module with XLA's CPU compiler,
   HLO passes off (`run_backend_only`), each in a fresh process with
   `--xla_dump_to`, and runs both on the same random inputs. A sharded
   (SPMD) module runs on as many CPU devices as its header's
   `replica_count` x `num_partitions` (the plugin's `cpu_device_count`),
   every device with its own inputs, collectives included.
3. Checks that the compiled relisted module lists its entry in memplan's
   order (XLA's dump of what it compiled), that both give the same outputs,
   and prints XLA's `Total bytes` (its memory-usage report) for both next
   to memplan's prediction; then, from XLA's buffer assignment and live
   ranges for memplan's order, the most bytes XLA's live values cover at
   one instruction (what memplan predicts) and, at that instruction, the
   bytes of XLA's allocations no value covers (:func:`live_bytes`).

Why not jaxlib's own `compile`: in jaxlib it accepts MLIR only, and the
HLO -> StableHLO conversion drops the schedule, control dependencies, fusion
backend configs and layouts. So the module goes, as an HloModuleProto parsed
by jaxlib, to XLA's CPU PJRT plugin through the PJRT C API
(`PJRT_Client_Compile` with format "hlo"): the plugin comes from the PyPI
package `lammps-jax-pjrt-cpu` (XLA's `pjrt_c_api_cpu_plugin.so`) and is driven
with `pypjrt` (ctypes). Why the chain: XLA's CPU compiler schedules every
module again before buffer assignment (`CompileCpuExecutable` calls
`CreateHloSchedule` whatever the module says), and the control predecessors
leave it one valid order.
"""

import argparse
import ctypes
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

# CompileOptionsProto: executable_build_options (3) { run_backend_only (11): true }
RUN_BACKEND_ONLY = b"\x1a\x02\x58\x01"
NP = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "s32": np.int32,
      "s64": np.int64, "s8": np.int8, "u8": np.uint8, "u32": np.uint32, "pred": np.bool_}


def read_text(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return f.read()


def entry_lines(text):
    lines = text.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return lines[start + 1:end]


def entry_order(text):
    return [re.match(r"\s*(?:ROOT )?%?([\w.\-]+) =", l).group(1) for l in entry_lines(text)]


def entry_params(text):
    out = []
    for l in entry_lines(text):
        m = re.search(r"= (\w+)\[([\d,]*)\]\S* parameter\((\d+)\)", l)
        if m:
            dims = tuple(int(d) for d in m.group(2).split(",") if d)
            out.append((int(m.group(3)), m.group(1), dims))
    return sorted(out)


def random_arg(rng, ty, dims):
    dt = NP[ty]
    if np.issubdtype(dt, np.floating):
        return (0.1 * rng.random(dims)).astype(dt)  # >= 0 keeps Adam's sqrt(nu) finite
    if dt == np.bool_:
        return rng.integers(0, 2, dims).astype(np.bool_)
    return rng.integers(0, 8, dims).astype(dt)


def plugin_path():
    import lammps_jax_pjrt_cpu
    return os.path.join(os.path.dirname(lammps_jax_pjrt_cpu.__file__), "pjrt_c_api_cpu_plugin.so")


def mesh(text):
    """(replicas, partitions) of a module, from its header (1, 1 when absent)."""
    head = text.split("\n", 1)[0]
    r = re.search(r"replica_count=(\d+)", head)
    p = re.search(r"num_partitions=(\d+)", head)
    return (int(r.group(1)) if r else 1, int(p.group(1)) if p else 1)


def compile_options(replicas, partitions):
    """Serialized CompileOptionsProto: backend only, and for a sharded
    (SPMD) module one device per (replica, partition), in order."""
    from jax._src.lib import _jax, xla_client as xc
    o = _jax.CompileOptions()
    if replicas * partitions > 1:
        b = o.executable_build_options
        o.num_replicas = b.num_replicas = replicas
        o.num_partitions = b.num_partitions = partitions
        b.use_spmd_partitioning = partitions > 1
        o.device_assignment = xc.DeviceAssignment.create(
            np.arange(replicas * partitions).reshape(replicas, partitions))
    return o.SerializeAsString() + RUN_BACKEND_ONLY


def compile_module(client, text, opts):
    from pypjrt import client as pc
    from jax._src.lib import xla_client as xc
    proto = xc.hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
    P = client._plugin
    code = ctypes.create_string_buffer(proto, len(proto))
    fmt = ctypes.create_string_buffer(b"hlo", 3)
    ob = ctypes.create_string_buffer(opts, len(opts))
    prog = P.args("PJRT_Program", code=ctypes.cast(code, pc._VOIDP), code_size=len(proto),
                  format=ctypes.cast(fmt, pc._VOIDP), format_size=3)
    args = P.args("PJRT_Client_Compile_Args", client=client._check(),
                  program=ctypes.addressof(prog), compile_options=ctypes.cast(ob, pc._VOIDP),
                  compile_options_size=len(opts))
    P.call("PJRT_Client_Compile", args)
    return pc.Executable(P, args.executable, client)


def compile_and_run(module, out_npz, seed):
    """In this process: compile `module` (XLA_FLAGS already set), run it on
    as many CPU devices as its mesh has (each with its own random inputs),
    save the outputs: `out{k}` on one device, `d{d}_out{k}` on several."""
    import pypjrt
    from pypjrt import typing as pt

    text = read_text(module)
    replicas, partitions = mesh(text)
    n = replicas * partitions
    client = pypjrt.Client.create(plugin_path(), options={"cpu_device_count": n})
    exe = compile_module(client, text, compile_options(replicas, partitions))
    stats = {k: int(v) for k, v in exe.compiled_memory_stats().items()
             if isinstance(v, (int, np.integer))}
    codes = {"f32": pt.F32, "f64": pt.F64, "f16": pt.F16, "s32": pt.S32, "s64": pt.S64,
             "s8": pt.S8, "u8": pt.U8, "u32": pt.U32, "pred": pt.PRED}
    rng = np.random.default_rng(seed)
    outs = {}
    with client.devices() as devs:
        rows = []
        for d in range(n):
            row = []
            for _, ty, dims in entry_params(text):
                x = np.ascontiguousarray(random_arg(rng, ty, dims))
                row.append(client.buffer_from_host(x, codes[ty].code, list(dims), devs[d]))
            rows.append(row)
        results = exe.execute_sharded(rows) if n > 1 else [exe(*rows[0])]
        for d, row in enumerate(results):
            for k, o in enumerate(row):
                name = pt.by_code(o.element_type).name
                host = np.empty(o.dimensions, dtype=NP.get(name, np.uint8))
                o.to_host(host.reshape(-1).view(np.uint8) if host.size else bytearray(0))
                outs[f"out{k}" if n == 1 else f"d{d}_out{k}"] = host
    np.savez(out_npz, **outs)
    with open(out_npz + ".json", "w") as f:
        json.dump(stats, f)


def newest(folder, suffix):
    files = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(suffix)]
    return max(files, key=os.path.getmtime) if files else None


def allocation_kind(desc):
    for key, kind in (("parameter", "parameter"), ("preallocated-temp", "temp"),
                      ("output shape", "output"), ("constant", "constant"),
                      ("thread-local", "thread-local")):
        if key in desc:
            return kind
    return "other"


def live_bytes(assignment, live_range):
    """XLA's own account of an order: from its buffer assignment (every
    allocation, every value's offset in it) and its live ranges (each
    value's first and last instruction, inclusive), the most bytes live
    values cover at one instruction (values XLA wrote in place, at the same
    bytes, once), and at that instruction the bytes of each kind of
    allocation no live value covers. `Total bytes` (the sum of the
    allocations) is the one plus the other, so the idle bytes say where
    XLA's total exceeds the live bytes: a parameter's allocation left empty
    after the parameter died (XLA reuses such an allocation only for values
    that fit inside it) or a gap in the temp heap."""
    allocs, values, cur = {}, [], None
    for line in assignment.splitlines():
        m = re.match(r"allocation (\d+): size (\d+), (.*)", line)
        if m:
            cur = int(m.group(1))
            allocs[cur] = (int(m.group(2)), allocation_kind(m.group(3)), m.group(3).split(" at ")[0])
            continue
        m = re.match(r"\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)", line)
        if m and cur is not None:
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
            values.append((name, cur, int(m.group(3)), int(m.group(2))))
    ranges = {}
    for line in live_range.splitlines():
        m = re.match(r"\s+(\S+):(\d+)-(\d+)$", line)
        if m:
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    steps = max((e for _, e in ranges.values()), default=-1) + 1
    live_at = [[] for _ in range(steps)]
    for name, a, off, size in values:
        first, last = ranges.get(name, (0, -1))  # no range: thread-locals of called computations
        for t in range(first, last + 1):
            live_at[t].append((a, off, off + size))
    best, at, covered = -1, 0, {}
    for t, spans in enumerate(live_at):
        cov = {}
        spans.sort()
        for a, lo, hi in spans:
            c, top = cov.get(a, (0, -1))
            cov[a] = (c + max(0, hi - max(lo, top)), max(top, hi))
        total = sum(c for c, _ in cov.values())
        if total > best:
            best, at, covered = total, t, {a: c for a, (c, _) in cov.items()}
    idle, largest = {}, (-1, "")
    for a, (size, kind, desc) in allocs.items():
        gap = size - covered.get(a, 0)
        idle[kind] = idle.get(kind, 0) + gap
        largest = max(largest, (gap, f"allocation {a}: {desc}"))
    return {"live": max(best, 0), "step": at, "idle": idle, "largest_idle": largest}


def xla_run(module, work, tag, seed):
    """Compiles and runs `module` in a fresh process (XLA reads XLA_FLAGS once)."""
    dump = os.path.join(work, f"dump_{tag}")
    os.makedirs(dump, exist_ok=True)
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}", JAX_PLATFORMS="cpu")
    out = os.path.join(work, f"{tag}.npz")
    subprocess.run([sys.executable, __file__, "--one", module, "--out", out, "--seed", str(seed)],
                   env=env, check=True)
    report = newest(dump, "cpu_after_optimizations-memory-usage-report.txt")
    total = None
    if report:
        m = re.search(r"Total bytes: (\d+)", open(report).read())
        total = int(m.group(1)) if m else None
    compiled = newest(dump, "cpu_after_optimizations.txt")
    order = entry_order(open(compiled).read()) if compiled else None
    outs = np.load(out)
    assignment = newest(dump, "cpu_after_optimizations-buffer-assignment.txt")
    ranges = newest(dump, "cpu_after_optimizations-live-range.txt")
    live = live_bytes(open(assignment).read(), open(ranges).read()) if assignment and ranges else None
    return {"total": total, "order": order, "outs": [outs[k] for k in outs.files], "live": live}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module")
    ap.add_argument("--memplan", default="target/release/memplan")
    ap.add_argument("--time-limit", default="10")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="folder for the plan, the relisted module and XLA's dumps")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--xla-allocations", action="store_true",
                    help="plan with `memplan plan --xla-allocations` (XLA's per-parameter allocations)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        compile_and_run(a.module, a.out, a.seed)
        return

    if a.work:
        os.makedirs(a.work, exist_ok=True)
        result = compare(a, a.work)
        result["work"] = a.work
    else:
        # XLA's dumps of a large module take hundreds of MB: without --work
        # they go to a temporary folder removed at the end.
        with tempfile.TemporaryDirectory(prefix="xla_run_scheduled_") as work:
            result = compare(a, work)
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k:34} {v:.4f}" if isinstance(v, float) else f"{k:34} {v}")
    if not (result["xla_kept_memplan_order"] and result["outputs_close"]):
        sys.exit(1)


def compare(a, work):
    """Plans the module, relists it in memplan's order, runs both with XLA
    in `work` and returns what main prints."""
    plan, relisted = os.path.join(work, "plan.json"), os.path.join(work, "relisted.txt")
    extra = ["--xla-allocations"] if a.xla_allocations else []
    res = subprocess.run([a.memplan, "plan", a.module, "-o", plan, "--json",
                          "--time-limit", a.time_limit] + extra, check=True, capture_output=True, text=True)
    planned = json.loads(res.stdout)
    subprocess.run([a.memplan, "export", "--hlo", a.module, "--plan", plan, "-o", relisted] + extra,
                   check=True, capture_output=True)

    orig = xla_run(a.module, work, "original", a.seed)
    mine = xla_run(relisted, work, "memplan", a.seed)
    want = entry_order(read_text(relisted))
    kept = mine["order"] == want
    same = len(orig["outs"]) == len(mine["outs"]) and all(
        x.shape == y.shape and np.array_equal(x, y, equal_nan=True)
        for x, y in zip(orig["outs"], mine["outs"]))
    close = same or all(np.allclose(x, y, rtol=1e-6, atol=1e-6, equal_nan=True)
                        for x, y in zip(orig["outs"], mine["outs"]))
    # With --xla-allocations memplan estimates XLA's own total for the order.
    pred = planned.get("xla_estimate_bytes", planned["max_live_bytes"])
    replicas, partitions = mesh(read_text(a.module))
    result = {
        "module": a.module,
        "instructions": len(want),
        "devices": replicas * partitions,
        "xla_kept_memplan_order": kept,
        "outputs": len(mine["outs"]),
        "outputs_bitwise_equal": same,
        "outputs_close": close,
        "memplan_max_live_bytes": planned["max_live_bytes"],
        "memplan_prediction_bytes": pred,
        "memplan_arena_bytes": planned["arena_bytes"],
        "memplan_lower_bound_bytes": planned["lower_bound_bytes"],
        "xla_total_bytes_original": orig["total"],
        "xla_total_bytes_memplan_order": mine["total"],
        "xla_memplan_order_vs_prediction": mine["total"] / pred if mine["total"] and pred else None,
    }
    if mine["live"]:
        # Where XLA's total goes for memplan's order: the bytes live values
        # cover at XLA's busiest instruction, and what no value covers there.
        lv = mine["live"]
        result.update({
            "xla_live_bytes_memplan_order": lv["live"],
            "xla_live_vs_max_live": lv["live"] / planned["max_live_bytes"] if planned["max_live_bytes"] else None,
            "xla_idle_bytes_at_peak": sum(lv["idle"].values()),
            "xla_idle_parameter_bytes_at_peak": lv["idle"].get("parameter", 0),
            "xla_idle_temp_bytes_at_peak": lv["idle"].get("temp", 0),
            "xla_largest_idle_allocation": f"{lv['largest_idle'][1]} ({lv['largest_idle'][0]} bytes)",
        })
    return result


if __name__ == "__main__":
    main()
