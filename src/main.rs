//! The `memplan` command line. Exit codes: 0 ok, 1 bad input (message on
//! stderr), 2 usage.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
