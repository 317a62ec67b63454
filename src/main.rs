//! The `memplan` command line. Exit codes: 0 ok, 1 bad input (message on
//! stderr), 2 usage. Output into a closed pipe (`memplan ... | head`) ends
//! the process quietly, as it does other Unix tools.

mod cli;

fn main() {
    restore_sigpipe();
    std::process::exit(cli::main());
}

/// Rust ignores SIGPIPE, so a write into a closed pipe fails, and every
/// `println!` then panics. A command-line tool should instead be ended by
/// the signal, silently: restore its default action (here only, never in
/// the library, whose embedders choose their own).
fn restore_sigpipe() {
    #[cfg(any(target_os = "linux", target_os = "macos"))]
    {
        const SIGPIPE: i32 = 13;
        const SIG_DFL: usize = 0;
        unsafe extern "C" {
            fn signal(signum: i32, handler: usize) -> usize;
        }
        // SAFETY: sets the default action of one signal before any thread
        // starts; SIGPIPE is 13 on Linux and macOS.
        unsafe {
            signal(SIGPIPE, SIG_DFL);
        }
    }
}
