//! What the launcher checks once before any rank starts: the config, and for ds-rs's own
//! `train` the whole plan (config, layout, model), so that a mistake is one error line here
//! instead of one per rank.

use std::path::Path;

use anyhow::bail;

/// Plans the job of a program that embeds the engine once, as its `Job` will (the config
/// alone, for the job's world size), so that a bad config, or one asking for what ds-rs
/// cannot do yet, is one error line here instead of one per rank. The head prints the
/// config's warnings; a node launcher leaves them to the head.
pub(super) fn check_config(path: &Path, world: usize, head: bool) -> anyhow::Result<()> {
    let source = ds_engine::ConfigSource::File(path);
    let overrides = ds_engine::Overrides::default();
    let plan = ds_engine::JobPlan::new(source, world, &overrides, None)?;
    if head {
        print_config_warnings(&plan.config);
    }
    Ok(())
}

/// `train ARGS` as its ranks will run it, planned once for the job's world size: a bad
/// config, a layout that does not divide the world or a model that does not divide by the
/// tensor-parallel degree is one error line here, before any rank starts. The ranks read the
/// config their own `--config` names, else the launcher's (DS_RS_CONFIG), else the one they
/// inherit; the head prints the warnings of the launcher's, which the ranks then skip.
pub(super) fn check_train(
    words: &[String],
    launcher_config: Option<&Path>,
    world: usize,
    head: bool,
    local: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    let parsed = crate::flags::parse_args::<crate::train::TrainArgs>("train", words);
    let (mut args, matches) = match parsed {
        Ok(parsed) => parsed,
        // --help, --version: the ranks answer it.
        Err(e) if !e.use_stderr() => return Ok(()),
        Err(e) => bail!("train: {}", first_line(&e.to_string())),
    };
    let own = matches.value_source("config") == Some(clap::parser::ValueSource::CommandLine);
    let warn = match (own, launcher_config) {
        (false, Some(c)) => {
            args.config = Some(c.to_path_buf());
            head
        }
        _ => false,
    };
    let (model, plan) = crate::train::plan(&args, world)?;
    if warn {
        print_config_warnings(&plan.config);
    }
    // this host's ranks, before any starts
    crate::train::check_fits(&args, &model, &plan, local)
}

/// A clap error's message without its `error: ` and the usage lines after it.
fn first_line(message: &str) -> &str {
    let line = message.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line)
}

/// Set on every rank the launcher starts: its host's memory was checked already
/// (`train::check_fits`), so `train` does not check again.
pub const MEMORY_CHECKED: &str = "DS_RS_MEMORY_CHECKED";

/// Set on every rank the launcher starts with `--config`: the config whose warnings the head
/// launcher printed, so that `train` reading that same file does not print them again.
pub const CONFIG_WARNED: &str = "DS_RS_CONFIG_WARNED";

/// The config's warnings (those of `config check`) on stderr, a `warning:` line each.
pub fn print_config_warnings(config: &ds_config::Config) {
    for w in &config.warnings {
        eprintln!("warning: {w}");
    }
}
