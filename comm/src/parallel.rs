//! `Groups`: the job's parallel layout and this rank's groups in it, decided once and passed
//! to everything that communicates (torchtitan's `ParallelDims` + DeepSpeed's
//! `PipelineParallelGrid`). Ranks are laid out as DeepSpeed's
//! `PipeModelDataParallelTopology` (axes pipe, data, model): tensor-parallel peers are
//! adjacent ranks, so they share a host.

use ds_config::ParallelDims;

use crate::topology::{Grid, Topology};
use crate::{CommError, Communicator, Group, Result};

/// This rank's data-, tensor- and pipeline-parallel groups.
#[derive(Clone)]
pub struct Groups {
    dims: ParallelDims,
    grid: Grid,
    world: Group,
    dp: Group,
    tp: Group,
    pp: Group,
    sp: Group,
    experts: ExpertGroups,
}

impl Groups {
    /// The groups of `comm`'s rank in layout `dims`, whose world size must be `comm`'s.
    pub fn new(comm: &Communicator, dims: ParallelDims) -> Result<Groups> {
        if dims.world_size != comm.world_size() {
            return Err(CommError::Invalid(format!(
                "the layout is for {} ranks ({dims}), the job has {}",
                dims.world_size,
                comm.world_size()
            )));
        }
        let topo = Topology::pipe_model_data(dims.pp, dims.tp, dims.dp())
            .map_err(|e| CommError::Invalid(e.to_string()))?;
        let grid = Grid::new(topo, comm.rank(), comm.world_size())
            .map_err(|e| CommError::Invalid(e.to_string()))?;
        let dp = comm.group(&grid.data_parallel_group())?;
        let experts = match dims.ep {
            1 => ExpertGroups {
                ep: comm.group(&[comm.rank()])?,
                expert_dp: dp.clone(),
            },
            ep => expert_groups(comm, dims, ep)?,
        };
        // DeepSpeed-Ulysses' groups: consecutive data-parallel ranks
        let data = grid.data_parallel_group();
        let sp = data.chunks(dims.sp).find(|g| g.contains(&comm.rank()));
        let sp = comm.group(sp.expect("invariant: sp divides the data-parallel ranks"))?;
        Ok(Groups {
            dims,
            world: comm.world(),
            dp,
            sp,
            tp: comm.group(&grid.tensor_parallel_group())?,
            pp: comm.group(&grid.pipe_parallel_group())?,
            grid,
            experts,
        })
    }

    /// Data parallelism over the whole world of `comm`.
    pub fn data_parallel(comm: &Communicator) -> Result<Groups> {
        let dims = ParallelDims::new(comm.world_size(), 1, 1)
            .map_err(|e| CommError::Invalid(e.to_string()))?;
        Groups::new(comm, dims)
    }

    pub fn dims(&self) -> ParallelDims {
        self.dims
    }
    /// This rank's coordinates and neighbours.
    pub fn grid(&self) -> &Grid {
        &self.grid
    }
    pub fn world(&self) -> &Group {
        &self.world
    }
    /// Same stage and tensor slice in every replica: where gradients are reduced and ZeRO
    /// shards the states.
    pub fn dp(&self) -> &Group {
        &self.dp
    }
    /// The ranks that hold slices of the same layers.
    pub fn tp(&self) -> &Group {
        &self.tp
    }
    /// The stages of this rank's pipeline.
    pub fn pp(&self) -> &Group {
        &self.pp
    }
    /// The ranks that split the sequences of the same samples (DeepSpeed-Ulysses; this rank
    /// alone without sequence parallelism).
    pub fn sp(&self) -> &Group {
        &self.sp
    }
    /// Which of the `dims().replicas()` sample streams this rank reads: sequence-parallel
    /// peers read the same one.
    pub fn replica(&self) -> usize {
        self.grid.data_parallel_id() / self.dims.sp
    }

    /// This rank's DeepSpeed-MoE groups for the layout's expert-parallel size (DeepSpeed's
    /// E + D order): the ranks its tokens travel between, and the replicas of its experts
    /// (at ep 1: this rank alone, and the data-parallel group).
    pub fn experts(&self) -> &ExpertGroups {
        &self.experts
    }
}

fn expert_groups(comm: &Communicator, d: ParallelDims, ep: usize) -> Result<ExpertGroups> {
    let ranks = crate::topology::expert_parallel_ranks(d.world_size, d.tp, d.pp, ep, false)
        .map_err(|e| CommError::Invalid(e.to_string()))?;
    let me = comm.rank();
    let mine = |groups: &[Vec<usize>]| -> Result<Group> {
        let g = groups.iter().find(|g| g.contains(&me));
        comm.group(g.expect("invariant: the groups cover every rank"))
    };
    Ok(ExpertGroups {
        ep: mine(&ranks.expert_parallel)?,
        expert_dp: mine(&ranks.expert_data_parallel)?,
    })
}

/// A rank's groups for a mixture of experts.
#[derive(Clone)]
pub struct ExpertGroups {
    /// The ranks among which the experts are split: tokens go to their expert's rank and back
    /// by all-to-all.
    pub ep: Group,
    /// The ranks holding the same experts: their gradients are averaged there (and ZeRO
    /// shards them there).
    pub expert_dp: Group,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit;

    #[test]
    fn groups_follow_deepspeeds_rank_order() {
        // world 8 = pp 2 x dp 2 x tp 2: rank = pipe * 4 + data * 2 + model
        let got = testkit::run_ranks(8, std::time::Duration::from_secs(30), |comm| {
            let g = Groups::new(&comm, ParallelDims::new(8, 2, 2).unwrap())?;
            Ok::<_, CommError>((
                g.dp().global_ranks().to_vec(),
                g.tp().global_ranks().to_vec(),
                g.pp().global_ranks().to_vec(),
            ))
        })
        .unwrap();
        assert_eq!(got[5], (vec![5, 7], vec![4, 5], vec![1, 5]));
        assert_eq!(got[2], (vec![0, 2], vec![2, 3], vec![2, 6]));
    }

    #[test]
    fn sequence_parallel_groups_are_consecutive_data_parallel_ranks() {
        // world 8 = dp 4 x tp 2, sp 2: data-parallel groups [0, 2, 4, 6] and [1, 3, 5, 7]
        let got = testkit::run_ranks(8, std::time::Duration::from_secs(30), |comm| {
            let dims = ParallelDims::new(8, 2, 1).unwrap().with_sp(2).unwrap();
            let g = Groups::new(&comm, dims)?;
            Ok::<_, CommError>((g.sp().global_ranks().to_vec(), g.replica()))
        })
        .unwrap();
        assert_eq!(got[0], (vec![0, 2], 0));
        assert_eq!(got[4], (vec![4, 6], 1));
        assert_eq!(got[7], (vec![5, 7], 1));
    }

    #[test]
    fn expert_groups_are_deepspeeds_and_carry_an_all_to_all() {
        // world 8 = dp 4 x tp 2, ep 2: DeepSpeed's docstring example at half the size
        let got = testkit::run_ranks(8, std::time::Duration::from_secs(30), |comm| {
            let dims = ParallelDims::new(8, 2, 1).unwrap().with_ep(2).unwrap();
            let g = Groups::new(&comm, dims)?;
            let e = g.experts();
            // each rank sends its rank to both members of its expert-parallel group
            let mut got = [0f32; 2];
            e.ep.all_to_all(&[comm.rank() as f32; 2], &mut got)?;
            Ok::<_, CommError>((
                e.ep.global_ranks().to_vec(),
                e.expert_dp.global_ranks().to_vec(),
                got,
            ))
        })
        .unwrap();
        // dp groups [0, 2, 4, 6] and [1, 3, 5, 7]
        assert_eq!(got[2], (vec![0, 2], vec![2, 6], [0.0, 2.0]));
        assert_eq!(got[7], (vec![5, 7], vec![3, 7], [5.0, 7.0]));
    }
}
