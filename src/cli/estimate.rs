//! `ds-rs estimate`: DeepSpeed's model-state estimators (`--zero-stage 2|3 --params N`).

use std::process::ExitCode;

use anyhow::{bail, Context};
use ds_autotune::deepspeed_estimate::{parse_count, table, zero2_rows, zero3_rows, Cluster};

#[derive(clap::Args, Debug)]
pub struct EstimateArgs {
    /// The ZeRO stage whose DeepSpeed estimator to run: 2 or 3.
    #[arg(long)]
    zero_stage: u8,
    /// The model's parameter count: an integer or a number with K, M, B or T (7.5B, 350M).
    #[arg(long)]
    params: String,
    /// The parameters of the largest layer (ZeRO-3: the parameters gathered at once).
    #[arg(long)]
    largest_layer_params: Option<String>,
    #[arg(long, default_value_t = 1)]
    num_gpus_per_node: u64,
    #[arg(long, default_value_t = 1)]
    num_nodes: u64,
    /// DeepSpeed's slack factor on the CPU side.
    #[arg(long, default_value_t = 1.5)]
    additional_buffer_factor: f64,
    /// A JSON list of rows instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &EstimateArgs) -> anyhow::Result<ExitCode> {
    let total = parse_count(&args.params).map_err(|e| anyhow::anyhow!("--params {e}"))?;
    if args.num_gpus_per_node == 0 || args.num_nodes == 0 {
        bail!("--num-gpus-per-node and --num-nodes must be at least 1");
    }
    let factor = args.additional_buffer_factor;
    if !(factor.is_finite() && factor > 0.0) {
        bail!("--additional-buffer-factor {factor}: expected a positive number");
    }
    let cluster = Cluster {
        gpus_per_node: args.num_gpus_per_node,
        nodes: args.num_nodes,
        buffer_factor: factor,
    };
    let (rows, largest) = match args.zero_stage {
        2 => (zero2_rows(total, &cluster), None),
        3 => {
            let text = args.largest_layer_params.as_deref().context(
                "--zero-stage 3 needs --largest-layer-params (the parameters of the largest layer)",
            )?;
            let largest =
                parse_count(text).map_err(|e| anyhow::anyhow!("--largest-layer-params {e}"))?;
            (zero3_rows(total, largest, &cluster), Some(largest))
        }
        s => bail!("--zero-stage {s}: DeepSpeed has estimators for stages 2 and 3"),
    };
    match args.json {
        true => println!("{}", serde_json::to_string_pretty(&rows)?),
        false => print!("{}", table(&rows, total, largest, &cluster)),
    }
    Ok(ExitCode::SUCCESS)
}
