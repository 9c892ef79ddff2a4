//! `ds-rs data preprocess`: Megatron-LM's `tools/preprocess_data.py`, on every core.

use anyhow::Context;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use ds_data::{input_files, preprocess, PreprocessJob, TextTokenizer};

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Tokenize documents into Megatron indexed datasets (PREFIX_KEY_document.bin/.idx), as
    /// Megatron-LM's tools/preprocess_data.py writes them.
    Preprocess(PreprocessArgs),
}

#[derive(Args, Debug)]
pub struct PreprocessArgs {
    /// A JSON-lines file (.jsonl/.json/.ndjson, optionally .gz), a text file (one document),
    /// or a directory of them (read in name order).
    #[arg(long)]
    input: PathBuf,
    /// The JSON keys holding each document's text (a string, or a list of sentences).
    #[arg(long = "json-keys", alias = "json-key", num_args = 1.., default_value = "text")]
    json_keys: Vec<String>,
    /// A tokenizer.json, or a model directory holding one (its tokenizer_config.json names
    /// the end-of-document token).
    #[arg(long)]
    tokenizer: PathBuf,
    /// Datasets are written to OUTPUT_PREFIX_KEY_document.bin/.idx.
    #[arg(long = "output-prefix")]
    output_prefix: PathBuf,
    /// Append the end-of-document token to every non-empty document.
    #[arg(long = "append-eod")]
    append_eod: bool,
    /// The end-of-document token, when tokenizer_config.json names none or another.
    #[arg(long = "eod-token")]
    eod_token: Option<String>,
    /// Tokenizing threads (default: every core).
    #[arg(long)]
    workers: Option<usize>,
}

pub fn run(command: &DataCommand) -> anyhow::Result<ExitCode> {
    match command {
        DataCommand::Preprocess(args) => run_preprocess(args),
    }
}

fn run_preprocess(args: &PreprocessArgs) -> anyhow::Result<ExitCode> {
    let mut tokenizer = TextTokenizer::open(&args.tokenizer)?;
    if let Some(token) = &args.eod_token {
        tokenizer = tokenizer.with_eod_token(token)?;
    }
    let workers = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let job = PreprocessJob {
        inputs: input_files(&args.input)?,
        json_keys: args.json_keys.clone(),
        output_prefix: args.output_prefix.clone(),
        append_eod: args.append_eod,
        workers,
    };
    // the prefix's directory, as a user writing `--output-prefix data/corpus` expects
    if let Some(dir) = args
        .output_prefix
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--output-prefix: creating {}", dir.display()))?;
    }
    let start = Instant::now();
    let mut meter = Meter::new(start);
    let report = preprocess(&job, &tokenizer, |docs, bytes| meter.show(docs, bytes))?;
    meter.finish();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "preprocessed {} documents, {:.1} MB in {secs:.2} s ({:.0} documents/s, {:.2} MB/s, {workers} workers, vocabulary {})",
        report.documents,
        report.bytes as f64 / 1e6,
        report.documents as f64 / secs,
        report.bytes as f64 / 1e6 / secs,
        tokenizer.vocab_size()
    );
    for (prefix, s) in &report.outputs {
        println!(
            "  {}.bin/.idx: {} documents, {} sequences, {} tokens",
            prefix.display(),
            s.documents,
            s.sequences,
            s.tokens
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Documents/s and MB/s on stderr: redrawn in place on a terminal, a line every 10 s
/// otherwise (logs).
struct Meter {
    start: Instant,
    last: Instant,
    bar: bool,
}

impl Meter {
    fn new(start: Instant) -> Meter {
        Meter {
            start,
            last: start,
            bar: std::io::stderr().is_terminal(),
        }
    }

    fn show(&mut self, docs: u64, bytes: u64) {
        let every = Duration::from_millis(if self.bar { 200 } else { 10_000 });
        if self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        let secs = self.start.elapsed().as_secs_f64();
        let line = format!(
            "{docs} documents, {:.1} MB ({:.0} documents/s, {:.2} MB/s)",
            bytes as f64 / 1e6,
            docs as f64 / secs,
            bytes as f64 / 1e6 / secs
        );
        if self.bar {
            eprint!("\r\x1b[K{line}");
        } else {
            eprintln!("{line}");
        }
    }

    fn finish(&self) {
        if self.bar && self.last != self.start {
            eprintln!();
        }
    }
}
