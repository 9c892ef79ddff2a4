"""The peer for `ds-rs bench comm --op all_to_all`: torch.distributed gloo all_to_all_single
(2 ranks, loopback TCP) at sizes in bytes, the whole buffer as nccl-tests counts it.

A barrier before each call, median of --iters timed calls after --warmup, on rank 0;
busbw = algbw * (n-1)/n (nccl-tests' alltoall). Needs the peer's torch:
  OMP_NUM_THREADS=1 /opt/peer/bin/python scripts/bench/alltoall_gloo_bytes.py --min-bytes 1024
"""
import argparse, json, socket, statistics, time
import torch, torch.distributed as dist, torch.multiprocessing as mp


def worker(rank, world, port, sizes, iters, warmup, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for s in sizes:
        n = max(s // 4 // world * world, world)
        x, y = torch.ones(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        ts = []
        for i in range(warmup + iters):
            dist.barrier(); t0 = time.perf_counter(); dist.all_to_all_single(y, x); dt = time.perf_counter() - t0
            if i >= warmup:
                ts.append(dt)
        if rank == 0:
            med = statistics.median(ts)
            q.put(dict(bench="alltoall_gloo", bytes=n * 4, time_us=1e6 * med,
                       busbw_gbs=n * 4 / med / 1e9 * (world - 1) / world))
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-bytes", type=int, default=1024)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    sizes, s = [], a.min_bytes
    while s <= a.max_bytes:
        sizes.append(s)
        s *= 2
    sk = socket.socket(); sk.bind(("127.0.0.1", 0)); port = sk.getsockname()[1]; sk.close()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    mp.start_processes(worker, args=(2, port, sizes, a.iters, a.warmup, q), nprocs=2, join=True, start_method="spawn")
    while not q.empty():
        print(json.dumps(q.get()))
