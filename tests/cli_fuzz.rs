//! Issue 41: no argument vector makes the `memplan` binary panic, abort or
//! hang. Property test over argument vectors built from every subcommand,
//! its real flags, flags of other commands, unknown words and hostile
//! values (empty, `-`, NaN, infinities, negative and overflowing numbers,
//! huge sizes, unicode, missing paths, a directory, `/dev/null`, small
//! fixtures). Each case runs the built binary with a wall-clock timeout and
//! a memory limit; it must end by itself with exit code 0, 1 or 2 (never
//! 101, a Rust panic, nor a signal such as SIGABRT) and print no panic.
//!
//! Bounded for CI: `MEMPLAN_FUZZ_CASES` cases (default 48); every command
//! that takes `--time-limit` gets a short one unless the case chose its own,
//! and sizes a valid command would really compute with stay small.

use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// A case still running after this long is a hang.
const HANG: Duration = Duration::from_secs(20);

fn fixture(p: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(p)
        .to_str()
        .unwrap()
        .to_string()
}

/// Values every flag may get, whatever it expects.
const HOSTILE: &[&str] = &[
    "",
    "-",
    "--",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "-1",
    "-0",
    "0",
    "1e300",
    "-1e300",
    "1e-300",
    "18446744073709551616",
    "18446744073709551615",
    "9223372036854775808",
    "4294967296",
    "0x10",
    "1_000",
    " 1",
    "ünïcødé",
    "🦀",
    "a\tb",
    "%",
    "100%",
    "1e",
    "auto",
    "off",
];

/// Inputs: files that are and are not graphs, missing paths, folders.
fn inputs() -> Vec<String> {
    vec![
        fixture("fixtures/graphs/linear-sgd.json"),
        fixture("fixtures/graphs/mlp.json.gz"),
        made("mlp.graph.json"),
        made("mlp.plan.json"),
        fixture("fixtures/minimalloc/example.12.csv"),
        fixture("fixtures/graphs/README.md"),
        fixture("fixtures/hlo/mlp/meta.json"),
        fixture("fixtures/hlo/mlp/before_optimizations.txt.gz"),
        fixture("fixtures/graphs"),
        fixture("no/such/file.json"),
        "/dev/null".into(),
        "does-not-exist.json.gz".into(),
        ".".into(),
        "plan.json".into(),
        "out.json".into(),
        "ünïcødé.json".into(),
    ]
}

/// Outputs: only places inside the case's own temporary folder (the case
/// runs there), standard output, `/dev/null`, a folder and a missing one.
const OUTPUTS: &[&str] = &[
    "out.json",
    "plan.json",
    "out.svg",
    "out.json.gz",
    "-",
    "/dev/null",
    ".",
    "no/such/dir/x.json",
    "",
    "ünïcødé.svg",
];

/// What a flag's value is drawn from.
#[derive(Clone, Copy, Debug)]
enum V {
    /// A switch: no value.
    Flag,
    Time,
    /// A size of an example (batch, seq, layers) or a count.
    Size,
    Example,
    Out,
    In,
    Word(&'static [&'static str]),
}

/// Flags, with what their values are; each command takes some of them,
/// and a case may also give another command's.
const FLAGS: &[(&str, V)] = &[
    ("--example", V::Example),
    ("--batch", V::Size),
    ("--seq", V::Size),
    ("--layers", V::Size),
    (
        "--dtype",
        V::Word(&["f32", "bf16", "f16", "f64", "int8", "BF16"]),
    ),
    ("--checkpoint", V::Flag),
    ("--clip-grad-norm", V::Word(&["1", "0.5", "0", "1e-40"])),
    ("--fused-attention", V::Flag),
    ("--mixed-precision", V::Flag),
    ("--xla-allocations", V::Flag),
    ("--world-size", V::Word(&["1", "2", "8", "3", "1000000"])),
    ("--prefetch", V::Word(&["0", "1", "2", "4294967295"])),
    ("--no-reshard-after-forward", V::Flag),
    ("--reduce-bf16", V::Flag),
    ("--flat-shards", V::Flag),
    ("--split-chunks", V::Word(&["1", "2", "4", "1000000"])),
    ("--split", V::Word(&["auto", "off", "2", "4", "1", "33"])),
    ("-o", V::Out),
    ("--output", V::Out),
    ("--graph-output", V::Out),
    ("--output-graph", V::Out),
    ("--svg", V::Out),
    ("--json", V::Flag),
    ("--report", V::Flag),
    ("--time-limit", V::Time),
    ("--plan", V::In),
    ("--hlo", V::Flag),
    ("--no-chain", V::Flag),
    ("--capacity", V::Word(&["1", "64", "1048576"])),
    ("--minimize", V::Flag),
    (
        "--disable",
        V::Word(&["search", "canonical,peel", "nothing", ",", "rerank,"]),
    ),
    ("--ilp", V::Word(&["0", "1", "8"])),
    ("--threads", V::Word(&["0", "1", "2"])),
    ("--seed", V::Word(&["0", "1", "42"])),
    ("--device", V::Word(&["cpu", "cuda", "tpu"])),
    ("--steps", V::Word(&["1", "2"])),
    ("--unplanned", V::Flag),
    ("--gpu", V::Word(&["0", "1", "7"])),
    ("--compare-cpu", V::Flag),
    ("--profile", V::Flag),
    (
        "--attention",
        V::Word(&["auto", "flash", "gemm", "tensor-cores", "fast"]),
    ),
    ("--presets", V::Flag),
    ("--markdown", V::Flag),
    ("--update", V::Out),
    ("--accept-worse", V::Flag),
    ("--check", V::In),
    ("--width", V::Word(&["1", "1200", "0", "4294967295"])),
    ("--height", V::Word(&["1", "900", "0", "4294967295"])),
    ("--title", V::Word(&["a title", "<script>&", "ünïcødé"])),
    (
        "--budget",
        V::Word(&[
            "75%", "100%", "1%", "0%", "150%", "24GiB", "1.5 GB", "1", "12MB", "1e3", "-5%",
            "nan%", "1 ZiB",
        ]),
    ),
    (
        "--max-added",
        V::Word(&["0.5%", "0.001", "0", "1", "-1%", "1e9"]),
    ),
    ("--list", V::Flag),
    ("--minimise", V::Word(&["time", "flops", "memory", "FLOPS"])),
    ("--minimize", V::Word(&["time", "flops"])),
    ("--pareto", V::Flag),
    ("--max-batch", V::Flag),
    ("--batch-graph", V::In),
    (
        "--batches",
        V::Word(&[
            "2,3",
            "3,2",
            "2,2",
            "0,1",
            "1",
            "2,3,4",
            ",",
            "1,18446744073709551615",
        ]),
    ),
    ("--help", V::Flag),
    ("-h", V::Flag),
    ("--version", V::Flag),
    ("--no-such-flag", V::Flag),
    ("-x", V::Flag),
];

/// Each subcommand's own flags (indices into `FLAGS` by name), whether it
/// takes `--time-limit`, and its positional values.
struct Cmd {
    name: &'static str,
    flags: &'static [&'static str],
    timed: bool,
}

const GRAPH_FLAGS: &[&str] = &[
    "--example",
    "--batch",
    "--seq",
    "--layers",
    "--dtype",
    "--checkpoint",
    "--clip-grad-norm",
    "--fused-attention",
    "--mixed-precision",
    "--xla-allocations",
    "--world-size",
    "--prefetch",
    "--no-reshard-after-forward",
    "--reduce-bf16",
    "--flat-shards",
    "--split-chunks",
    "--split",
];

const CMDS: &[Cmd] = &[
    Cmd {
        name: "plan",
        flags: &["-o", "--json", "--report", "--split", "--graph-output"],
        timed: true,
    },
    Cmd {
        name: "check",
        flags: &["--json"],
        timed: false,
    },
    Cmd {
        name: "stats",
        flags: &["--json"],
        timed: false,
    },
    Cmd {
        name: "compare",
        flags: &["--json"],
        timed: true,
    },
    Cmd {
        name: "alloc",
        flags: &[
            "--capacity",
            "-o",
            "--json",
            "--report",
            "--minimize",
            "--disable",
            "--ilp",
            "--threads",
            "--seed",
        ],
        timed: true,
    },
    Cmd {
        name: "run",
        flags: &[
            "--device",
            "--steps",
            "--json",
            "--seed",
            "--unplanned",
            "--gpu",
            "--compare-cpu",
            "--profile",
            "--attention",
        ],
        timed: true,
    },
    Cmd {
        name: "export",
        flags: &["-o", "--output", "--hlo", "--plan", "--no-chain"],
        timed: true,
    },
    Cmd {
        name: "bench",
        flags: &[
            "--json",
            "--markdown",
            "--update",
            "--accept-worse",
            "--check",
            "--split",
        ],
        timed: true,
    },
    Cmd {
        name: "plot",
        flags: &["--plan", "-o", "--width", "--height", "--title"],
        timed: true,
    },
    Cmd {
        name: "trace",
        flags: &["--plan", "-o"],
        timed: true,
    },
    Cmd {
        name: "fit",
        flags: &[
            "--budget",
            "--max-added",
            "-o",
            "--output-graph",
            "--json",
            "--list",
            "--split",
            "--minimise",
            "--pareto",
            "--svg",
            "--max-batch",
            "--batch-graph",
            "--batches",
        ],
        timed: true,
    },
    Cmd {
        name: "help",
        flags: &[],
        timed: false,
    },
];

/// Examples and `bench` specs: small ones a valid case computes in
/// seconds, big ones only with sizes that make them cheap or refused.
const EXAMPLES: &[&str] = &[
    "mlp",
    "gpt2-tiny",
    "llama-tiny",
    "gpt2-small",
    "llama3-8b",
    "nope",
    "",
    "MLP",
    "gpt2",
    "ünïcødé",
];

const SPECS: &[&str] = &[
    "example:mlp",
    "example:gpt2-tiny,batch=2,seq=16",
    "example:llama-tiny,layers=1,mixed,checkpoint",
    "example:gpt2-tiny,layers=1000000",
    "example:gpt2-tiny,seq=0",
    "example:gpt2-tiny,batch=18446744073709551616",
    "example:gpt2-tiny,world=0",
    "example:gpt2-tiny,world=2,prefetch=4294967296",
    "example:mlp,clip=nan",
    "example:mlp,dtype=f64",
    "example:mlp,,",
    "example:",
    "example:nope",
    "example:gpt2-tiny,unknown=1",
];

/// One flag with its value (or none), as argument words.
fn flag_words(flag: &'static str, v: V, cmd: &'static str) -> BoxedStrategy<Vec<String>> {
    // `run` computes for real: no count it would take as a valid, huge one
    // (`--steps 18446744073709551615` runs until stopped).
    let hostile: Vec<String> = HOSTILE
        .iter()
        .filter(|h| cmd != "run" || h.trim().parse::<u64>().map_or(true, |n| n <= 3))
        .map(|h| h.to_string())
        .collect();
    let hostile = prop::sample::select(hostile);
    let values: BoxedStrategy<String> = match v {
        V::Flag => return Just(vec![flag.to_string()]).boxed(),
        V::Time => prop::sample::select(&["1", "0.5", "1e-9", "0.001"][..])
            .prop_map(str::to_string)
            .boxed(),
        // `run` computes for real: only sizes that stay cheap there.
        V::Size if cmd == "run" => prop::sample::select(&["1", "2", "3"][..])
            .prop_map(str::to_string)
            .boxed(),
        V::Size => prop::sample::select(&["1", "2", "3", "17", "1000000", "4294967297"][..])
            .prop_map(str::to_string)
            .boxed(),
        V::Example if cmd == "run" => prop::sample::select(&["mlp", "llama-tiny", "nope"][..])
            .prop_map(str::to_string)
            .boxed(),
        V::Example => prop::sample::select(EXAMPLES)
            .prop_map(str::to_string)
            .boxed(),
        V::Out => prop::sample::select(OUTPUTS)
            .prop_map(str::to_string)
            .boxed(),
        V::In => prop::sample::select(inputs()).boxed(),
        V::Word(w) => prop::sample::select(w).prop_map(str::to_string).boxed(),
    };
    // `run` is given no hostile size or example it would compute with.
    let value = if cmd == "run" && matches!(v, V::Size | V::Example) {
        values
    } else {
        prop_oneof![5 => values, 1 => hostile].boxed()
    };
    let spelled = prop_oneof![
        4 => Just(false),
        1 => Just(true),
    ];
    (value, spelled)
        .prop_map(move |(value, eq)| {
            if eq && flag.starts_with("--") {
                vec![format!("{flag}={value}")]
            } else {
                vec![flag.to_string(), value]
            }
        })
        .boxed()
}

fn kind(flag: &str) -> V {
    FLAGS.iter().find(|(f, _)| *f == flag).unwrap().1
}

/// Flags that require `--example`.
const OF_EXAMPLE: &[&str] = &[
    "--batch",
    "--seq",
    "--layers",
    "--dtype",
    "--checkpoint",
    "--clip-grad-norm",
    "--fused-attention",
    "--mixed-precision",
];

/// An argument vector: a command (or an unknown word, or none), options of
/// its own and some of any command, positionals, and a short time limit.
fn argv() -> impl Strategy<Value = Vec<String>> {
    let cmd_index = prop_oneof![
        24 => 0..CMDS.len(),
        1 => Just(usize::MAX), // an unknown word
        1 => Just(usize::MAX - 1), // no command at all
    ];
    cmd_index.prop_flat_map(|ci| {
        let (name, own, timed): (String, Vec<&'static str>, bool) = match ci {
            usize::MAX => ("plna".into(), vec![], false),
            i if i == usize::MAX - 1 => (String::new(), vec![], false),
            i => {
                let c = &CMDS[i];
                let mut own: Vec<&str> = c.flags.to_vec();
                if !matches!(c.name, "alloc" | "bench" | "help") {
                    own.extend(GRAPH_FLAGS);
                }
                (c.name.into(), own, c.timed)
            }
        };
        let cmd: &'static str = CMDS.iter().find(|c| c.name == name).map_or("", |c| c.name);
        let own_opts = if own.is_empty() {
            Just(Vec::<Vec<String>>::new()).boxed()
        } else {
            let own: Vec<BoxedStrategy<Vec<String>>> =
                own.iter().map(|f| flag_words(f, kind(f), cmd)).collect();
            prop::collection::vec(prop::strategy::Union::new(own), 0..4).boxed()
        };
        let any: Vec<BoxedStrategy<Vec<String>>> = FLAGS
            .iter()
            .filter(|(f, _)| cmd != "run" || !matches!(*f, "--batch" | "--seq" | "--layers"))
            .map(|(f, v)| flag_words(f, *v, cmd))
            .collect();
        let other_opts = prop_oneof![
            3 => Just(Vec::new()),
            1 => prop::collection::vec(prop::strategy::Union::new(any), 1),
        ];
        // Positionals: inputs, specs for `bench`, command names, junk.
        let mut pos_pool: Vec<String> = inputs();
        if cmd == "bench" {
            pos_pool.extend(SPECS.iter().map(|s| s.to_string()));
        }
        if cmd != "run" {
            pos_pool.extend(["plan", "--", "-", "ünïcødé", ""].map(String::from));
        }
        let positionals = prop_oneof![
            4 => Just(Vec::new()),
            2 => prop::collection::vec(prop::sample::select(pos_pool.clone()), 1),
            1 => prop::collection::vec(prop::sample::select(pos_pool), 2),
        ];
        // The common valid start: a small example or a fixture.
        let start = match cmd {
            "alloc" => prop_oneof![
                3 => Just(vec![fixture("fixtures/minimalloc/example.12.csv")]),
                1 => Just(vec![]),
            ]
            .boxed(),
            "bench" => prop::sample::select(SPECS)
                .prop_map(|s| vec![s.to_string()])
                .boxed(),
            "help" | "" => Just(vec![]).boxed(),
            _ => prop_oneof![
                1 => Just(vec![]),
                3 => Just(vec!["--example".to_string(), "mlp".to_string()]),
                1 => Just(vec!["--example".to_string(), "llama-tiny".to_string()]),
                1 => Just(vec![fixture("fixtures/graphs/linear-sgd.json")]),
                1 => Just(vec![made("mlp.graph.json")]),
            ]
            .boxed(),
        };
        (start, own_opts, other_opts, positionals).prop_map(move |(start, own, other, pos)| {
            let mut args: Vec<String> = Vec::new();
            if !name.is_empty() {
                args.push(name.clone());
            }
            // One use of each flag (a repeated one is only a usage error).
            let mut seen: Vec<String> = start
                .iter()
                .filter(|a| a.starts_with('-'))
                .cloned()
                .collect();
            let from_file = !start.is_empty() && !start[0].starts_with('-');
            args.extend(start);
            let example = !from_file && !matches!(cmd, "alloc" | "bench" | "help" | "");
            for o in own.into_iter().chain(other) {
                let f = o[0].split('=').next().unwrap().to_string();
                // Mostly flags that go with where the graph comes from.
                let misfit = match from_file {
                    true => OF_EXAMPLE.contains(&f.as_str()),
                    false => example && f == "--xla-allocations",
                };
                if !seen.contains(&f) && !misfit {
                    seen.push(f);
                    args.extend(o);
                }
            }
            let has = |args: &[String], f: &str| {
                args.iter()
                    .any(|a| a == f || a.starts_with(&format!("{f}=")))
            };
            // What a flag or a command requires, where the case did not
            // give it (often: a missing one is only a usage error).
            let sharded = [
                "--prefetch",
                "--no-reshard-after-forward",
                "--reduce-bf16",
                "--flat-shards",
            ];
            if sharded.iter().any(|f| has(&args, f)) && !has(&args, "--world-size") {
                args.extend(["--world-size".into(), "2".into()]);
            }
            if !from_file
                && !has(&args, "--example")
                && OF_EXAMPLE.iter().any(|f| has(&args, f))
                && !matches!(cmd, "alloc" | "bench" | "help" | "")
            {
                args.extend(["--example".into(), "mlp".into()]);
            }
            match cmd {
                "export" | "plot" | "trace" if !has(&args, "-o") && !has(&args, "--output") => {
                    args.extend(["-o".into(), "out.json".into()])
                }
                "fit"
                    if !has(&args, "--budget")
                        && !has(&args, "--max-added")
                        && !has(&args, "--pareto") =>
                {
                    args.extend(["--budget".into(), "75%".into()])
                }
                "check" if pos.is_empty() => args.push(made("mlp.plan.json")),
                _ => {}
            }
            if timed && !has(&args, "--time-limit") {
                args.extend(["--time-limit".into(), "1".into()]);
            }
            args.extend(pos);
            args
        })
    })
}

/// Files made once per test run: a plan of `--example mlp` and its graph,
/// so `check`, `--plan` and graph files get valid documents too.
fn made(name: &str) -> String {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let plan = dir.path().join("mlp.plan.json");
        let graph = dir.path().join("mlp.graph.json");
        let o = Command::new(env!("CARGO_BIN_EXE_memplan"))
            .args(["plan", "--example", "mlp", "--time-limit", "5", "-o"])
            .arg(&plan)
            .arg("--graph-output")
            .arg(&graph)
            .output()
            .unwrap();
        assert!(o.status.success(), "{o:?}");
        dir
    });
    dir.path().join(name).to_str().unwrap().to_string()
}

/// Runs `memplan args` in `dir` with a memory limit for at most `limit`;
/// its exit status (None: still running at `limit`, then killed), its
/// standard error and how long it ran.
fn memplan_for(args: &[String], dir: &Path, limit: Duration) -> (Option<ExitStatus>, String, f64) {
    // 8 GiB of address space: an input asking for more must be refused
    // with an error, not abort the process or take the machine's memory.
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 8388608 2>/dev/null; exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_memplan"))
        .args(args)
        .current_dir(dir)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs the memplan binary");
    // stderr is read on a thread, so a chatty child never blocks on a
    // full pipe.
    let mut err_pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err_pipe, &mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = reader.join().unwrap();
    (status, err, start.elapsed().as_secs_f64())
}

/// Runs `memplan args` in `dir`; an error for a hang, a signal, a panic or
/// an exit code other than 0, 1 or 2.
fn run_case(args: &[String], dir: &Path) -> Result<(), TestCaseError> {
    let (status, err, seconds) = memplan_for(args, dir, HANG);
    let Some(status) = status else {
        return Err(TestCaseError::fail(format!(
            "memplan {args:?} still running after {HANG:?}: a hang"
        )));
    };
    if std::env::var_os("MEMPLAN_FUZZ_VERBOSE").is_some() {
        let first = err.lines().next().unwrap_or("");
        eprintln!("{:?} {seconds:.1}s {args:?}: {first}", status.code());
    }
    let tail: String = err.chars().take(2000).collect();
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return Err(TestCaseError::fail(format!(
                "memplan {args:?} killed by signal {sig}\n{tail}"
            )));
        }
    }
    let code = status.code();
    if !matches!(code, Some(0..=2)) {
        return Err(TestCaseError::fail(format!(
            "memplan {args:?} exited with {code:?}\n{tail}"
        )));
    }
    if err.contains("panicked at") || err.contains("RUST_BACKTRACE") {
        return Err(TestCaseError::fail(format!(
            "memplan {args:?} panicked\n{tail}"
        )));
    }
    Ok(())
}

fn check(args: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    if let Err(e) = run_case(&args, dir.path()) {
        panic!("{e}");
    }
}

fn cases() -> u32 {
    std::env::var("MEMPLAN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(48)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        // Every case is a process; shrinking a failure re-runs a few dozen.
        max_shrink_iters: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn no_argument_vector_panics_aborts_or_hangs(args in argv()) {
        let dir = tempfile::tempdir().unwrap();
        run_case(&args, dir.path())?;
    }
}

/// Hostile cases tried by hand next to the fuzzing: each refused with an
/// error (or done), none a panic.
#[test]
fn fixed_hostile_cases() {
    let csv = fixture("fixtures/minimalloc/example.12.csv");
    for args in [
        &[
            "run",
            "--example",
            "mlp",
            "--world-size",
            "1000000",
            "--time-limit",
            "1",
        ][..],
        &[
            "run",
            "--example",
            "mlp",
            "--steps",
            "0",
            "--time-limit",
            "1",
        ],
        &[
            "plan",
            "--example",
            "gpt2-tiny",
            "--split-chunks",
            "1000000",
            "--time-limit",
            "1",
        ],
        &[
            "plan",
            "--example",
            "gpt2-tiny",
            "--layers",
            "9223372036854775808",
        ],
        &[
            "plot",
            "--example",
            "mlp",
            "-o",
            "x.svg",
            "--width",
            "4294967295",
        ],
        &[
            "fit",
            "--example",
            "mlp",
            "--max-batch",
            "--budget",
            "18446744073709551615",
            "--time-limit",
            "1",
        ],
        &[
            "fit",
            "--example",
            "gpt2-tiny",
            "--batch",
            "1000000",
            "--budget",
            "1%",
            "--time-limit",
            "1",
        ],
        &["alloc", &csv, "--threads", "1000000", "--time-limit", "1"],
        &[
            "bench",
            "example:gpt2-tiny,world=2,prefetch=4294967296",
            "--time-limit",
            "1",
        ],
    ] {
        check(args);
    }
}

/// `run --steps 18446744073709551615` panicked ("capacity overflow": the
/// runner reserved a result per step up front). Now it runs, step after
/// step, until stopped.
#[test]
fn a_huge_step_count_runs_until_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "run",
        "--example",
        "mlp",
        "--layers",
        "1",
        "--steps",
        "18446744073709551615",
        "--time-limit",
        "1",
    ]
    .map(String::from)
    .to_vec();
    let (status, err, _) = memplan_for(&args, dir.path(), Duration::from_secs(6));
    assert!(
        status.is_none() || status.is_some_and(|s| s.success()),
        "{status:?}\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}
