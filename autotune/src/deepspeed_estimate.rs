//! DeepSpeed's model-state memory estimators (`estimate_zero2_model_states_mem_needs_all_cold`
//! in runtime/zero/stage_1_and_2.py, `estimate_zero3_model_states_mem_needs_all_cold` in
//! runtime/zero/stage3.py), number for number: the same formulas in the same float64
//! order, truncated to integers where Python calls `int`, and the same printed table.
//!
//! They count fp16 training with Adam: 2 bytes of 16-bit parameters, 18 bytes per parameter
//! of 16- and 32-bit gradients, 32-bit master weights and two moments, spread over the GPUs
//! as each stage partitions them, plus `additional_buffer_factor` of slack on the CPU side.

use serde::Serialize;

/// Where an estimate row keeps a kind of state (DeepSpeed's `offload_*.device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    Cpu,
    None,
}

/// One row of DeepSpeed's table: the options, and the bytes needed per CPU (node) and per GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub offload_param: Offload,
    pub offload_optimizer: Offload,
    pub zero_init: bool,
    pub cpu_bytes: u64,
    pub gpu_bytes: u64,
}

/// The cluster the estimate is for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    pub gpus_per_node: u64,
    pub nodes: u64,
    /// DeepSpeed's `additional_buffer_factor` (1.5 by default).
    pub buffer_factor: f64,
}

impl Cluster {
    fn gpus(&self) -> u64 {
        self.gpus_per_node * self.nodes
    }
}

/// Python's `int(x)` of a non-negative float: truncation.
fn int(x: f64) -> u64 {
    x.trunc() as u64
}

/// `estimate_zero2_model_states_mem_needs` for one `cpu_offload` choice: (cpu, gpu) bytes.
fn zero2(total: u64, c: &Cluster, cpu_offload: bool) -> (u64, u64) {
    match cpu_offload {
        true => {
            let gpu = 2 * total;
            let cpu = (total * (4 * c.gpus()).max(16)) as f64 * c.buffer_factor;
            (int(cpu), gpu)
        }
        false => {
            let gpu = 2 * total + int((18 * total) as f64 / c.gpus() as f64);
            let cpu = (total * 4 * c.gpus_per_node) as f64 * c.buffer_factor;
            (int(cpu), gpu)
        }
    }
}

/// The rows of `estimate_zero2_model_states_mem_needs_all_cold`: offload_optimizer cpu,
/// then none.
pub fn zero2_rows(total_params: u64, c: &Cluster) -> Vec<Row> {
    [true, false]
        .into_iter()
        .map(|cpu_offload| {
            let (cpu_bytes, gpu_bytes) = zero2(total_params, c, cpu_offload);
            Row {
                offload_param: Offload::None,
                offload_optimizer: if cpu_offload {
                    Offload::Cpu
                } else {
                    Offload::None
                },
                zero_init: false,
                cpu_bytes,
                gpu_bytes,
            }
        })
        .collect()
}

/// `max(a, b)` of an int and a float as Python compares them, as a float.
fn py_max(a: u64, b: f64) -> f64 {
    if (a as f64) >= b {
        a as f64
    } else {
        b
    }
}

/// `estimate_zero3_model_states_mem_needs`: (cpu, gpu) bytes.
fn zero3(
    total: u64,
    largest: u64,
    c: &Cluster,
    offload: (bool, bool),
    zero_init: bool,
) -> (u64, u64) {
    let (cpu_offload, cpu_offload_params) = offload;
    let gpus_factor = 1.0 / c.nodes as f64;
    let largest_memory = 4 * largest;
    let abf = c.buffer_factor;
    let t = total as f64;
    let (cpu, gpu) = match (cpu_offload, cpu_offload_params) {
        (true, true) => {
            let cpu = match zero_init {
                true => (total * 18) as f64 * gpus_factor * abf,
                false => t * py_max(4 * c.gpus_per_node, 18.0 * gpus_factor) * abf,
            };
            (cpu, largest_memory)
        }
        (true, false) => {
            let gpu = largest_memory + int((2 * total) as f64 / c.gpus() as f64);
            let cpu = match zero_init {
                true => (total * 16) as f64 * gpus_factor * abf,
                false => t * py_max(4 * c.gpus_per_node, 16.0 * gpus_factor) * abf,
            };
            (cpu, gpu)
        }
        (false, _) => {
            let gpu = largest_memory + int((18 * total) as f64 / c.gpus() as f64);
            let cpu = match zero_init {
                true => (largest * 4 * c.gpus_per_node) as f64 * abf,
                false => (total * 4 * c.gpus_per_node) as f64 * abf,
            };
            (cpu, gpu)
        }
    };
    (int(cpu), gpu)
}

/// The rows of `estimate_zero3_model_states_mem_needs_all_cold`, in its order: (offload
/// optimizer, offload params) = (cpu, cpu), (cpu, none), (none, none), each with zero_init
/// 1 then 0.
pub fn zero3_rows(total_params: u64, largest_layer_params: u64, c: &Cluster) -> Vec<Row> {
    let device = |on: bool| if on { Offload::Cpu } else { Offload::None };
    let mut rows = Vec::new();
    for offload in [(true, true), (true, false), (false, false)] {
        for zero_init in [true, false] {
            let (cpu_bytes, gpu_bytes) =
                zero3(total_params, largest_layer_params, c, offload, zero_init);
            rows.push(Row {
                offload_param: device(offload.1),
                offload_optimizer: device(offload.0),
                zero_init,
                cpu_bytes,
                gpu_bytes,
            });
        }
    }
    rows
}

/// DeepSpeed's printed table for `rows` (ZeRO-3 when `largest_layer_params` is given).
pub fn table(
    rows: &[Row],
    total_params: u64,
    largest_layer_params: Option<u64>,
    c: &Cluster,
) -> String {
    let nodes = if c.nodes > 1 { "nodes" } else { "node" };
    let gpus = if c.gpus_per_node > 1 { "GPUs" } else { "GPU" };
    let millions = |n: u64| int(n as f64 / 1e6);
    let sw = match largest_layer_params {
        None => format!("SW: Model with {}M total params.", millions(total_params)),
        Some(l) => format!(
            "SW: Model with {}M total params, {}M largest layer params.",
            millions(total_params),
            millions(l)
        ),
    };
    let mut out = format!(
        "Estimated memory needed for params, optim states and gradients for a:\nHW: Setup with {} {nodes}, {} {gpus} per node.\n{sw}\n  per CPU  |  per GPU |   Options\n",
        c.nodes, c.gpus_per_node
    );
    let device = |o: Offload| match o {
        Offload::Cpu => "cpu ",
        Offload::None => "none",
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for r in rows {
        let options = match largest_layer_params {
            None => format!("offload_optimizer={}", device(r.offload_optimizer)),
            Some(_) => format!(
                "offload_param={}, offload_optimizer={}, zero_init={}",
                device(r.offload_param),
                device(r.offload_optimizer),
                u8::from(r.zero_init)
            ),
        };
        out.push_str(&format!(
            " {:7.2}GB | {:6.2}GB | {options}\n",
            gib(r.cpu_bytes),
            gib(r.gpu_bytes)
        ));
    }
    out
}

/// A parameter count: an integer, or a number with a suffix K, M, B (or G) or T (7.5B, 350M).
pub fn parse_count(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (number, scale) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1e3),
        Some('M') => (&t[..t.len() - 1], 1e6),
        Some('B') | Some('G') => (&t[..t.len() - 1], 1e9),
        Some('T') => (&t[..t.len() - 1], 1e12),
        _ => (t, 1.0),
    };
    let bad = || format!("{text:?}: expected a count such as 1300000000, 7.5B or 350M");
    if scale == 1.0 {
        return number.parse::<u64>().map_err(|_| bad());
    }
    let v: f64 = number.parse().map_err(|_| bad())?;
    let n = (v * scale).round();
    match v.is_finite() && v >= 0.0 && n < 2f64.powi(63) {
        true => Ok(n as u64),
        false => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_suffixes() {
        assert_eq!(parse_count("7.5B"), Ok(7_500_000_000));
        assert_eq!(parse_count("350M"), Ok(350_000_000));
        assert_eq!(parse_count("1.3b"), Ok(1_300_000_000));
        assert_eq!(parse_count("123"), Ok(123));
        assert!(parse_count("7.5X").is_err());
        assert!(parse_count("-1B").is_err());
        assert!(parse_count("").is_err());
    }
}
