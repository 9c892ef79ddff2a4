//! The `ds-rs` binary: command-line parsing and dispatch. Exit status: 0 ok, 1 the command ran
//! and failed (an invalid config, a failed job), 2 a usage error or a command not available yet.

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = match cli::Cli::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            for cause in e.chain() {
                eprintln!("error: {cause}");
            }
            ExitCode::from(1)
        }
    }
}
