"""The Python package against the Rust core: plans, checks, and errors."""

import copy
import gzip
import json
import os
import pathlib
import tempfile
import unittest

import memplan

ROOT = pathlib.Path(__file__).resolve().parents[2]
GPT2_TINY = ROOT / "fixtures" / "graphs" / "gpt2-tiny.json.gz"

TWO_OPS = {
    "format": "memplan-graph",
    "version": 1,
    "name": "two-ops",
    "tensors": [
        {"id": "x", "size": 1024, "role": "input", "lifetime": "persistent"},
        {"id": "h", "size": 4096},
        {"id": "y", "size": 1024, "role": "output", "lifetime": "persistent"},
    ],
    "ops": [
        {"id": "f", "inputs": ["x"], "outputs": ["h"]},
        {"id": "g", "inputs": ["h"], "outputs": ["y"]},
    ],
}


class PlanAndCheck(unittest.TestCase):
    def test_plans_a_dict_and_the_plan_checks(self):
        p = memplan.plan(TWO_OPS, time_limit=1)
        self.assertEqual(p["order"], ["f", "g"])
        self.assertEqual(p["arena_bytes"], 6144)
        offsets = {t["id"]: t["offset"] for t in p["tensors"]}
        self.assertEqual(set(offsets), {"x", "h", "y"})
        report = memplan.check(TWO_OPS, p)
        self.assertEqual(report["max_live_bytes"], 6144)
        self.assertEqual(report["ops"], 2)

    def test_plans_a_shipped_graph_file_at_its_floor(self):
        p = memplan.plan(GPT2_TINY, time_limit=2)
        stats = p["stats"]
        self.assertLessEqual(stats["lower_bound_bytes"], p["arena_bytes"])
        self.assertLessEqual(p["arena_bytes"], 1.01 * stats["lower_bound_bytes"])
        memplan.check(GPT2_TINY, p)
        # The same graph as a JSON string, from a plain .json file.
        text = gzip.decompress(GPT2_TINY.read_bytes()).decode()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "g.json")
            with open(path, "w") as f:
                f.write(text)
            self.assertEqual(memplan.check(path, p), memplan.check(text, json.dumps(p)))

    def test_baselines_of_a_graph(self):
        # Program order f, g: x 1024 + h 4096 at f, then h + y at g.
        b = memplan.baselines(TWO_OPS)
        self.assertEqual(b["baselines"]["program-order"]["footprint_bytes"], 6144)
        self.assertTrue(b["baselines"]["program-order"]["description"].startswith("program order"))
        self.assertIn(b["best_eager"], b["baselines"])
        self.assertGreaterEqual(b["baselines"][b["best_eager"]]["footprint_bytes"], 6144)
        self.assertEqual(memplan.baselines(TWO_OPS, "cpu")["baselines"]["program-order"]["footprint_bytes"], 6144)
        # The old name reads for one release, with a warning naming the new one.
        with self.assertWarnsRegex(DeprecationWarning, "'peak_bytes' is deprecated: use 'footprint_bytes'"):
            self.assertEqual(b["baselines"]["program-order"]["peak_bytes"], 6144)
        self.assertIn("peak_bytes", b["baselines"]["program-order"])
        self.assertEqual(json.loads(json.dumps(b))["baselines"]["program-order"],
                         {"footprint_bytes": 6144, "description": b["baselines"]["program-order"]["description"]})
        with self.assertRaisesRegex(memplan.MemplanError, "device 'tpu'"):
            memplan.baselines(TWO_OPS, "tpu")
        with self.assertRaisesRegex(memplan.MemplanError, "unknown"):
            memplan.baselines({**TWO_OPS, "ops": [{"id": "f", "inputs": ["nope"], "outputs": ["h"]}]})

    def test_plan_split_chunks_the_loss_chain_where_it_lowers_the_arena(self):
        g = memplan.example("gpt2-tiny")
        whole = memplan.plan(g, time_limit=2)["arena_bytes"]
        two = memplan.plan_split(g, split=2, time_limit=2)
        self.assertEqual(two["split"]["chunks"], 2)
        self.assertEqual((two["split"]["chains"], two["split"]["regions"]), (1, 0))  # GPT-2's MLP: linear ops
        self.assertLess(two["plan"]["arena_bytes"], whole)
        self.assertEqual(memplan.check(two["graph"], two["plan"])["max_live_bytes"],
                         two["plan"]["stats"]["max_live_bytes"])
        auto = memplan.plan_split(g, time_limit=2)
        self.assertLessEqual(auto["plan"]["arena_bytes"], two["plan"]["arena_bytes"])
        self.assertEqual(auto["split"]["tried"][0][0], 1)  # the step as it is, first
        self.assertEqual(memplan.plan_split(g, split="off", time_limit=2)["split"]["chunks"], 1)
        # A checkpointed Llama's MLPs split too (row-wise regions), each
        # block's forward and its recomputed forward with its backward.
        llama = memplan.plan_split(memplan.example("llama-tiny,checkpoint"), split=2, time_limit=2)
        self.assertEqual((llama["split"]["chains"], llama["split"]["regions"]), (1, 4))
        self.assertEqual(memplan.check(llama["graph"], llama["plan"])["max_live_bytes"],
                         llama["plan"]["stats"]["max_live_bytes"])
        # A graph with no loss chain is planned as it is.
        self.assertEqual(memplan.plan_split(TWO_OPS, time_limit=1)["split"]["chunks"], 1)
        for bad in (True, 1.5, None, "some", 0):
            with self.subTest(split=bad), self.assertRaises(memplan.MemplanError) as e:
                memplan.plan_split(g, split=bad, time_limit=1)
            self.assertEqual(e.exception.kind, "invalid_argument")
            self.assertIn("split", str(e.exception))

    def test_fit_within_a_share_after_what_the_graph_already_adds(self):
        # A step split outside memplan.fit (as memplan.torch splits a
        # captured one): the share is of the step before, the split's FLOPs
        # count against it, and a share they alone exceed is refused.
        g = memplan.example("gpt2-tiny")
        step = memplan.fit(g, max_added=0.0, minimise="flops", time_limit=1)["step_flops"]
        added = 0.004 * step
        f = memplan.fit(g, max_added=0.01, minimise="flops", time_limit=2, already_added_flops=added)
        self.assertLessEqual(f["added_flops"] + added, 0.01 * (step - added) * (1 + 1e-9))
        self.assertEqual(memplan.check(f["graph"], f["plan"])["max_live_bytes"], f["max_live_bytes"])
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.fit(g, max_added=0.01, minimise="flops", time_limit=1, already_added_flops=0.02 * step)
        self.assertEqual(e.exception.kind, "does_not_fit")
        self.assertIn("more than max_added=0.01", str(e.exception))
        for bad in (-1, float("nan"), True, "many"):
            with self.subTest(already=bad), self.assertRaises(memplan.MemplanError):
                memplan.fit(g, max_added=0.01, time_limit=1, already_added_flops=bad)
        with self.assertRaises(TypeError):
            memplan.fit(g, budget=10 ** 9, already_added_flops=1.0)

    def test_fit_may_offload_to_host_memory(self):
        # gpt2-tiny's state is most of its peak: offload takes it below the
        # plan; the step with its copies and its plan check, host pool
        # included; within a slowdown the modeled time stays within it.
        g = memplan.example("gpt2-tiny")
        base = memplan.plan(g, time_limit=2)["arena_bytes"]
        budget = base * 9 // 10
        f = memplan.fit(g, budget, time_limit=10, offload={"device": "h200-pcie5"})
        self.assertLessEqual(f["arena_bytes"], budget)
        o = f["offload"]
        self.assertGreater(o["host_bytes"], 0)
        self.assertEqual(o["device"], "h200-pcie5")
        self.assertGreaterEqual(o["modeled_seconds"], o["compute_seconds"])
        report = memplan.check(f["graph"], f["plan"])
        self.assertEqual(report["host_max_live_bytes"], o["host_bytes"])
        self.assertTrue(any(t.get("space") == "host" for t in f["graph"]["tensors"]))
        s = memplan.fit(g, offload=True, max_slowdown=0.2, time_limit=10)["offload"]
        self.assertLessEqual(s["modeled_seconds"], s["modeled_seconds_without_offload"] * 1.2 * (1 + 1e-9))
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.fit(g, 1, offload=True, time_limit=2)
        self.assertEqual(e.exception.kind, "does_not_fit")
        self.assertIn("bound", str(e.exception))
        for opts, kind, want in (({"device": "tpu"}, "invalid_argument", "unknown device preset"),
                                 ({"link_gbps": 0}, "invalid_argument", "link_gbps"),
                                 ({"link_gbps": float("nan")}, "invalid_argument", "link_gbps"),
                                 ({"host_memory": "lots"}, "invalid_argument", "host_memory")):
            with self.subTest(opts=opts), self.assertRaises(memplan.MemplanError) as e:
                memplan.fit(g, budget, offload=opts, time_limit=2)
            self.assertEqual(e.exception.kind, kind)
            self.assertIn(want, str(e.exception))
        for kw in ({"max_added": 0.01}, {"max_slowdown": 0.1}, {"offload": {"colour": "red"}},
                   {"offload": True, "split": "auto"}):
            with self.subTest(kw=kw), self.assertRaises(TypeError):
                memplan.fit(g, budget if "max_added" not in kw else None, **{"offload": True, **kw})

    def test_fit_may_split(self):
        # Within a share of the step's FLOPs the split's own FLOPs count; the
        # split step fitted into the split plan's arena recomputes nothing;
        # each answer checks; bad split values are refused as for plan_split.
        g = memplan.example("gpt2-tiny")
        split = memplan.plan_split(g, split=2, time_limit=2)
        within = memplan.fit(g, max_added=0.01, minimise="flops", time_limit=4, split=2)
        self.assertIn(within["split"]["chunks"], (1, 2))
        self.assertLessEqual(within["added_flops"], 0.01 * within["split"]["step_flops"] * (1 + 1e-9))
        plain = memplan.fit(g, max_added=0.01, minimise="flops", time_limit=2)
        self.assertLessEqual(within["arena_bytes"], plain["arena_bytes"])
        memplan.check(within["graph"], within["plan"])
        budget = split["plan"]["arena_bytes"]
        into = memplan.fit(g, budget, minimise="flops", time_limit=4, split=2)
        self.assertLessEqual(into["arena_bytes"], budget)
        self.assertGreaterEqual(into["added_flops"], into["split"]["added_flops"])
        if into["split"]["chunks"] == 2:  # the split step fits as it is (or recomputation was cheaper)
            self.assertTrue(any(op["id"].endswith(".chunk1") for op in into["graph"]["ops"]))
        memplan.check(into["graph"], into["plan"])
        for bad in (True, 1.5, "some"):
            with self.subTest(split=bad), self.assertRaises(memplan.MemplanError) as e:
                memplan.fit(g, max_added=0.01, split=bad, time_limit=1)
            self.assertEqual(e.exception.kind, "invalid_argument")
        self.assertNotIn("split", memplan.fit(g, max_added=0.01, time_limit=1))

    def test_a_broken_plan_is_refused_with_the_reason(self):
        p = memplan.plan(TWO_OPS, time_limit=1)
        swapped = copy.deepcopy(p)
        swapped["order"] = ["g", "f"]
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.check(TWO_OPS, swapped)
        self.assertIn("the plan is invalid", str(e.exception))
        small = copy.deepcopy(p)
        small["arena_bytes"] = 1024
        with self.assertRaises(memplan.MemplanError):
            memplan.check(TWO_OPS, small)

    def test_built_in_examples_plan_with_the_cli_spec(self):
        # One rank of a per-parameter FSDP2 step over two ranks.
        g = memplan.example("llama-tiny,world=2,mixed")
        self.assertEqual(g["metadata"]["fsdp_layout"], "per-parameter")
        types = {op["type"] for op in g["ops"]}
        self.assertTrue({"all_gather", "copy_out", "chunk_cat", "reduce_scatter"} <= types, types)
        p = memplan.plan(g, time_limit=2)
        self.assertEqual(memplan.check(g, p)["ops"], len(g["ops"]))
        flat = memplan.example("example:llama-tiny,world=2,mixed,flat")
        self.assertEqual(flat["metadata"]["fsdp_layout"], "flat")
        self.assertLess(len(flat["ops"]), len(g["ops"]))
        with self.assertRaisesRegex(memplan.MemplanError, "unknown example"):
            memplan.example("gpt5")

    def test_bad_input_raises_memplan_error(self):
        bad = copy.deepcopy(TWO_OPS)
        bad["ops"][1]["inputs"] = ["nowhere"]
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.plan(bad)
        self.assertIn("nowhere", str(e.exception))
        with self.assertRaises(memplan.MemplanError):
            memplan.plan(TWO_OPS, time_limit=0)
        with self.assertRaises(memplan.MemplanError) as e:
            memplan.plan("/no/such/graph.json")
        self.assertIn("/no/such/graph.json", str(e.exception))
        with self.assertRaises(TypeError):
            memplan.plan(42)

    def test_errors_say_their_kind(self):
        # MemplanError.kind: the C ABI's MEMPLAN_E_* codes by name.
        def kind(fn, *args, **kw):
            with self.assertRaises(memplan.MemplanError) as e:
                fn(*args, **kw)
            return e.exception.kind
        bad = copy.deepcopy(TWO_OPS)
        bad["ops"][1]["inputs"] = ["nowhere"]
        self.assertEqual(kind(memplan.plan, bad), "input")
        self.assertEqual(kind(memplan.plan, "{"), "input")
        nan = copy.deepcopy(TWO_OPS)
        nan["tensors"][1]["size"] = float("nan")
        self.assertEqual(kind(memplan.plan, nan), "input")
        self.assertEqual(kind(memplan.plan, "/no/such/graph.json"), "io")
        self.assertEqual(kind(memplan.plan, TWO_OPS, time_limit=0), "invalid_argument")
        self.assertEqual(kind(memplan.example, "gpt2-tiny,batch=zero"), "invalid_argument")
        self.assertEqual(kind(memplan.fit, TWO_OPS, budget=1, time_limit=1), "does_not_fit")
        p = memplan.plan(TWO_OPS, time_limit=1)
        p["order"] = list(reversed(p["order"]))
        self.assertEqual(kind(memplan.check, TWO_OPS, p), "invalid_plan")
        self.assertEqual(memplan.MemplanError("x").kind, "invalid_argument")
        from memplan.torch import UnsupportedStep
        self.assertEqual(UnsupportedStep("x").kind, "unsupported")

    def test_bad_arguments_are_memplan_errors_naming_the_element(self):
        # Issue 41: each of these raised TypeError, OverflowError or a bare
        # JSON column before.
        self.assertEqual(memplan._budget("24GiB"), 24 << 30)
        self.assertEqual(memplan._budget("1.5 GB"), 1_500_000_000)
        for bad, says in (("24 parsecs", "unknown unit"), (2 ** 70, "2\\*\\*64"), (-1, "between 0"),
                          (1.5, "number of bytes"), ([1], "number of bytes"), ("-3GB", "non-negative")):
            with self.assertRaisesRegex(memplan.MemplanError, says, msg=repr(bad)):
                memplan.fit(TWO_OPS, budget=bad)
        with self.assertRaisesRegex(memplan.MemplanError, "time_limit"):
            memplan.plan(TWO_OPS, time_limit="soon")
        with self.assertRaisesRegex(memplan.MemplanError, "time limit"):
            memplan.plan(TWO_OPS, time_limit=1e300)
        g = json.loads(json.dumps(TWO_OPS))
        g["tensors"][1]["size"] = float("nan")
        with self.assertRaisesRegex(memplan.MemplanError, r"graph\.tensors\[1\]\.size is nan"):
            memplan.plan(g)
        g = json.loads(json.dumps(TWO_OPS))
        g["ops"][0]["flops"] = float("inf")
        with self.assertRaisesRegex(memplan.MemplanError, r"graph\.ops\[0\]\.flops is inf"):
            memplan.fit(g, max_added=0.1)
        # A budget as a string reaches the fit (which then says it cannot fit 1 byte).
        with self.assertRaisesRegex(memplan.MemplanError, "bound|fit"):
            memplan.fit(TWO_OPS, budget="1B", time_limit=1)
        self.assertTrue(issubclass(memplan.MemplanError, ValueError))
        self.assertEqual(memplan.__version__.count("."), 2)


class EntryPointsNeverCrash(unittest.TestCase):
    """A bounded fuzz of the package's entry points: mutated graphs and
    plans, junk arguments and example specs. Each call returns or raises
    MemplanError (or TypeError for an argument of the wrong kind); a
    panic in the core (pyo3's PanicException, a BaseException), any other
    exception or a crash fails."""

    JUNK = [None, True, -1, 0, 1, 3, 2 ** 64, 2 ** 70, -2 ** 63, 1e308, -0.5, float("nan"), float("inf"), "",
            "x", "1e999", [], [1], {}, {"id": "x"}, "f", "h"]

    def mutate(self, rng, doc):
        doc = copy.deepcopy(doc)
        for _ in range(rng.randint(1, 4)):
            node, key = doc, None
            # Walk to a random place in the document.
            while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
                key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
                if not isinstance(node[key], (dict, list)) or rng.random() < 0.3:
                    break
                node, key = node[key], None
            if key is None or not isinstance(node, (dict, list)) or not node:
                continue
            if isinstance(node, list) and key >= len(node):
                continue
            what = rng.random()
            if what < 0.5:
                node[key] = rng.choice(self.JUNK)
            elif what < 0.7:
                del node[key]
            elif isinstance(node, list):
                node.append(copy.deepcopy(rng.choice(node)))  # a duplicate (same id)
            else:
                node[rng.choice(["inputs", "outputs", "updates", "view_of", "reuse", "kind", "size", "role"])] = \
                    rng.choice(self.JUNK)
        return doc

    def call(self, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except (memplan.MemplanError, TypeError):
            pass
        except BaseException as e:  # noqa: B902 (a panic is a BaseException)
            self.fail(f"{fn.__name__}{args!r:.300} {kwargs!r}: {type(e).__name__}: {e}")

    def test_mutated_graphs_plans_and_arguments(self):
        import random

        rng = random.Random(41)
        base_plan = memplan.plan(TWO_OPS, time_limit=1)
        for _ in range(300):
            g = self.mutate(rng, TWO_OPS)
            self.call(memplan.plan, g, time_limit=0.2)
            self.call(memplan.check, TWO_OPS, self.mutate(rng, base_plan))
            self.call(memplan.check, g, base_plan)
            self.call(memplan.fit, g, budget=rng.choice([0, 4096, 6144, 2 ** 63, "6KiB"]), time_limit=0.2)
            self.call(memplan.fit, g, max_added=rng.choice([0, 0.001, 1e300]), time_limit=0.2)
            self.call(memplan.at_batch, g, self.mutate(rng, TWO_OPS), rng.choice(self.JUNK), (2, 3))
            self.call(memplan.max_batch, g, g, rng.choice(self.JUNK), batches=(2, 3), probe_time=0.2)
            self.call(memplan.plan, TWO_OPS, time_limit=rng.choice(self.JUNK))
        gpt2 = json.loads(gzip.decompress(GPT2_TINY.read_bytes()))
        for _ in range(20):  # a real step's graph, a few ops or tensors broken
            g = self.mutate(rng, gpt2)
            self.call(memplan.plan, g, time_limit=0.2)
            self.call(memplan.fit, g, max_added=0.001, time_limit=0.2)

    def test_example_specs(self):
        import random

        rng = random.Random(7)
        names = ["gpt2-tiny", "llama-tiny", "mlp", "gpt5", ""]
        keys = ["batch", "seq", "layers", "dtype", "clip", "world", "prefetch", "noreshard", "flat", "reduce",
                "checkpoint", "fused", "mixed", "", "=", "batch="]
        values = ["0", "1", "2", "-1", "1e9", "18446744073709551616", "nan", "inf", "bf16", "x", ""]
        for _ in range(120):
            parts = [rng.choice(names)]
            for _ in range(rng.randint(0, 4)):
                k = rng.choice(keys)
                parts.append(k if rng.random() < 0.3 else f"{k}={rng.choice(values)}")
            self.call(memplan.example, ",".join(parts))


if __name__ == "__main__":
    unittest.main()


class OptionalDependencies(unittest.TestCase):
    """A feature whose optional package is missing raises MemplanError (an
    ImportError too) naming the feature and what to install."""

    def run_without(self, blocked, code):
        import subprocess
        import sys

        prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
        return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)

    def test_memplan_torch_without_torch(self):
        out = self.run_without(["torch"], """
import memplan
try:
    import memplan.torch
except memplan.MemplanError as e:
    assert isinstance(e, ImportError), type(e).__mro__
    assert e.kind == "unsupported", e.kind
    print("refused:", e)
else:
    raise SystemExit("memplan.torch imported without torch")
""")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("refused: memplan.torch needs torch, which is not installed", out.stdout)
        self.assertIn("pip install torch", out.stdout)
        # The rest of the package works without it.
        out = self.run_without(["torch"], "import memplan; print(memplan.example('mlp')['name'])")
        self.assertEqual(out.returncode, 0, out.stderr)

    def test_require_names_each_optional_package(self):
        from memplan._optional import MissingDependency, require

        for module, install in (("transformers", "pip install transformers"),
                                ("torchtitan", "pip install torchtitan"), ("jax", "pip install 'jax[cpu]'")):
            with self.subTest(module=module):
                out = self.run_without([module], f"""
from memplan._optional import require
try:
    require({module!r}, "the estimator")
except ImportError as e:
    print(type(e).__name__, e)
""")
                self.assertEqual(out.returncode, 0, out.stderr)
                self.assertIn(f"MissingDependency the estimator needs {module}", out.stdout)
                self.assertIn(install, out.stdout)
        self.assertIs(require("json", "a test").loads, json.loads)
        self.assertTrue(issubclass(MissingDependency, memplan.MemplanError))


class Packaging(unittest.TestCase):
    """What `pip install ./python` installs: the library with its licence
    files, and no benchmark (issue 59). Builds the wheel from the
    extension scripts/python_tests.sh compiled (maturin's dev profile: a
    repackaging) and the sdist."""

    def test_the_wheel_and_the_sdist_carry_the_licences_and_no_benchmarks(self):
        import subprocess
        import sys
        import tarfile
        import zipfile

        maturin = pathlib.Path(sys.executable).with_name("maturin")
        with tempfile.TemporaryDirectory() as out:
            for what in (["build", "--profile", "dev", "--no-default-features"], ["sdist"]):
                r = subprocess.run([str(maturin), *what, "-o", out], cwd=ROOT / "python", capture_output=True,
                                   text=True, timeout=900)
                self.assertEqual(r.returncode, 0, r.stderr[-3000:])
            wheel = next(pathlib.Path(out).glob("*.whl"))
            names = zipfile.ZipFile(wheel).namelist()
            for licence in ("LICENSE-MIT", "LICENSE-APACHE"):
                self.assertIn(f"memplan-{memplan.__version__}.dist-info/licenses/{licence}", names)
            self.assertEqual([n for n in names if "bench" in n], [])
            self.assertIn("memplan/torch/__init__.py", names)
            sdist = next(pathlib.Path(out).glob("*.tar.gz"))
            with tarfile.open(sdist) as t:
                files = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
            self.assertTrue({"LICENSE-MIT", "LICENSE-APACHE"} <= files, sorted(files)[:20])
            text = (ROOT / "LICENSE-MIT").read_text()
            self.assertIn("Permission is hereby granted", text)
