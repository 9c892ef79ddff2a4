//! ds-autotune: what a configuration will cost before it runs. `deepspeed_estimate` is
//! DeepSpeed's own model-state estimators, number for number.

pub mod activations;
pub mod deepspeed_estimate;
pub mod memory;
pub mod time;
pub mod tuning;
