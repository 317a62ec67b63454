"""Time and peak memory of `memplan` commands against graph size, under one
`--time-limit` (issue 41; docs/benchmarks.md, "Time limits").

Runs the built binary, each command in its own process under
`/usr/bin/time -v` (wall time of the whole command, peak resident set):

- `memplan plan --example gpt2-tiny --layers L --time-limit S` for each L;
- `memplan alloc FILE.csv --time-limit S` on MiniMalloc problems of N rows,
  made as benches/pipeline.rs's `crowded(N)` makes them (the same buffers).

and writes a JSON record, a markdown table and an SVG plot (time and peak
memory against size, both commands on one size axis: ops for `plan`,
buffers for `alloc`).

    python3 tools/limits_bench.py --memplan target/release/memplan \
        --layers 100 400 1000 2500 --rows 5000 50000 200000 \
        --json limits.json --svg docs/img/time-limits.svg
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile

MASK = (1 << 64) - 1


def _mix(i, k):
    x = ((i * 0x9E3779B97F4A7C15) & MASK) ^ k
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    return x ^ (x >> 29)


def crowded_csv(n, path):
    """benches/pipeline.rs's `crowded(n)` as a MiniMalloc CSV: starts spread
    over 2n steps, lengths up to 2n/25, sizes 64 B to 16 KiB."""
    span = 2 * n
    rows = ["id,lower,upper,size"]
    for i in range(n):
        lower = _mix(i, 1) % span
        length = 1 + _mix(i, 2) % (span // 25)
        size = 64 * (1 + _mix(i, 3) % 256)
        rows.append(f"{i},{lower},{min(lower + length, span)},{size}")
    pathlib.Path(path).write_text("\n".join(rows) + "\n")


def timed(argv):
    """(wall seconds, peak RSS bytes, stdout) of one command."""
    r = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", r.stderr)
    h, m, s = wall.groups()
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return int(h or 0) * 3600 + int(m) * 60 + float(s), rss * 1024, r.stdout


def measure(memplan, layers, rows, limit):
    out = []
    for n in layers:
        wall, rss, stdout = timed([memplan, "plan", "--example", "gpt2-tiny", "--layers", str(n),
                                   "--time-limit", str(limit), "--json"])
        stats = json.loads(stdout)
        out.append({"command": "plan", "layers": n, "size": stats["ops"], "wall_seconds": wall,
                    "peak_rss_bytes": rss, "arena_bytes": stats.get("arena_bytes", stats["peak_bytes"]),
                    "max_live_bytes": stats["max_live_bytes"],
                    "time_limit_hit": bool(stats.get("time_limit_hit", False))})
    with tempfile.TemporaryDirectory() as d:
        for n in rows:
            csv = pathlib.Path(d) / f"crowded{n}.csv"
            crowded_csv(n, csv)
            wall, rss, stdout = timed([memplan, "alloc", str(csv), "--time-limit", str(limit), "--json"])
            stats = json.loads(stdout)
            out.append({"command": "alloc", "rows": n, "size": n, "wall_seconds": wall, "peak_rss_bytes": rss,
                        "arena_bytes": stats["arena_bytes"], "max_live_bytes": stats["max_live_bytes"],
                        "time_limit_hit": bool(stats.get("time_limit_hit", False))})
    return out


def markdown(rows, limit):
    lines = [f"| command (`--time-limit {limit:g}`) | size | wall | peak RSS | arena / max live |",
             "|---|---|---|---|---|"]
    for r in rows:
        what = (f"`plan --example gpt2-tiny --layers {r['layers']}`" if r["command"] == "plan"
                else f"`alloc` {r['rows']:,}-row CSV")
        unit = "ops" if r["command"] == "plan" else "buffers"
        lines.append(f"| {what} | {r['size']:,} {unit} | {r['wall_seconds']:.2f} s | "
                     f"{r['peak_rss_bytes'] / 1e6:,.0f} MB | {r['arena_bytes'] / r['max_live_bytes']:.3f} |")
    return "\n".join(lines)


def svg(rows, limit, width=760, height=300):
    """Two panels side by side: wall seconds and peak RSS (MB) against
    size (log axis), a line per command, the time limit dashed."""
    import math

    pw, ph, left, top = (width - 120) / 2, height - 80, 60, 30
    sizes = [r["size"] for r in rows]
    lo, hi = math.log10(min(sizes)) - 0.1, math.log10(max(sizes)) + 0.1
    colours = {"plan": "#1f77b4", "alloc": "#d62728"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    panels = [("wall seconds", lambda r: r["wall_seconds"], limit),
              ("peak RSS, MB", lambda r: r["peak_rss_bytes"] / 1e6, None)]
    for p, (title, value, line) in enumerate(panels):
        x0 = left + p * (pw + 60)
        vmax = max(max(value(r) for r in rows), line or 0) * 1.15
        X = lambda s: x0 + (math.log10(s) - lo) / (hi - lo) * pw
        Y = lambda v: top + ph - v / vmax * ph
        out.append(f'<text x="{x0 + pw / 2}" y="{top - 10}" text-anchor="middle">{title}</text>')
        out.append(f'<line x1="{x0}" y1="{top + ph}" x2="{x0 + pw}" y2="{top + ph}" stroke="black"/>')
        out.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{top + ph}" stroke="black"/>')
        for k in range(0, 5):
            v = vmax * k / 4
            out.append(f'<text x="{x0 - 4}" y="{Y(v) + 4}" text-anchor="end">{v:.3g}</text>')
        for e in range(math.ceil(lo), math.floor(hi) + 1):
            out.append(f'<text x="{X(10 ** e)}" y="{top + ph + 14}" text-anchor="middle">1e{e}</text>')
        out.append(f'<text x="{x0 + pw / 2}" y="{top + ph + 30}" text-anchor="middle">'
                   'size (ops for plan, buffers for alloc)</text>')
        if line:
            out.append(f'<line x1="{x0}" y1="{Y(line)}" x2="{x0 + pw}" y2="{Y(line)}" stroke="gray" '
                       'stroke-dasharray="4 3"/>')
            out.append(f'<text x="{x0 + pw}" y="{Y(line) - 3}" text-anchor="end" fill="gray">'
                       f'--time-limit {limit:g}</text>')
        for cmd, colour in colours.items():
            pts = sorted((r["size"], value(r)) for r in rows if r["command"] == cmd)
            if not pts:
                continue
            path = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
            for s, v in pts:
                out.append(f'<circle cx="{X(s):.1f}" cy="{Y(v):.1f}" r="3" fill="{colour}"/>')
            sx, sv = pts[-1]
            out.append(f'<text x="{X(sx) - 4:.1f}" y="{Y(sv) - 6:.1f}" text-anchor="end" fill="{colour}">'
                       f'{cmd}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memplan", default="target/release/memplan", help="the binary to measure")
    p.add_argument("--layers", type=int, nargs="*", default=[100, 400, 1000, 2500])
    p.add_argument("--rows", type=int, nargs="*", default=[5000, 50000, 200000])
    p.add_argument("--time-limit", type=float, default=2.0)
    p.add_argument("--json", help="write the measurements here")
    p.add_argument("--svg", help="write the plot here")
    a = p.parse_args(argv)
    if a.time_limit <= 0:
        p.error("--time-limit must be above 0")
    if any(n < 1 for n in a.layers + a.rows):
        p.error("--layers and --rows must be at least 1")
    if not a.layers and not a.rows:
        p.error("nothing to measure: give --layers or --rows")
    rows = measure(a.memplan, a.layers, a.rows, a.time_limit)
    print(markdown(rows, a.time_limit))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"time_limit_seconds": a.time_limit, "runs": rows}, indent=1))
    if a.svg:
        pathlib.Path(a.svg).write_text(svg(rows, a.time_limit))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
