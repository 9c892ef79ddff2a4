//! What rank 0 tells the user about a run: the opening lines, summary.json, the chart and the
//! closing lines.

use ds_comm::Communicator;

use super::metrics::{self, EvalRecord, StepRecord};
use super::{chart, data, Run};

impl Run<'_> {
    pub(super) fn announce(&self, data: &data::Data, comm: &Communicator, s: &ds_engine::Settings) {
        println!(
            "ds-rs train: {} {} ({} parameters{}), {} ranks ({}), ZeRO stage {}, {:?}, micro-batch {} x {} accumulation steps, {} steps on {}",
            self.model.architecture(),
            self.args.model,
            self.model.n_params(),
            match &self.model.weights {
                Some(_) => ", from its weights",
                None => "",
            },
            comm.world_size(),
            self.cfg.dims,
            s.zero.stage,
            s.precision,
            s.micro_batch,
            s.grad_accum,
            self.steps,
            data.name
        );
        if self.cfg.dims.pp > 1 {
            println!("{}", self.stage_map());
        }
        for (name, on) in [
            ("wandb", self.cfg.monitor.wandb.enabled),
            ("comet", self.cfg.monitor.comet.enabled),
        ] {
            if on {
                println!("warning: the {name} monitor needs its Python client; ds-rs writes tensorboard and csv_monitor only, {name} is ignored");
            }
        }
        if let Some(floor) = data.floor {
            println!("the data's loss floor (entropy rate) is {floor:.4} nats");
        }
        println!("metrics: {}", self.dir.display());
    }

    /// DeepSpeed's partition report: which layers each pipeline stage runs (each of its
    /// model chunks, with virtual stages).
    fn stage_map(&self) -> String {
        let Ok(model) = self.model.build(&ds_engine::parallel::Tp::none()) else {
            return "pipeline: (no partition)".into();
        };
        let method = self.cfg.pipeline.partition();
        let Ok(layout) = ds_engine::pipeline_layout(self.cfg, &model) else {
            return "pipeline: (no partition)".into();
        };
        let chunk = |r: std::ops::Range<usize>| {
            let names: Vec<String> = model.layers()[r.clone()]
                .iter()
                .map(|l| l.display_name())
                .collect();
            format!("layers {}..{} ({})", r.start, r.end, names.join(", "))
        };
        let stages: Vec<String> = (0..layout.stages)
            .map(|s| {
                let chunks: Vec<String> = layout.chunk_layers(s).into_iter().map(chunk).collect();
                format!("stage {s} = {}", chunks.join(" + "))
            })
            .collect();
        let virtual_stages = match layout.chunks {
            1 => String::new(),
            v => format!(" x {v} virtual"),
        };
        format!(
            "pipeline: {} stages{virtual_stages} by {method}: {}",
            layout.stages,
            stages.join("; ")
        )
    }

    pub(super) fn summary(
        &self,
        data: &data::Data,
        comm: &Communicator,
        records: &[StepRecord],
        evals: &[EvalRecord],
        memory: &[metrics::RankMemory],
        first_step_s: Option<f64>,
    ) -> serde_json::Value {
        let s = &self.cfg;
        let final_loss = records.last().map(|r| r.loss);
        let tps: Vec<f64> = records.iter().skip(1).map(|r| r.tokens_per_s).collect();
        let mut model = self.model.summary();
        model["name"] = self.args.model.clone().into();
        serde_json::json!({
            "steps": records.len(),
            "final_loss": final_loss,
            "first_loss": records.first().map(|r| r.loss),
            "final_eval_loss": evals.last().map(|e| e.eval_loss),
            "median_tokens_per_s": metrics::median(&tps),
            "median_step_ms": metrics::median(&records.iter().map(|r| r.step_ms).collect::<Vec<_>>()),
            "median_data_ms": metrics::median(&records.iter().map(|r| r.data_ms).collect::<Vec<_>>()),
            "skipped_steps": records.iter().filter(|r| r.skipped).count(),
            "time_to_first_step_s": first_step_s,
            "model": model,
            "data": {"name": data.name, "loss_floor_nats": data.floor,
                     "epochs": records.last().map(|r| data.train.epochs(r.step + 1)),
                     "samples_per_epoch": data.train.samples().len(),
                     "gap_to_floor_nats": data.floor.zip(final_loss).map(|(f, l)| l - f)},
            "layout": {"world_size": comm.world_size(), "dp": s.dims.dp(), "tp": s.dims.tp, "pp": s.dims.pp, "ep": s.dims.ep, "sp": s.dims.sp,
                       "zero_stage": s.zero_stage() as u8,
                       "micro_batch": records.first().map(|_| s.train_micro_batch_size_per_gpu.to_string()),
                       "gradient_accumulation_steps": s.gradient_accumulation_steps.to_string(),
                       "train_batch_size": s.train_batch_size.to_string()},
            "ranks": memory,
        })
    }

    /// Loss (with the data's floor) and throughput over the steps, as DIR/chart.png.
    /// chart.png: the training loss with the data's floor, the held-out loss, the learning
    /// rate and the throughput over the steps so far (drawn at each evaluation and at the end).
    pub(super) fn write_chart(
        &self,
        data: &data::Data,
        records: &[StepRecord],
        evals: &[EvalRecord],
    ) -> anyhow::Result<()> {
        let by_step = |f: fn(&StepRecord) -> f64| -> Vec<(f64, f64)> {
            records
                .iter()
                .map(|r| ((r.step + 1) as f64, f(r)))
                .collect()
        };
        let (loss, lr, speed) = (
            by_step(|r| r.loss),
            by_step(|r| r.lr),
            by_step(|r| r.tokens_per_s),
        );
        let eval: Vec<(f64, f64)> = evals
            .iter()
            .map(|e| ((e.step + 1) as f64, e.eval_loss))
            .collect();
        let floor = data.floor.map(|f| (f, "loss floor"));
        let panel = |title, y_label, points, floor| chart::Series {
            title,
            y_label,
            points,
            floor,
        };
        let series = [
            panel("training loss", "loss (nats/token)", &loss, floor),
            panel("held-out loss", "loss (nats/token)", &eval, floor),
            panel("learning rate", "lr", &lr, None),
            panel("throughput", "tokens/s", &speed, None),
        ];
        let title = format!(
            "ds-rs train: {} {}, {} of {} steps",
            self.model.architecture(),
            self.args.model,
            records.len(),
            self.steps
        );
        chart::write_png(&self.dir.join("chart.png"), &title, &series)?;
        Ok(())
    }

    pub(super) fn print_summary(&self, v: &serde_json::Value, memory: &[metrics::RankMemory]) {
        // the first step is warm-up: a run of one step has none timed
        let speed = match v["median_tokens_per_s"].as_f64() {
            Some(t) if t.is_finite() => format!("median {t:.0} tokens/s"),
            _ => "no step after the first to time".to_string(),
        };
        println!(
            "done: {} steps ({:.3} epochs), loss {} -> {} (eval {}), {speed}; summary in {}",
            v["steps"],
            v["data"]["epochs"].as_f64().unwrap_or(0.0),
            v["first_loss"],
            v["final_loss"],
            v["final_eval_loss"],
            self.dir.join("summary.json").display()
        );
        if let (Some(d), Some(t)) = (v["median_data_ms"].as_f64(), v["median_step_ms"].as_f64()) {
            println!(
                "reading the data: median {d:.3} ms of a {t:.1} ms step ({:.2}%)",
                100.0 * d / t
            );
        }
        if let Some(gap) = v["data"]["gap_to_floor_nats"].as_f64() {
            println!("the final loss is {gap:.4} nats above the data's floor");
        }
        if let Some(line) = metrics::memory_line(memory) {
            println!("{line}");
        }
        if let Some(line) = gpu_line(&v["gpu"]) {
            println!("{line}");
        }
    }
}

/// "gpu (rank 0): NVIDIA H200, MFU 1.0% of its 989.4 TFLOP/s; memory in use at most 3104 of
/// 143771 MiB (the driver's count after each step), 2650 MiB allocated at most, 2210 MiB
/// accounted by ds-rs ...".
fn gpu_line(g: &serde_json::Value) -> Option<String> {
    let name = g["name"].as_str()?;
    let mfu = match (g["mfu"].as_f64(), g["peak_tflops"].as_f64()) {
        (Some(m), Some(p)) => format!("MFU {:.1}% of its {p} TFLOP/s", 100.0 * m),
        _ => "MFU unknown (no peak for this GPU in ds-engine's table)".to_string(),
    };
    let allocated = match g["memory_allocated_peak_mib"].as_f64() {
        Some(a) => format!(
            "{a:.0} MiB allocated at most (PyTorch's max_memory_allocated: candle's memory \
             pool at its fullest and the ZeRO buffers), "
        ),
        None => String::new(),
    };
    Some(format!(
        "gpu (rank 0): {name}, {mfu}; memory in use at most {:.0} of {:.0} MiB (the driver's \
         count after each step), {allocated}{:.0} MiB accounted by ds-rs (model states placed \
         on the GPU and the step's peaks); the rest of the driver's count: the CUDA context, \
         cuBLAS's workspace, the pool's kept free memory and any other process on the GPU",
        g["memory_used_peak_mib"].as_f64()?,
        g["memory_total_mib"].as_f64()?,
        g["accounted_mib"].as_f64()?
    ))
}
