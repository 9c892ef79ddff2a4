//! Sub-groups, the 3D topology's groups, async handles, and what happens when a peer
//! vanishes, stalls, or a stranger knocks.

mod common;

use common::{options, run_ranks, run_ranks_timeout, value, TOKEN};
use ds_comm::store::{StoreClient, StoreServer};
use ds_comm::topology::{Axis, Topology};
use ds_comm::{init, CommError, ReduceOp, Transport};
use std::io::Write;
use std::time::{Duration, Instant};

#[test]
fn sub_groups_reduce_only_their_members() {
    for transport in [Transport::Auto, Transport::Tcp] {
        run_ranks(5, transport, |comm| {
            let me = comm.rank();
            // Overlapping groups in a custom order, used one after the other on every member.
            let groups: [&[usize]; 3] = [&[4, 1, 3], &[0, 2], &[3, 2, 1, 0]];
            for ranks in groups.into_iter().filter(|g| g.contains(&me)) {
                let g = comm.group(ranks).unwrap();
                let mut buf: Vec<f32> = (0..70_001).map(|i| value(me, i)).collect();
                g.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
                for (i, v) in buf.iter().enumerate().step_by(997) {
                    assert_eq!(
                        *v,
                        ranks.iter().map(|&r| value(r, i)).sum::<f32>(),
                        "group {ranks:?}"
                    );
                }
                let mut b = vec![me as f32; 3];
                g.broadcast(&mut b, ranks[ranks.len() - 1]).unwrap();
                assert_eq!(b, vec![ranks[ranks.len() - 1] as f32; 3]);
            }
            assert!(comm.group(&[me, me]).is_err());
            assert!(comm
                .group(&[(me + 1) % 5])
                .err()
                .unwrap()
                .to_string()
                .contains("does not contain"));
        });
    }
}

/// pp=2 x tp=2 x dp=2 laid out as DeepSpeed's PipeModelDataParallelTopology: each rank sums
/// its global rank over its data, tensor and pipe groups.
#[test]
fn topology_groups_carry_their_own_collectives() {
    let topo = Topology::pipe_model_data(2, 2, 2).unwrap();
    run_ranks(8, Transport::Auto, move |comm| {
        let me = comm.rank();
        for axis in [Axis::Data, Axis::Model, Axis::Pipe] {
            let ranks = topo.group_of(axis, me);
            let g = comm.group(&ranks).unwrap();
            let mut x = [me as f32];
            g.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(
                x[0],
                ranks.iter().sum::<usize>() as f32,
                "{axis:?} group {ranks:?}"
            );
        }
    });
}

#[test]
fn async_collectives_complete_in_issue_order() {
    run_ranks(3, Transport::Auto, |comm| {
        let g = comm.world();
        let me = comm.rank();
        let works: Vec<_> = (0..6)
            .map(|k| g.all_reduce_async(vec![(me * 10 + k) as f32; 50_000], ReduceOp::Sum))
            .collect();
        // A blocking collective issued after them runs after them.
        let mut last = [1.0f32];
        g.all_reduce(&mut last, ReduceOp::Sum).unwrap();
        assert_eq!(last[0], 3.0);
        for (k, w) in works.into_iter().enumerate() {
            let out = w.wait().unwrap();
            assert!(out.iter().all(|v| *v == (30 + 3 * k) as f32), "op {k}");
        }
        let gathered = g.all_gather_async(vec![me as f32; 9]).wait().unwrap();
        assert_eq!(gathered, vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
    });
}

/// A rank that leaves (drops its communicator) while the others are in a collective: they
/// get an error naming it, promptly, not a hang.
#[test]
fn a_vanished_peer_fails_the_collective_naming_it() {
    for transport in [Transport::Auto, Transport::Tcp] {
        let results = run_ranks_timeout(3, transport, Duration::from_secs(20), |comm| {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(200));
                return None; // drops the communicator mid-job
            }
            let start = Instant::now();
            let mut buf = vec![1.0f32; 1 << 20];
            let err = comm
                .world()
                .all_reduce(&mut buf, ReduceOp::Sum)
                .unwrap_err();
            // The communicator is unusable afterwards, and says why.
            let again = comm.world().barrier().unwrap_err().to_string();
            Some((err, start.elapsed(), again))
        });
        for (err, took, again) in results.into_iter().flatten() {
            assert!(
                took < Duration::from_secs(10),
                "{transport:?}: took {took:?}"
            );
            let text = err.to_string();
            match err {
                CommError::PeerLost { peer, .. } => {
                    assert!(peer == 1 || text.contains("rank"), "{text}")
                }
                CommError::Timeout { .. } => panic!(
                    "{transport:?}: a closed connection should be seen before the timeout: {text}"
                ),
                other => panic!("{transport:?}: {other}"),
            }
            assert!(again.contains("unusable"), "{again}");
        }
    }
}

/// A rank that stays connected but never joins the collective: the others time out within
/// the configured timeout, naming the rank they wait on.
#[test]
fn a_stalled_peer_times_out_naming_it() {
    let results = run_ranks_timeout(2, Transport::Auto, Duration::from_millis(1500), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(3));
            return None;
        }
        let start = Instant::now();
        let err = comm
            .world()
            .all_reduce(&mut [1.0f32; 10], ReduceOp::Sum)
            .unwrap_err();
        Some((err, start.elapsed()))
    });
    let (err, took) = results.into_iter().flatten().next().unwrap();
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(3),
        "{took:?}"
    );
    match err {
        CommError::Timeout { missing, .. } => assert_eq!(missing, vec![1]),
        other => panic!("{other}"),
    }
}

/// While the ranks rendezvous, a stranger connects to the store and to a rank's peer port
/// with garbage and with a wrong token; the job completes all the same.
#[test]
fn strangers_are_refused_and_the_job_goes_on() {
    let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN)).unwrap();
    let port = server.addr().port();
    let world = 3;
    let early: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                init(&options(
                    rank,
                    world,
                    port,
                    Transport::Auto,
                    Duration::from_secs(30),
                ))
            })
        })
        .collect();
    let spy = StoreClient::connect(
        &format!("127.0.0.1:{port}"),
        Some(TOKEN),
        Duration::from_secs(10),
    )
    .unwrap();
    let peer0 = String::from_utf8(spy.get("peer/0").unwrap()).unwrap();
    let peer0 = peer0.lines().next().unwrap().to_string();
    for garbage in [
        &b"\xff\xff\xff\x7fjunk"[..],
        b"GET / HTTP/1.0\r\n\r\n",
        b"\x10\x00\x00\x00\x0dds-rs peer v1\x05wrong",
    ] {
        for addr in [peer0.clone(), format!("127.0.0.1:{port}")] {
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            let _ = s.write_all(garbage);
        }
    }
    let _silent = std::net::TcpStream::connect(&peer0).unwrap(); // connects and says nothing
    assert!(StoreClient::connect(
        &format!("127.0.0.1:{port}"),
        Some("wrong"),
        Duration::from_secs(2)
    )
    .is_err());
    let last = std::thread::spawn(move || {
        init(&options(
            2,
            world,
            port,
            Transport::Auto,
            Duration::from_secs(30),
        ))
    });
    let comms: Vec<_> = early
        .into_iter()
        .chain([last])
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut x = [c.rank() as f32 + 1.0];
                c.world().all_reduce(&mut x, ReduceOp::Sum).unwrap();
                x[0]
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 6.0);
    }
}

/// A rank whose peers never arrive: the rendezvous fails within the timeout naming them.
#[test]
fn rendezvous_times_out_naming_absent_ranks() {
    let server = StoreServer::bind("127.0.0.1:0", Some(TOKEN)).unwrap();
    let port = server.addr().port();
    let start = Instant::now();
    let err = init(&options(
        1,
        4,
        port,
        Transport::Auto,
        Duration::from_millis(800),
    ))
    .err()
    .unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    match err {
        CommError::Timeout { missing, .. } => assert_eq!(missing, vec![0, 2, 3]),
        other => panic!("{other}"),
    }
}
