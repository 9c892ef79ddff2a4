//! Each ZeRO stage's stores against a serial reference, on 1-4 ranks in threads: gradients of
//! layer ranges added in backward order come out summed over ranks and averaged in the owned
//! range; parameters come back whole for any range; the master copy round-trips.

use std::time::Duration;

use ds_comm::testkit::run_ranks;
use ds_partition::{PartitionError, Placements, ReduceConfig, Stage3Config, Zero, ZeroOptions};

const NUMEL: usize = 1009; // prime: shards never divide it
const LAYERS: [std::ops::Range<usize>; 4] = [0..100, 100..400, 400..1000, 1000..1009];

fn options(stage: u8, bucket: usize, overlap: bool) -> ZeroOptions {
    use ds_config::ZeroStage;
    let stages = [
        ZeroStage::Disabled,
        ZeroStage::OptimizerStates,
        ZeroStage::Gradients,
        ZeroStage::Weights,
    ];
    ZeroOptions {
        stage: stages[stage as usize],
        reduce: ReduceConfig {
            bucket_size: bucket,
            overlap_comm: overlap,
            predivide_factor: 1.0,
        },
        allgather_bucket_size: 250,
        stage3: Stage3Config {
            prefetch_bucket_size: 500,
            max_live_parameters: 10_000,
            param_persistence_threshold: 50,
        },
    }
}

/// Rank r's local gradient of element i (small integers: every sum is exact in f32).
fn grad(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 13) as f32 - 6.0
}

#[test]
fn every_stage_reduces_gathers_and_publishes_like_the_serial_reference() {
    for world in [1usize, 2, 3, 4] {
        for (stage, bucket, overlap) in [
            (0, 64, false),
            (1, 1000, false),
            (2, 128, false),
            (2, 128, true),
            (3, 300, true),
        ] {
            run_ranks(world, Duration::from_secs(30), move |comm| {
                let rank = comm.rank();
                let values: Vec<f32> = (0..NUMEL).map(|i| i as f32).collect();
                let mut asked = Vec::new();
                let mut init = |r: std::ops::Range<usize>, dst: &mut [f32]| {
                    dst.iter_mut()
                        .zip(r.clone())
                        .for_each(|(d, i)| *d = i as f32);
                    asked.push(r);
                    Ok::<_, PartitionError>(())
                };
                let mut z = Zero::new(
                    NUMEL,
                    options(stage, bucket, overlap),
                    comm.world(),
                    &mut init,
                    None,
                    &Placements::host(),
                )?;
                // stage 3 generates only its own shard (zero.Init); the others everything
                let keeps = match stage {
                    3 => z.owned().start.min(NUMEL)..z.owned().end.min(NUMEL),
                    _ => 0..NUMEL,
                };
                let covered: usize = asked.iter().map(|r| r.len()).sum();
                assert!(
                    asked
                        .iter()
                        .all(|r| keeps.start <= r.start && r.end <= keeps.end),
                    "ws{world} stage {stage}: asked for {asked:?}, keeps {keeps:?}"
                );
                assert_eq!(covered, keeps.len(), "ws{world} stage {stage}: {asked:?}");
                for r in LAYERS.iter().rev() {
                    let g: Vec<f32> = r.clone().map(|i| grad(rank, i)).collect();
                    // in two parts, as a layer hands its parameters' gradients
                    let (a, b) = g.split_at(g.len() / 3);
                    z.add_grad(r.clone(), &[a, b])?;
                }
                z.finish_backward(true)?;
                let owned = z.owned();
                for (k, g) in z.owned_grads().iter().enumerate() {
                    let i = owned.start + k;
                    let expect = match i < NUMEL {
                        true => (0..world).map(|r| grad(r, i)).sum::<f32>() / world as f32,
                        false => 0.0, // padding
                    };
                    assert!(
                        (g - expect).abs() < 1e-6,
                        "ws{world} stage {stage}: grad {i} = {g}, expected {expect}"
                    );
                }
                for r in LAYERS.iter().chain([0..NUMEL, 95..405].iter()) {
                    assert_eq!(
                        &*z.params(r.clone())?,
                        &values[r.clone()],
                        "ws{world} stage {stage} range {r:?}"
                    );
                }
                // a step that adds 1 to every owned master value shows up in every range
                z.master_mut().iter_mut().for_each(|v| *v += 1.0);
                z.publish()?;
                let next: Vec<f32> = values.iter().map(|v| v + 1.0).collect();
                assert_eq!(
                    &*z.params(0..NUMEL)?,
                    &next[..],
                    "ws{world} stage {stage} after publish"
                );
                assert_eq!(z.gather_master()?, next);
                Ok::<_, PartitionError>(())
            })
            .unwrap();
        }
    }
}
