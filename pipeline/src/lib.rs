//! Pipeline parallelism as data (ARCHITECTURE.md, pipeline/ARCHITECTURE.md): which layers each
//! stage runs (`partition`) and, for each stage, the list of instructions a batch takes
//! (`pipe_schedule`: DeepSpeed's `TrainSchedule`, synchronous 1F1B, and `InferenceSchedule`).
//! The engine executes the instructions over its stage's layers; nothing here runs a layer or
//! moves a byte.

pub mod interleaved;
pub mod partition;
pub mod pipe_schedule;
