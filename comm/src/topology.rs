//! Rank layout of 3D (pipeline × data × tensor) parallelism.
//!
//! Mirrors DeepSpeed's `ProcessTopology`, `PipeModelDataParallelTopology`,
//! `PipeDataParallelTopology` and the groups `PipelineParallelGrid` builds
//! (`deepspeed/runtime/pipe/topology.py`), so a global rank plays the same role
//! in ds-rs as in DeepSpeed. Ranks are laid out row-major over the axes
//! `[pipe, data, model]`: the model (tensor-parallel) index varies fastest, so
//! tensor-parallel peers are adjacent ranks (same node), and pipeline stages are
//! furthest apart.

use std::fmt;

/// One axis of the 3D layout. `Model` is tensor (Megatron "slice") parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Pipe,
    Data,
    Model,
}

impl Axis {
    /// DeepSpeed's axis order; the last one varies fastest along the ranks.
    pub const ORDER: [Axis; 3] = [Axis::Pipe, Axis::Data, Axis::Model];

    /// The axis name DeepSpeed uses (`"pipe"`, `"data"`, `"model"`).
    pub fn name(self) -> &'static str {
        match self {
            Axis::Pipe => "pipe",
            Axis::Data => "data",
            Axis::Model => "model",
        }
    }

    fn index(self) -> usize {
        match self {
            Axis::Pipe => 0,
            Axis::Data => 1,
            Axis::Model => 2,
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Position of a rank in the layout (DeepSpeed's `ProcessCoord`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Coord {
    pub pipe: usize,
    pub data: usize,
    pub model: usize,
}

impl Coord {
    pub fn get(self, axis: Axis) -> usize {
        match axis {
            Axis::Pipe => self.pipe,
            Axis::Data => self.data,
            Axis::Model => self.model,
        }
    }

    /// This coordinate moved to `index` along `axis`.
    pub fn with(mut self, axis: Axis, index: usize) -> Coord {
        match axis {
            Axis::Pipe => self.pipe = index,
            Axis::Data => self.data = index,
            Axis::Model => self.model = index,
        }
        self
    }
}

/// Invalid user-supplied layout parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopologyError {
    /// A parallel degree of 0 along `axis`.
    ZeroDegree { axis: Axis },
    /// `pp * tp * dp` does not fit in `usize`.
    TooManyRanks { pp: usize, tp: usize, dp: usize },
    /// A world of 0 processes.
    ZeroWorldSize,
    /// The communicator's world size differs from the topology's.
    WorldSizeMismatch { topology: usize, world: usize },
    /// A process rank outside the world.
    RankOutOfRange { rank: usize, world_size: usize },
    /// The expert-parallel degree does not divide the data-parallel ranks.
    ExpertDegree { ep: usize, dp: usize },
}

impl fmt::Display for TopologyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TopologyError::ZeroDegree { axis } => {
                write!(f, "{axis} parallel degree is 0; it must be at least 1")
            }
            TopologyError::TooManyRanks { pp, tp, dp } => {
                write!(f, "pipe {pp} x model {tp} x data {dp} ranks overflow usize")
            }
            TopologyError::ZeroWorldSize => f.write_str("world size is 0"),
            TopologyError::WorldSizeMismatch { topology, world } => write!(
                f,
                "topology has {topology} ranks but the world has {world} processes"
            ),
            TopologyError::ExpertDegree { ep, dp } => write!(
                f,
                "expert parallel size {ep} does not divide the {dp} data-parallel ranks"
            ),
            TopologyError::RankOutOfRange { rank, world_size } => {
                write!(
                    f,
                    "rank {rank} is outside a world of {world_size} processes"
                )
            }
        }
    }
}

impl std::error::Error for TopologyError {}

/// The sizes of the three axes, in [`Axis::ORDER`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    dims: [usize; 3],
}

impl Topology {
    /// DeepSpeed's `PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)`.
    pub fn pipe_model_data(pp: usize, tp: usize, dp: usize) -> Result<Topology, TopologyError> {
        for (axis, degree) in [(Axis::Pipe, pp), (Axis::Data, dp), (Axis::Model, tp)] {
            if degree == 0 {
                return Err(TopologyError::ZeroDegree { axis });
            }
        }
        pp.checked_mul(tp)
            .and_then(|n| n.checked_mul(dp))
            .ok_or(TopologyError::TooManyRanks { pp, tp, dp })?;
        Ok(Topology { dims: [pp, dp, tp] })
    }

    /// DeepSpeed's `PipeDataParallelTopology(num_pp=pp, num_dp=dp)`.
    ///
    /// DeepSpeed drops the model axis; a model axis of size 1 gives the same
    /// ranks, coordinates and pipe/data groups. The one visible difference is
    /// `axis_groups(Axis::Model)`: singletons here, `[]` in DeepSpeed — and the
    /// singletons are what `PipelineParallelGrid` uses as slice groups anyway.
    pub fn pipe_data(pp: usize, dp: usize) -> Result<Topology, TopologyError> {
        Topology::pipe_model_data(pp, 1, dp)
    }

    /// The topology `PipelineParallelGrid` falls back to when given none: the
    /// prime factors of `world_size`, in ascending order, dealt alternately to
    /// pipe and data (so 12 = 2·2·3 gives pipe 6, data 2).
    pub fn grid_default(world_size: usize) -> Result<Topology, TopologyError> {
        if world_size == 0 {
            return Err(TopologyError::ZeroWorldSize);
        }
        let (mut pp, mut dp) = (1, 1);
        for (i, prime) in prime_factors(world_size).into_iter().enumerate() {
            if i % 2 == 0 {
                pp *= prime;
            } else {
                dp *= prime;
            }
        }
        Topology::pipe_data(pp, dp)
    }

    pub fn world_size(&self) -> usize {
        self.dims.iter().product()
    }

    /// Number of ranks along `axis` (its parallel degree).
    pub fn dim(&self, axis: Axis) -> usize {
        self.dims[axis.index()]
    }

    /// Rank distance between neighbours along `axis`: the product of the sizes
    /// of the faster-varying axes after it.
    fn stride(&self, axis: Axis) -> usize {
        self.dims[axis.index() + 1..].iter().product()
    }

    /// The coordinate of `rank`. Panics if `rank >= world_size()`.
    pub fn coord(&self, rank: usize) -> Coord {
        assert!(
            rank < self.world_size(),
            "rank {rank} out of range for a topology of {} ranks",
            self.world_size()
        );
        let at = |axis| rank / self.stride(axis) % self.dim(axis);
        Coord {
            pipe: at(Axis::Pipe),
            data: at(Axis::Data),
            model: at(Axis::Model),
        }
    }

    /// The rank at `coord`. Panics if any index is outside its axis.
    pub fn rank(&self, coord: Coord) -> usize {
        Axis::ORDER
            .iter()
            .map(|&axis| {
                let index = coord.get(axis);
                assert!(
                    index < self.dim(axis),
                    "{axis} index {index} out of range for {axis} degree {}",
                    self.dim(axis)
                );
                index * self.stride(axis)
            })
            .sum()
    }

    /// DeepSpeed's `get_axis_comm_lists(axis)`: every group of ranks that differ
    /// only along `axis`, each ordered by its `axis` index.
    ///
    /// DeepSpeed orders the groups by the other axes' coordinates, row-major.
    /// Dropping one coordinate preserves row-major order, so walking the ranks
    /// whose `axis` index is 0 in ascending order yields exactly that order.
    pub fn axis_groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        (0..self.world_size())
            .filter(|&rank| self.coord(rank).get(axis) == 0)
            .map(|rank| self.group_of(axis, rank))
            .collect()
    }

    /// The group along `axis` that contains `rank` (an entry of [`Self::axis_groups`]).
    pub fn group_of(&self, axis: Axis, rank: usize) -> Vec<usize> {
        let stride = self.stride(axis);
        let first = rank - self.coord(rank).get(axis) * stride;
        (0..self.dim(axis)).map(|i| first + i * stride).collect()
    }

    /// DeepSpeed's `get_axis_list(axis, idx)`: all ranks whose `axis` index is
    /// `index`, ascending. Panics if `index` is outside the axis.
    pub fn ranks_at(&self, axis: Axis, index: usize) -> Vec<usize> {
        assert!(
            index < self.dim(axis),
            "{axis} index {index} out of range for {axis} degree {}",
            self.dim(axis)
        );
        (0..self.world_size())
            .filter(|&rank| self.coord(rank).get(axis) == index)
            .collect()
    }

    /// DeepSpeed's "model parallel" groups (`ds_model_proc_group`): one per data
    /// index, holding every pipe stage and tensor slice of that replica. DeepSpeed
    /// reduces overflow flags and gradient norms over these. Not to be confused
    /// with `axis_groups(Axis::Model)`, the tensor-parallel groups.
    pub fn model_parallel_groups(&self) -> Vec<Vec<usize>> {
        (0..self.dim(Axis::Data))
            .map(|d| self.ranks_at(Axis::Data, d))
            .collect()
    }

    /// `PipelineParallelGrid.p2p_groups`: for every rank, `[rank, rank of the
    /// next stage in its pipeline]`, the last stage wrapping to the first.
    pub fn p2p_groups(&self) -> Vec<[usize; 2]> {
        let pp = self.dim(Axis::Pipe);
        (0..self.world_size())
            .map(|rank| {
                let coord = self.coord(rank);
                [
                    rank,
                    self.rank(coord.with(Axis::Pipe, (coord.pipe + 1) % pp)),
                ]
            })
            .collect()
    }
}

/// Prime factors of `n > 0` in ascending order, with multiplicity.
fn prime_factors(mut n: usize) -> Vec<usize> {
    let mut primes = Vec::new();
    let mut candidate = 2;
    while n > 1 {
        // Past sqrt(n) what is left is prime; stopping early keeps a huge prime
        // world size from looping for ages (DeepSpeed tries every candidate).
        if candidate > n / candidate {
            primes.push(n);
            break;
        }
        if n.is_multiple_of(candidate) {
            primes.push(candidate);
            n /= candidate;
        } else {
            candidate += 1;
        }
    }
    primes
}

/// One process's view of a [`Topology`], as DeepSpeed's `PipelineParallelGrid`
/// gives it: its role and the groups it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    topo: Topology,
    rank: usize,
    coord: Coord,
}

impl Grid {
    /// The grid of process `rank` in a world of `world_size` processes, which
    /// must match the topology (DeepSpeed asserts the same).
    pub fn new(topo: Topology, rank: usize, world_size: usize) -> Result<Grid, TopologyError> {
        if topo.world_size() != world_size {
            return Err(TopologyError::WorldSizeMismatch {
                topology: topo.world_size(),
                world: world_size,
            });
        }
        if rank >= world_size {
            return Err(TopologyError::RankOutOfRange { rank, world_size });
        }
        Ok(Grid {
            topo,
            rank,
            coord: topo.coord(rank),
        })
    }

    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    pub fn global_rank(&self) -> usize {
        self.rank
    }

    pub fn coord(&self) -> Coord {
        self.coord
    }

    /// Pipeline stage of this process.
    pub fn stage_id(&self) -> usize {
        self.coord.pipe
    }

    /// Which pipeline replica this process is in.
    pub fn data_parallel_id(&self) -> usize {
        self.coord.data
    }

    /// Index within the tensor-parallel group (DeepSpeed's slice parallel rank).
    pub fn tensor_parallel_rank(&self) -> usize {
        self.coord.model
    }

    pub fn is_first_stage(&self) -> bool {
        self.stage_id() == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.stage_id() + 1 == self.topo.dim(Axis::Pipe)
    }

    /// Rank of `stage` in this process's pipeline (same data and tensor index).
    /// Panics if `stage` is not a stage of the pipeline.
    pub fn stage_to_global(&self, stage: usize) -> usize {
        self.topo.rank(self.coord.with(Axis::Pipe, stage))
    }

    /// Rank that sends activations to this one; `None` on the first stage.
    pub fn prev_stage_rank(&self) -> Option<usize> {
        let stage = self.stage_id().checked_sub(1)?;
        Some(self.stage_to_global(stage))
    }

    /// Rank that receives this one's activations; `None` on the last stage.
    pub fn next_stage_rank(&self) -> Option<usize> {
        (!self.is_last_stage()).then(|| self.stage_to_global(self.stage_id() + 1))
    }

    /// Same stage and tensor slice in every replica: the gradient all-reduce group.
    pub fn data_parallel_group(&self) -> Vec<usize> {
        self.topo.group_of(Axis::Data, self.rank)
    }

    /// Every stage of this process's pipeline, in stage order.
    pub fn pipe_parallel_group(&self) -> Vec<usize> {
        self.topo.group_of(Axis::Pipe, self.rank)
    }

    /// The tensor-parallel peers (DeepSpeed's slice group).
    pub fn tensor_parallel_group(&self) -> Vec<usize> {
        self.topo.group_of(Axis::Model, self.rank)
    }

    /// Every process of this replica: see [`Topology::model_parallel_groups`].
    pub fn model_parallel_group(&self) -> Vec<usize> {
        self.topo.ranks_at(Axis::Data, self.data_parallel_id())
    }

    /// Position of this process in [`Self::model_parallel_group`].
    pub fn model_parallel_rank(&self) -> usize {
        let tp = self.topo.dim(Axis::Model);
        self.stage_id() * tp + self.tensor_parallel_rank()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(pp: usize, tp: usize, dp: usize) -> Topology {
        Topology::pipe_model_data(pp, tp, dp).unwrap()
    }

    fn coord(pipe: usize, data: usize, model: usize) -> Coord {
        Coord { pipe, data, model }
    }

    #[test]
    fn model_varies_fastest_then_data_then_pipe() {
        // pp=2, tp=2, dp=3: rank = pipe*6 + data*2 + model.
        let t = topo(2, 2, 3);
        assert_eq!(t.world_size(), 12);
        assert_eq!(t.coord(0), coord(0, 0, 0));
        assert_eq!(t.coord(1), coord(0, 0, 1));
        assert_eq!(t.coord(2), coord(0, 1, 0));
        assert_eq!(t.coord(5), coord(0, 2, 1));
        assert_eq!(t.coord(6), coord(1, 0, 0));
        assert_eq!(t.coord(11), coord(1, 2, 1));
        assert_eq!(t.rank(coord(1, 1, 0)), 8);
    }

    #[test]
    fn constructor_argument_order_is_pp_tp_dp() {
        let t = topo(2, 3, 4);
        assert_eq!(t.dim(Axis::Pipe), 2);
        assert_eq!(t.dim(Axis::Model), 3);
        assert_eq!(t.dim(Axis::Data), 4);
    }

    #[test]
    fn coord_and_rank_are_inverse() {
        let t = topo(3, 2, 4);
        for rank in 0..t.world_size() {
            assert_eq!(t.rank(t.coord(rank)), rank);
        }
    }

    #[test]
    fn docstring_example_2x2x2() {
        // ProcessTopology.get_axis_comm_lists docstring.
        let t = topo(2, 2, 2);
        assert_eq!(
            t.axis_groups(Axis::Pipe),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(
            t.axis_groups(Axis::Data),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            t.axis_groups(Axis::Model),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
    }

    #[test]
    fn group_of_finds_the_containing_group() {
        let t = topo(2, 2, 3);
        assert_eq!(t.group_of(Axis::Pipe, 9), vec![3, 9]);
        assert_eq!(t.group_of(Axis::Data, 9), vec![7, 9, 11]);
        assert_eq!(t.group_of(Axis::Model, 9), vec![8, 9]);
    }

    #[test]
    fn model_parallel_groups_span_everything_but_data() {
        // filter_match(pipe=0, data=1) == [2, 3] in the DeepSpeed docstring.
        let t = topo(2, 2, 2);
        assert_eq!(t.ranks_at(Axis::Data, 1), vec![2, 3, 6, 7]);
        assert_eq!(
            t.model_parallel_groups(),
            vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]
        );
    }

    #[test]
    fn p2p_groups_wrap_to_the_first_stage() {
        let t = topo(3, 1, 2);
        assert_eq!(
            t.p2p_groups(),
            vec![[0, 2], [1, 3], [2, 4], [3, 5], [4, 0], [5, 1]]
        );
    }

    #[test]
    fn zero_degree_is_an_error_naming_the_axis() {
        let cases = [
            ((0, 1, 1), Axis::Pipe),
            ((1, 0, 1), Axis::Model),
            ((1, 1, 0), Axis::Data),
        ];
        for ((pp, tp, dp), axis) in cases {
            let err = Topology::pipe_model_data(pp, tp, dp).unwrap_err();
            assert_eq!(err, TopologyError::ZeroDegree { axis });
            let msg = err.to_string();
            assert!(msg.contains(axis.name()) && msg.contains('0'), "{msg}");
        }
        assert!(Topology::pipe_data(2, 0).is_err());
    }

    #[test]
    fn overflowing_world_is_an_error() {
        let err = Topology::pipe_model_data(usize::MAX, 2, 1).unwrap_err();
        assert!(matches!(err, TopologyError::TooManyRanks { .. }));
        let _: &dyn std::error::Error = &err;
    }

    #[test]
    #[should_panic(expected = "rank 8 out of range for a topology of 8 ranks")]
    fn out_of_range_rank_panics() {
        topo(2, 2, 2).coord(8);
    }

    #[test]
    #[should_panic(expected = "model index 2 out of range for model degree 2")]
    fn out_of_range_coord_panics() {
        topo(2, 2, 2).rank(coord(0, 0, 2));
    }

    #[test]
    fn prime_factors_ascending_with_multiplicity() {
        assert_eq!(prime_factors(1), Vec::<usize>::new());
        assert_eq!(prime_factors(360), vec![2, 2, 2, 3, 3, 5]);
        assert_eq!(prime_factors(97), vec![97]);
        assert_eq!(prime_factors(2 * 1_000_003), vec![2, 1_000_003]);
    }

    #[test]
    fn grid_default_alternates_prime_factors() {
        let t = Topology::grid_default(12).unwrap();
        assert_eq!((t.dim(Axis::Pipe), t.dim(Axis::Data)), (6, 2));
        assert_eq!(Topology::grid_default(0), Err(TopologyError::ZeroWorldSize));
    }

    #[test]
    fn grid_roles_and_neighbours() {
        // pp=3, tp=2, dp=2: rank 6 is stage 1, replica 1, slice 0.
        let grid = Grid::new(topo(3, 2, 2), 6, 12).unwrap();
        assert_eq!(grid.coord(), coord(1, 1, 0));
        assert!(!grid.is_first_stage() && !grid.is_last_stage());
        assert_eq!(grid.prev_stage_rank(), Some(2));
        assert_eq!(grid.next_stage_rank(), Some(10));
        assert_eq!(grid.data_parallel_group(), vec![4, 6]);
        assert_eq!(grid.pipe_parallel_group(), vec![2, 6, 10]);
        assert_eq!(grid.tensor_parallel_group(), vec![6, 7]);
        assert_eq!(grid.model_parallel_group(), vec![2, 3, 6, 7, 10, 11]);
        assert_eq!(grid.model_parallel_rank(), 2);

        let first = Grid::new(topo(3, 2, 2), 1, 12).unwrap();
        assert!(first.is_first_stage());
        assert_eq!(first.prev_stage_rank(), None);
        let last = Grid::new(topo(3, 2, 2), 11, 12).unwrap();
        assert!(last.is_last_stage());
        assert_eq!(last.next_stage_rank(), None);
    }

    #[test]
    fn grid_rejects_bad_world() {
        let t = topo(2, 1, 2);
        assert_eq!(
            Grid::new(t, 0, 8),
            Err(TopologyError::WorldSizeMismatch {
                topology: 4,
                world: 8
            })
        );
        assert_eq!(
            Grid::new(t, 4, 4),
            Err(TopologyError::RankOutOfRange {
                rank: 4,
                world_size: 4
            })
        );
    }

    /// Comparison against layouts dumped by DeepSpeed itself
    /// (`tests/fixtures/gen_topology.py`).
    mod deepspeed_fixture {
        use super::*;
        use serde_json::Value;

        const FIXTURE: &str = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/topology_deepspeed.json"
        ));

        fn fixture() -> Value {
            serde_json::from_str(FIXTURE).expect("fixture is valid JSON")
        }

        fn num(v: &Value) -> usize {
            v.as_u64().expect("non-negative integer") as usize
        }

        fn list(v: &Value) -> Vec<usize> {
            v.as_array().expect("array").iter().map(num).collect()
        }

        fn lists(v: &Value) -> Vec<Vec<usize>> {
            v.as_array().expect("array").iter().map(list).collect()
        }

        fn layouts<'a>(fixture: &'a Value, key: &str) -> &'a [Value] {
            fixture[key].as_array().expect("layout list")
        }

        /// Checks coords, axis groups, p2p groups and every rank's grid.
        /// `axes` are the axes DeepSpeed's topology has, in its order.
        fn check_layout(t: &Topology, layout: &Value, axes: &[Axis]) {
            let n = t.world_size();
            let coords = layout["coords"].as_array().expect("coords");
            assert_eq!(coords.len(), n);
            for (rank, c) in coords.iter().enumerate() {
                let got: Vec<usize> = axes.iter().map(|&a| t.coord(rank).get(a)).collect();
                assert_eq!(got, list(c), "coord of rank {rank}");
            }
            for &axis in axes {
                let want = lists(&layout["axis_comm_lists"][axis.name()]);
                assert_eq!(t.axis_groups(axis), want, "{axis} groups");
            }
            let p2p: Vec<[usize; 2]> = lists(&layout["p2p_groups"])
                .into_iter()
                .map(|g| [g[0], g[1]])
                .collect();
            assert_eq!(t.p2p_groups(), p2p, "p2p groups");
            let model_parallel_groups = t.model_parallel_groups();
            for (rank, want) in layout["grid"].as_array().expect("grid").iter().enumerate() {
                let grid = Grid::new(*t, rank, n).unwrap();
                check_grid(&grid, want);
                let group = &model_parallel_groups[grid.data_parallel_id()];
                assert_eq!(*group, list(&want["model_parallel_group"]));
            }
        }

        fn check_grid(g: &Grid, want: &Value) {
            let rank = g.global_rank();
            let stages = g.topology().dim(Axis::Pipe);
            assert_eq!(g.stage_id(), num(&want["stage_id"]), "rank {rank}");
            assert_eq!(g.data_parallel_id(), num(&want["data_parallel_id"]));
            assert_eq!(g.tensor_parallel_rank(), num(&want["slice_parallel_rank"]));
            assert_eq!(Value::Bool(g.is_first_stage()), want["is_first_stage"]);
            assert_eq!(Value::Bool(g.is_last_stage()), want["is_last_stage"]);
            assert_eq!(g.data_parallel_group(), list(&want["dp_group"]));
            assert_eq!(g.pipe_parallel_group(), list(&want["pp_group"]));
            assert_eq!(g.tensor_parallel_group(), list(&want["slice_group"]));
            assert_eq!(
                g.model_parallel_group(),
                list(&want["model_parallel_group"])
            );
            assert_eq!(g.model_parallel_rank(), num(&want["model_parallel_rank"]));
            let to_global: Vec<usize> = (0..stages).map(|s| g.stage_to_global(s)).collect();
            assert_eq!(to_global, list(&want["stage_to_global"]), "rank {rank}");
        }

        #[test]
        fn pipe_model_data_matches_deepspeed() {
            let fixture = fixture();
            let layouts = layouts(&fixture, "pipe_model_data");
            assert!(layouts.len() > 100, "fixture covers every pp*tp*dp <= 16");
            for layout in layouts {
                let (pp, tp, dp) = (num(&layout["pp"]), num(&layout["tp"]), num(&layout["dp"]));
                check_layout(&topo(pp, tp, dp), layout, &Axis::ORDER);
            }
        }

        #[test]
        fn pipe_data_matches_deepspeed() {
            let fixture = fixture();
            for layout in layouts(&fixture, "pipe_data") {
                let t = Topology::pipe_data(num(&layout["pp"]), num(&layout["dp"])).unwrap();
                check_layout(&t, layout, &[Axis::Pipe, Axis::Data]);
                // DeepSpeed has no model axis here; see `Topology::pipe_data`.
                assert!(lists(&layout["axis_comm_lists"]["model"]).is_empty());
            }
        }

        #[test]
        fn grid_default_matches_deepspeed() {
            let fixture = fixture();
            for row in layouts(&fixture, "default_grid") {
                let t = Topology::grid_default(num(&row["world_size"])).unwrap();
                assert_eq!(t.dim(Axis::Pipe), num(&row["pp"]));
                assert_eq!(t.dim(Axis::Data), num(&row["dp"]));
            }
        }
    }
}

/// DeepSpeed-MoE's expert groups (deepspeed/utils/groups.py, `_get_expert_parallel_ranks`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRanks {
    /// Groups of `ep` data-parallel ranks that share one set of experts between them (each
    /// holds experts / ep of them; tokens travel between them by all-to-all).
    pub expert_parallel: Vec<Vec<usize>>,
    /// The ranks at one position of every expert-parallel group of a data-parallel group: the
    /// replicas of the same experts, which average their gradients.
    pub expert_data_parallel: Vec<Vec<usize>>,
}

/// The expert groups of a `pipe_model_data` layout of `world` ranks with `tp` and `pp`: each
/// data-parallel group (in DeepSpeed's order: stages outermost, then tensor-parallel index) is
/// cut into expert-parallel groups of `ep` consecutive members. With `data_before_expert`
/// (DeepSpeed's `use_data_before_expert_parallel_`) each data-parallel group is first
/// reordered to stride through the world in steps of `dp / ep` members, so that an
/// expert-parallel group spreads over the data-parallel ranks instead of taking neighbours.
pub fn expert_parallel_ranks(
    world: usize,
    tp: usize,
    pp: usize,
    ep: usize,
    data_before_expert: bool,
) -> Result<ExpertRanks, TopologyError> {
    for (axis, degree) in [(Axis::Model, tp), (Axis::Pipe, pp)] {
        if degree == 0 {
            return Err(TopologyError::ZeroDegree { axis });
        }
    }
    if world == 0 || !world.is_multiple_of(tp * pp) {
        return Err(TopologyError::WorldSizeMismatch {
            topology: tp * pp,
            world,
        });
    }
    let dp = world / (tp * pp);
    if ep == 0 || !dp.is_multiple_of(ep) {
        return Err(TopologyError::ExpertDegree { ep, dp });
    }
    let stage = world / pp;
    let mut out = ExpertRanks {
        expert_parallel: Vec::new(),
        expert_data_parallel: Vec::new(),
    };
    for start in (0..world).step_by(stage) {
        for i in 0..tp {
            let data: Vec<usize> = match data_before_expert {
                false => (start + i..start + stage).step_by(tp).collect(),
                true => {
                    let stride = dp / ep;
                    (0..stride)
                        .flat_map(|d| (start + i + d * tp..start + stage).step_by(stride * tp))
                        .collect()
                }
            };
            let parts: Vec<Vec<usize>> = data.chunks(ep).map(<[usize]>::to_vec).collect();
            for j in 0..ep {
                out.expert_data_parallel
                    .push(parts.iter().map(|p| p[j]).collect());
            }
            out.expert_parallel.extend(parts);
        }
    }
    Ok(out)
}
