"""Every Python example in the docs runs as written (issue 41).

The examples are the fenced ```python blocks of README.md, python/README.md
and docs/*.md, the ``python -m memplan...`` commands of their fenced shell
blocks, and the example in the ``memplan`` package's docstring. Each runs
in a fresh temporary directory holding the files the docs name
(``step.json``, ``step-b2.json``, ...), with the names the docs' fragments
take as given (``model``, ``optimizer``, ``batch``, ...) bound to a small
model, so a renamed function, a changed signature or a stale file name
fails here. Rust's tests/doc_examples.rs runs the docs' ``memplan``
commands.
"""

import gzip
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

import torch

import memplan

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "python" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang):
    """(file, line, text) of every fenced block of `lang` in the docs."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) in lang:
                line = text.count("\n", 0, m.start()) + 1
                out.append((doc.relative_to(ROOT).as_posix(), line, m.group(2)))
    return out


TORCHRUN = re.compile(r"^# (\w+\.py): (torchrun .*)$", re.M)


def torchrun_block(text):
    """(file name, torchrun command) of a block that is a multi-rank
    script (its first line ``# NAME.py: torchrun ...``), else None."""
    m = TORCHRUN.match(text)
    return (m.group(1), m.group(2)) if m else None


def shell_commands(prefix):
    """(file, line, argv) of every command of a fenced shell block whose
    program part starts with one of `prefix` (continuations joined,
    comments dropped)."""
    out = []
    for doc, line, text in blocks({"sh", "bash", ""}):
        joined = text.replace("\\\n", " ")
        for i, cmd in enumerate(joined.splitlines()):
            if cmd.strip().startswith(prefix):
                out.append((doc, line + 1 + i, shlex.split(cmd, comments=True)))
    return out


def write_graph(path, graph):
    text = json.dumps(graph)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        pathlib.Path(path).write_text(text)


def files_the_docs_name(where):
    """The input files the examples read, made in `where`: a step's graph
    under the names the docs use, and the same step at batches 2 and 3."""
    step = memplan.example("mlp")
    for name in ("step.json", "step.json.gz", "model.json"):
        write_graph(where / name, step)
    for b in (2, 3):
        write_graph(where / f"step-b{b}.json", memplan.example(f"mlp,batch={b}"))


def language_model():
    """A small Hugging Face GPT-2 with AdamW and token batches: what the
    fragments mean by ``model``, ``optimizer``, ``batch``, ``data`` and
    ``loss_fn`` (vocabulary ``V``, sequence ``T``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    V, T = 96, 16
    cfg = GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    return {
        "torch": torch,
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "batch": torch.randint(0, V, (2, T)),
        "data": [torch.randint(0, V, (2, T)) for _ in range(2)],
        "loss_fn": lambda m, b: m(input_ids=b, labels=b).loss,
        "V": V,
        "T": T,
    }


def export_workload():
    """What docs/torch-export.md's fragment runs: a workload of the export
    catalogue, its model, batch and optimizer."""
    from memplan.torch.export import workloads

    w = workloads.mlp(batch=4)
    return {
        "torch": torch,
        "workload": w,
        "model": w.model,
        "batch": w.batch,
        "optimizer": torch.optim.AdamW(w.model.parameters()),
    }


NAMESPACES = {"docs/torch-export.md": export_workload}


def package_docstring_example():
    """The indented example of the ``memplan`` package's docstring."""
    doc = memplan.__doc__
    start = doc.index("    import memplan")
    end = doc.index("\n\n", doc.index("memplan.max_batch", start))
    return textwrap.dedent(doc[start:end])


class DocExamples(unittest.TestCase):
    def setUp(self):
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="memplan-doc-"))
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.cwd = os.getcwd()
        os.chdir(self.tmp)
        self.addCleanup(os.chdir, self.cwd)
        files_the_docs_name(self.tmp)

    def test_the_docs_have_python_examples(self):
        # The collection itself: a change of fence style must not leave
        # this test with nothing to run.
        found = {doc for doc, _, _ in blocks({"python"})}
        self.assertIn("python/README.md", found)
        self.assertIn("docs/fit.md", found)
        self.assertGreaterEqual(len(shell_commands(("python -m memplan", ".venv/bin/python -m memplan"))), 3)

    def test_every_python_block_runs(self):
        for doc, line, text in blocks({"python"}):
            if torchrun_block(text):
                continue  # a script for several ranks: the next test runs it
            with self.subTest(f"{doc}:{line}"):
                ns = NAMESPACES.get(doc, language_model)()
                exec(compile(text, f"{doc}:{line}", "exec"), ns)

    def test_every_multi_rank_script_runs_under_torchrun(self):
        # A block whose first line names its file and its torchrun command
        # (the README's FSDP2 quick start) runs as written, on its ranks
        # (gloo on the CPU; torchrun --standalone picks a free port),
        # and every rank prints its line.
        scripts = [(doc, line, text) for doc, line, text in blocks({"python"}) if torchrun_block(text)]
        self.assertIn("README.md", {doc for doc, _, _ in scripts})
        torchrun = pathlib.Path(sys.executable).with_name("torchrun")
        for doc, line, text in scripts:
            with self.subTest(f"{doc}:{line}"):
                name, command = torchrun_block(text)
                (self.tmp / name).write_text(text)
                words = shlex.split(command)
                ranks = int(words[words.index("--nproc-per-node") + 1])
                r = subprocess.run([str(torchrun), *words[1:]], cwd=self.tmp, capture_output=True, text=True,
                                   timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
                self.assertEqual(r.returncode, 0, r.stderr[-3000:])
                for rank in range(ranks):
                    self.assertIn(f"rank {rank}:", r.stdout)

    def test_every_relative_link_of_the_readmes_exists(self):
        # README.md and python/README.md are outside the docs site, whose
        # build (mkdocs build --strict, scripts/python_tests.sh) checks the
        # links between its own pages: their links are checked here.
        link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
        found = 0
        for doc in (ROOT / "README.md", ROOT / "python" / "README.md"):
            for target in link.findall(doc.read_text()):
                if "://" in target or target.startswith("mailto:"):
                    continue
                found += 1
                with self.subTest(f"{doc.relative_to(ROOT)}: {target}"):
                    self.assertTrue((doc.parent / target).exists(), f"{target} does not exist")
        self.assertGreater(found, 10)

    def test_the_package_docstring_example_runs(self):
        exec(compile(package_docstring_example(), "memplan.__doc__", "exec"), {})

    def test_every_python_module_command_runs(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python"),
                                                                      os.environ.get("PYTHONPATH")])))
        (self.tmp / "fixtures" / "torch").mkdir(parents=True)
        for doc, line, words in shell_commands(("python -m memplan", ".venv/bin/python -m memplan",
                                                "python3 -m memplan")):
            with self.subTest(f"{doc}:{line}: {' '.join(words)}"):
                if any(w.startswith("[") for w in words):
                    # A synopsis: each of its flags is in the command's help.
                    module = words[words.index("-m") + 1]
                    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=self.tmp, env=env,
                                       capture_output=True, text=True, timeout=600)
                    flags = {w.strip("[]").split("=")[0] for w in words if w.strip("[").startswith("-")}
                    self.assertEqual(sorted(f for f in flags if f not in r.stdout), [], r.stdout)
                    continue
                argv = [sys.executable, *words[1:]]
                r = subprocess.run(argv, cwd=self.tmp, env=env, capture_output=True, text=True, timeout=600)
                self.assertEqual(r.returncode, 0, r.stderr[-2000:])
                # A command that writes a graph wrote one memplan reads.
                if "-o" in words:
                    out = self.tmp / words[words.index("-o") + 1]
                    report = memplan.check(str(out), memplan.plan(str(out), time_limit=2))
                    self.assertGreater(report["max_live_bytes"], 0)


if __name__ == "__main__":
    unittest.main()
