//! The `ds-rs` binary: command-line parsing and dispatch. Exit status: 0 ok, 1 the command ran
//! and failed (an invalid config, a failed job), 2 a usage error or a command not available yet.

mod autotune;
mod cli;
mod flags;
mod launch;
mod train;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

fn main() -> ExitCode {
    keep_freed_memory();
    let parsed = flags::both_spellings(cli::Cli::command())
        .try_get_matches()
        .and_then(|m| cli::Cli::from_arg_matches(&m));
    let args = match parsed {
        Ok(args) => args,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let result = match std::env::var_os(cli::CHECK_ARGS) {
        Some(_) => cli::check_args(&args),
        None => cli::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // One line, outermost context first: "error: reading x.json: No such file".
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Training frees and reallocates the same large activation buffers every step. glibc returns
/// blocks above 128 KiB to the kernel at once, so each step paid again for zeroed fresh pages
/// (14% of a tiny-GPT step in page faults). Keeping freed memory in the heap removes that; peak
/// RSS is what the step needs anyway.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator tunables; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
