//! `--tp`, `--pp`, `--ep`, `--sp`: the parallel degrees a command line asks for, as the job
//! plan takes them (`ds_engine::LayoutFlags`).

use ds_engine::LayoutFlags;

#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct LayoutArgs {
    /// Tensor-parallel degree (default: the config's tensor_parallel.autotp_size, else 1);
    /// data parallelism takes the rest of the ranks.
    #[arg(long)]
    pub tp: Option<usize>,
    /// Pipeline stages (default: the config's pipeline.stages, "auto" = 1); the config's
    /// gradient_accumulation_steps are the micro-batches of a pipeline step.
    #[arg(long)]
    pub pp: Option<usize>,
    /// Expert-parallel size (DeepSpeed-MoE's ep_size; default: the config's
    /// expert_parallel.autoep_size when enabled, else 1): the data-parallel ranks in groups of
    /// this many, among which a mixture of experts' experts are split; it divides the
    /// data-parallel size and the number of experts.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Sequence-parallel size (DeepSpeed-Ulysses' sequence_parallel_size; default: the
    /// config's, else 1): the data-parallel ranks in groups of this many, which read the same
    /// samples and split each one's positions; it divides the data-parallel size, the
    /// sequence length and the attention heads.
    #[arg(long)]
    pub sp: Option<usize>,
}

impl LayoutArgs {
    pub(crate) fn flags(&self) -> LayoutFlags {
        LayoutFlags {
            tp: self.tp,
            pp: self.pp,
            ep: self.ep,
            sp: self.sp,
        }
    }
}
