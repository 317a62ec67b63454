//! memplan plans the memory of one training step: given the step's graph
//! (forward, loss, backward, optimizer update, collectives), it chooses the
//! order ops run in and a byte offset for every tensor inside one arena, so
//! the step runs at the smallest peak, with the same math.
//!
//! # Crate map
//! - [`graph`]: the graph model (ops, tensors, views, in-place updates, reuse
//!   hints) and [`graph::GraphBuilder`] to make one in code; [`dtype`]:
//!   the one table of element types and their widths.
//! - [`io`]: graph and plan files (memplan JSON, gzip; the plan's JSON form
//!   in [`io::plan_json`]); [`mod@plan`]: the plan.
//! - [`checker`]: the independent plan checker.
//! - [`lower`]: the bridge to the solver (`memplan-solver`, ordering) and
//!   the allocator (`memplan-allocator`, offsets); [`layout`]: one order
//!   laid out by the allocator.
//! - [`vocab`]: the op vocabulary, each executor op as a graph op and as
//!   the runtime's typed `Kernel`, converted both ways in one place;
//!   [`exec`]: a graph and its plan lowered to the executor's program
//!   (`memplan-runtime`), and the unplanned reference.
//! - [`fit`]: fitting a step into a memory budget by recomputation
//!   (`memplan fit`), priced by [`cost`] (FLOPs, bytes, roofline time);
//!   [`batch`]: a step at other batch sizes and the largest that fits.
//! - [`pipeline`]: [`plan()`] itself; [`baselines`]: what users get without
//!   memplan; [`models`]: built-in example graphs (GPT-2 family, Llama,
//!   MLP).
//! - [`example_spec`]: a built-in example with its options and transforms,
//!   as the CLI's flags and the `example:NAME,key=value` text both name it.
//! - [`transforms`]: what a command does to the graph it loads, in one
//!   order: [`split`] (the loss chain in chunks), then FSDP sharding
//!   ([`models::fsdp`]).
//! - [`api`]: the entry points both bindings (C ABI, Python) call, with
//!   their arguments checked once.
//! - [`bench`]: benchmarks over many graphs and the peak record;
//!   [`timeline`]: live bytes by role over an order, drawn by [`plot`]
//!   (SVG) and [`trace`] (Chrome / Perfetto trace).
//!
//! # Example
//! ```
//! use memplan::graph::{GraphBuilder, OpKind, OpSpec, Role, TensorSpec};
//!
//! // Two independent branches that each make a big temporary and reduce
//! // it. Program order starts both branches before reducing either.
//! let mut b = GraphBuilder::new("branches");
//! let x = b.add_tensor(TensorSpec::new("x", 64).role(Role::Input).persistent());
//! let big: Vec<_> = (0..2).map(|i| b.add_tensor(TensorSpec::new(format!("big{i}"), 1000))).collect();
//! let small: Vec<_> = (0..2).map(|i| b.add_tensor(TensorSpec::new(format!("small{i}"), 10))).collect();
//! for i in 0..2 {
//!     b.add_op(OpSpec::new(format!("expand{i}"), OpKind::Forward, "f").inputs([x]).outputs([big[i]]));
//! }
//! for i in 0..2 {
//!     b.add_op(OpSpec::new(format!("reduce{i}"), OpKind::Forward, "f").inputs([big[i]]).outputs([small[i]]));
//! }
//! let out = b.add_tensor(TensorSpec::new("out", 10).role(Role::Output).persistent());
//! b.add_op(OpSpec::new("sum", OpKind::Forward, "add").inputs(small).outputs([out]));
//! let graph = b.build().unwrap();
//!
//! let plan = memplan::plan(&graph, &memplan::Options::default()).unwrap();
//! memplan::checker::check(&graph, &plan).unwrap();
//! // Program order needs both big temporaries at once; memplan does not.
//! assert_eq!(memplan::baselines::program_order_max_live(&graph), 64 + 2000 + 10);
//! assert_eq!(plan.stats.max_live_bytes, 64 + 1000 + 10 + 10);
//! ```

pub mod api;
pub mod baselines;
pub mod batch;
pub mod bench;
pub mod checker;
pub mod cost;
pub use memplan_runtime::dtype;
pub mod error;
pub mod example_spec;
pub mod exec;
pub mod fit;
pub mod fuse;
pub mod graph;
pub mod io;
pub mod layout;
pub mod lower;
pub mod models;
pub mod offload;
pub mod pipeline;
pub mod plan;
#[cfg(feature = "cli")]
pub mod plot;
pub mod split;
#[cfg(feature = "testing")]
pub mod testing;
pub mod timeline;
pub mod trace;
pub mod transforms;
pub mod units;
pub mod vocab;

pub use error::{Error, ErrorKind, GraphError, Result};
pub use graph::{Graph, GraphBuilder, OpId, TensorId};
pub use pipeline::{Options, plan};
pub use plan::{Plan, PlanStats};
