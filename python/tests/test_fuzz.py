"""Issue 41: no input to the Python entry points crashes, hangs or raises
anything but a clear error. Seeded random inputs (mutations of a small
valid graph and plan, spec strings, hostile numbers) go to memplan.plan,
check, fit, example, at_batch and max_batch; each call either answers or
raises MemplanError (a ValueError) or a TypeError / ValueError with a
message. The calls run in a child interpreter, so an abort or a hang is
seen as one (not as a dead test runner).

MEMPLAN_FUZZ_CASES sets the number of cases (default 200);
MEMPLAN_FUZZ_SEED the seed.
"""

import copy
import json
import os
import pathlib
import random
import subprocess
import sys
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]

GRAPH = {
    "format": "memplan-graph",
    "version": 1,
    "name": "fuzz",
    "tensors": [
        {"id": "w", "size": 4096, "align": 256, "role": "parameter", "lifetime": "persistent",
         "dtype": "f32", "shape": [32, 32]},
        {"id": "x", "size": 2048, "role": "input", "lifetime": "persistent"},
        {"id": "y", "size": 2048},
        {"id": "yt", "size": 2048, "view_of": "y"},
        {"id": "loss", "size": 4, "role": "output", "lifetime": "persistent"},
        {"id": "dy", "size": 2048},
        {"id": "dw", "size": 4096, "role": "gradient"},
    ],
    "ops": [
        {"id": "fc", "kind": "forward", "type": "matmul", "inputs": ["x", "w"], "outputs": ["y"],
         "cost": 1.5e-6, "flops": 32768, "attrs": {"m": 16, "k": 32, "n": 32}},
        {"id": "t", "kind": "forward", "type": "view", "inputs": ["y"], "outputs": ["yt"]},
        {"id": "loss", "kind": "forward", "type": "mse", "inputs": ["yt"], "outputs": ["loss"]},
        {"id": "loss_bwd", "kind": "backward", "type": "mse_backward", "inputs": ["yt"],
         "outputs": ["dy"], "reuse": [{"output": "dy", "input": "yt"}]},
        {"id": "fc_dw", "kind": "backward", "type": "matmul", "inputs": ["x", "dy"],
         "outputs": ["dw"], "flops": 32768},
        {"id": "sgd", "kind": "optimizer", "type": "sgd", "inputs": ["dw"], "updates": ["w"],
         "attrs": {"lr": 0.01}},
    ],
    "orders": {"eager": ["fc", "t", "loss", "loss_bwd", "fc_dw", "sgd"]},
    "metadata": {"batch": 2},
}

class Marker(dict):
    """A value the child builds itself (it has no JSON form)."""


def big(exp, sign=1):
    return Marker({"$int": [exp, sign]})


# Values that replace a field's value.
HOSTILE = [
    None, True, False, 0, -1, 1, 2 ** 63, 2 ** 64, 2 ** 64 - 1, -(2 ** 63) - 1, 10 ** 30,
    float("nan"), float("inf"), float("-inf"), -0.0, 1e300, 1.5, "", "x", "ü🦀", "\x00",
    "NaN", [], [None], ["w", "w"], {}, {"a": 1}, [[[]]], "1e300", "-1",
]

# Hostile scalars for time_limit, budget, max_added, batches.
NUMBERS = [
    None, True, 0, -1, 1, 0.5, 1e-9, 1e300, -1e300, float("nan"), float("inf"), float("-inf"),
    2 ** 64, 2 ** 64 - 1, 2 ** 63, -(2 ** 64), 10 ** 100, "", "1", "24GiB", "1 ZiB", "75%",
    "nan", "-5 GB", "1e400 B", "ü", [], {}, 3 + 4j, b"1", big(400), big(400, -1), big(5000),
    big(5000, -1), big(19), 1e-320,
]

SPECS = [
    "mlp", "gpt2-tiny", "llama-tiny", "nope", "", ",", "mlp,", "mlp,,", "mlp,batch=0",
    "mlp,batch=-1", "gpt2-tiny,layers=1000000", "gpt2-tiny,seq=18446744073709551616",
    "gpt2-tiny,seq=0", "gpt2-tiny,world=0", "gpt2-tiny,world=1000000",
    "gpt2-tiny,world=2,prefetch=4294967296", "gpt2-tiny,clip=nan", "gpt2-tiny,clip=-1",
    "gpt2-tiny,dtype=f64", "llama-tiny,mixed,checkpoint,fused", "gpt2-tiny,unknown=1",
    "gpt2-tiny,batch=1e3", "ü🦀", "mlp\x00", "gpt2-tiny,world=2,flat,noreshard,reduce=bf16",
    "gpt2-tiny,layers=2,layers=3", "llama3-8b,layers=1000000", "gpt2-tiny,batch=4294967297",
]

# Each case: which entry point, and its arguments (all JSON-serialisable
# except for the marked non-finite floats and odd Python objects, which
# the child rebuilds).
CHILD = r"""
import json, math, sys, traceback
sys.path.insert(0, sys.argv[1])
import memplan

def decode(x):
    if isinstance(x, dict):
        if set(x) == {"$float"}:
            return float(x["$float"])
        if set(x) == {"$complex"}:
            return complex(*x["$complex"])
        if set(x) == {"$bytes"}:
            return x["$bytes"].encode()
        if set(x) == {"$int"}:
            return 10 ** x["$int"][0] * x["$int"][1]
        if set(x) == {"$cyclic"}:
            doc = decode(x["$cyclic"])
            doc["tensors"] = [doc, doc]
            doc["self"] = doc
            return doc
        if set(x) == {"$deep"}:
            deep = []
            for _ in range(x["$deep"]):
                deep = [deep]
            return {"format": "memplan-graph", "version": 1, "tensors": deep, "ops": []}
        if set(x) == {"$nan_key"}:
            doc = decode(x["$nan_key"])
            doc[float("nan")] = 1
            return doc
        return {k: decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode(v) for v in x]
    return x

for line in sys.stdin:
    case = json.loads(line)
    fn = getattr(memplan, case["fn"])
    args, kwargs = decode(case["args"]), decode(case["kwargs"])
    try:
        fn(*args, **kwargs)
        outcome = ["ok", ""]
    except memplan.MemplanError as e:
        outcome = ["MemplanError", str(e)]
    except (TypeError, ValueError) as e:
        outcome = [type(e).__name__, str(e)]
    except BaseException as e:
        outcome = [type(e).__name__, traceback.format_exc()]
    print(json.dumps(outcome), flush=True)
"""


def encode(x):
    """`x` as JSON the child decodes back (non-finite floats, complex and
    bytes marked)."""
    if isinstance(x, float) and not (x == x and abs(x) != float("inf")):
        return {"$float": repr(x)}
    if isinstance(x, complex):
        return {"$complex": [x.real, x.imag]}
    if isinstance(x, bytes):
        return {"$bytes": x.decode()}
    if isinstance(x, Marker):
        return dict(x)
    if isinstance(x, dict):
        return {k: encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [encode(v) for v in x]
    return x


def mutate(doc, rng):
    """`doc` with a few random changes: values replaced, keys dropped or
    added, elements duplicated or removed, ids repeated, cycles."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 4)):
        # A random place: walk down to a container.
        node = doc
        for _ in range(rng.randint(0, 4)):
            kids = list(node.values()) if isinstance(node, dict) else node
            kids = [k for k in kids if isinstance(k, (dict, list)) and k]
            if not kids:
                break
            node = rng.choice(kids)
        what = rng.randrange(7)
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            if what <= 2:
                node[key] = rng.choice(HOSTILE)
            elif what == 3:
                del node[key]
            elif what == 4:
                node[rng.choice(["unknown", "id", "size", "after", "view_of", "updates"])] = \
                    rng.choice(HOSTILE + ["w", "y", "fc", "sgd", ["fc"], ["sgd"]])
            else:
                node[key] = copy.deepcopy(rng.choice(list(node.values())))
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if what <= 1:
                node[i] = rng.choice(HOSTILE)
            elif what == 2:
                del node[i]
            elif what <= 4:
                node.append(copy.deepcopy(node[i]))  # duplicate ids
            else:
                node.insert(0, copy.deepcopy(node[-1]))
    if rng.random() < 0.15 and isinstance(doc.get("ops"), list) and doc["ops"]:
        # A cycle through control edges.
        ops = [o for o in doc["ops"] if isinstance(o, dict)]
        if ops:
            first, last = ops[0], ops[-1]
            first["after"] = [last.get("id")]
    return doc


def graph(rng):
    r = rng.random()
    if r < 0.6:
        return mutate(GRAPH, rng)
    if r < 0.7:
        return copy.deepcopy(GRAPH)
    if r < 0.8:
        g = mutate(GRAPH, rng)
        return json.dumps(encode(g)) if rng.random() < 0.5 else json.dumps(g)[: rng.randint(0, 200)]
    if r < 0.85:
        return rng.choice([
            Marker({"$cyclic": mutate(GRAPH, rng)}),
            Marker({"$deep": rng.choice([10, 200, 1000, 100000])}),
            Marker({"$nan_key": mutate(GRAPH, rng)}),
            "[" * 100000,
            '{"format": "memplan-graph", "version": 1, "tensors": ' + "[" * 5000 + "]" * 5000 + "}",
            json.dumps(GRAPH).replace("4096", "1" + "0" * 400),
            json.dumps(GRAPH).replace("4096", "-4096"),
            json.dumps(GRAPH).replace("4096", "4096.5"),
            json.dumps(GRAPH).replace("1.5e-6", "1e999"),
            json.dumps(GRAPH).replace('"w"', '"\ud800"'),
            "{\udc80",
        ])
    return rng.choice([
        None, 1, "", "{", "{}", "[]", "/dev/null", "/no/such/file.json", str(ROOT), "ü🦀.json",
        str(ROOT / "fixtures" / "graphs" / "mlp.json.gz"), str(ROOT / "fixtures" / "peaks.json"),
        str(ROOT / "README.md"), [], b"{}", {"format": "memplan-graph"}, "x.json.gz",
        str(ROOT / "fixtures" / "minimalloc" / "example.12.csv"),
    ])


def plan_doc(rng, valid_plan):
    r = rng.random()
    if r < 0.6:
        return mutate(valid_plan, rng)
    if r < 0.7:
        return copy.deepcopy(valid_plan)
    return rng.choice([None, "", "{}", {}, "/dev/null", 3, [], {"order": []}])


def number(rng, good):
    return rng.choice(good) if rng.random() < 0.5 else rng.choice(NUMBERS)


def cases(n, seed, valid_plan):
    rng = random.Random(seed)
    out = []
    fns = ["plan", "check", "fit", "example", "at_batch", "max_batch"]
    for _ in range(n):
        fn = rng.choice(fns)
        args, kwargs = [], {}
        if fn == "plan":
            args = [graph(rng)]
            if rng.random() < 0.8:
                kwargs["time_limit"] = number(rng, [0.5, 1])
        elif fn == "check":
            args = [graph(rng), plan_doc(rng, valid_plan)]
        elif fn == "fit":
            args = [graph(rng)]
            kwargs["time_limit"] = number(rng, [0.5, 1])
            if rng.random() < 0.7:
                kwargs["budget"] = number(rng, [8192, 16384, "12KiB", 1 << 20, 0])
            if rng.random() < 0.4:
                kwargs["max_added"] = number(rng, [0.001, 0.5, 0])
            if rng.random() < 0.3:
                kwargs["minimise"] = rng.choice(["time", "flops", "memory", "", None, 1])
        elif fn == "example":
            args = [rng.choice(SPECS) if rng.random() < 0.85 else rng.choice(NUMBERS)]
        else:
            g1 = graph(rng) if rng.random() < 0.6 else copy.deepcopy(GRAPH)
            g2 = mutate(GRAPH, rng) if rng.random() < 0.3 else copy.deepcopy(GRAPH)
            if isinstance(g2, dict):
                g2["metadata"] = {"batch": rng.choice([3, 2, 0, -1, 2 ** 64, 1.5, "3", None])}
            if fn == "at_batch":
                args = [g1, g2, number(rng, [1, 4, 8, 0, 2 ** 40])]
            else:
                args = [g1, g2, number(rng, [1 << 20, "1MiB", 1 << 30, 0])]
                kwargs["probe_time"] = number(rng, [0.2, 0.5])
            if rng.random() < 0.4:
                kwargs["batches"] = rng.choice([
                    (2, 3), (3, 2), (2, 2), (0, 1), [1, 2 ** 64], (1,), (2, 3, 4), "2,3", None,
                    (2.0, 3.0), (-1, 2), (True, 3),
                ])
        out.append({"fn": fn, "args": encode(args), "kwargs": encode(kwargs)})
    return out


def run_cases(batch, timeout=60):
    """Runs `batch` in a child interpreter; its outcomes, its return code
    and its standard error."""
    lines = "".join(json.dumps(c) + "\n" for c in batch)
    import memplan
    where = str(pathlib.Path(memplan.__file__).resolve().parents[1])
    p = subprocess.run([sys.executable, "-c", CHILD, where], input=lines,
                       capture_output=True, text=True, timeout=timeout)
    outcomes = [json.loads(line) for line in p.stdout.splitlines()]
    return outcomes, p.returncode, p.stderr


class Fuzz(unittest.TestCase):
    def check_outcomes(self, batch, outcomes, rc, err):
        if os.environ.get("MEMPLAN_FUZZ_VERBOSE"):
            for case, (kind, msg) in zip(batch, outcomes):
                print(case["fn"], kind, msg.splitlines()[0][:150] if msg else "", file=sys.stderr)
        for case, got in zip(batch, outcomes):
            kind, msg = got
            self.assertIn(kind, ("ok", "MemplanError", "TypeError", "ValueError"),
                          f"{case}: {msg}")
            if kind != "ok":
                self.assertTrue(msg.strip(), f"{case}: {kind} without a message")
        if len(outcomes) < len(batch):
            self.fail(f"the interpreter died (return code {rc}) on "
                      f"{batch[len(outcomes)]}:\n{err[-2000:]}")
        self.assertEqual(rc, 0, err[-2000:])

    def test_random_inputs_raise_clear_errors(self):
        import memplan
        valid_plan = memplan.plan(GRAPH, time_limit=1)
        n = int(os.environ.get("MEMPLAN_FUZZ_CASES", "200"))
        seed = int(os.environ.get("MEMPLAN_FUZZ_SEED", "41"))
        batch = cases(n, seed, valid_plan)
        # In chunks, so a hang or a crash names a small set of cases.
        for i in range(0, len(batch), 50):
            chunk = batch[i:i + 50]
            try:
                outcomes, rc, err = run_cases(chunk)
            except subprocess.TimeoutExpired:
                self.fail(f"cases {i}..{i + len(chunk)} of seed {seed} hung")
            self.check_outcomes(chunk, outcomes, rc, err)

    def test_found_by_fuzzing(self):
        """Inputs the fuzzing found, as fixed cases: each hung or raised
        another exception type; now a MemplanError naming the problem."""
        fixed = [
            # A graph that contains itself hung (_first_non_finite looped).
            (("plan", [Marker({"$cyclic": GRAPH})], {}), "contains itself"),
            # Deep nesting raised RecursionError.
            (("check", [Marker({"$deep": 100000}), {}], {}), "nested too deeply"),
            # Ints beyond any float raised OverflowError.
            (("plan", [GRAPH], {"time_limit": big(400)}), "time_limit must be at most 1e9 seconds"),
            (("fit", [GRAPH], {"max_added": big(400)}), "max_added must be a share"),
            (("max_batch", [GRAPH, GRAPH, 1 << 20], {"probe_time": big(400)}),
             "probe_time must be at most 1e9 seconds"),
            # Ints of more than 4300 digits raised ValueError from str().
            (("example", [big(5000)], {}), "spec must be a string"),
            (("fit", [GRAPH], {"budget": 1 << 20, "minimise": big(5000)}),
             "minimise must be 'time' or 'flops'"),
            (("at_batch", [GRAPH, GRAPH, big(5000)], {}), "batch must be between 0 and 2**64 - 1"),
            (("fit", [GRAPH], {"budget": big(5000, -1)}), "not a negative int of 16610 bits"),
            # A NaN key was reported as a circular reference.
            (("plan", [Marker({"$nan_key": GRAPH})], {}), "has the key nan"),
        ]
        batch = [{"fn": fn, "args": encode(args), "kwargs": encode(kwargs)}
                 for (fn, args, kwargs), _ in fixed]
        try:
            outcomes, rc, err = run_cases(batch, timeout=30)
        except subprocess.TimeoutExpired:
            self.fail("a fixed case hung")
        self.check_outcomes(batch, outcomes, rc, err)
        for ((fn, _, _), says), (kind, msg) in zip(fixed, outcomes):
            self.assertEqual(kind, "MemplanError", f"{fn}: {msg}")
            self.assertIn(says, msg)


if __name__ == "__main__":
    unittest.main()
