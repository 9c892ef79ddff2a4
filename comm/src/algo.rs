//! Collective algorithms over the links of a group: ring reduce-scatter and all-gather for
//! large messages (bandwidth-optimal: each rank sends 2(n-1)/n of the data for an
//! all-reduce), direct exchanges for small ones (one round of latency), a pipelined chain
//! for broadcast and a dissemination barrier. A ring pass is one exchange in which each
//! piece is forwarded as soon as it is reduced (`ring`), so sending, receiving and reducing
//! overlap; the all-reduce runs it slice by slice to reuse what is in cache.

use crate::dtype::{combine, combine_into, Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::exchange::{exchange, Deadline, RecvOp, Region, SendOp};
use crate::link::Links;
use std::ops::Range;

/// Below this many bytes per rank a direct exchange beats the ring's 2(n-1) steps.
const DIRECT_MAX_BYTES: usize = 64 << 10;
/// Largest group that uses direct exchanges (they cost n messages per rank).
const DIRECT_MAX_RANKS: usize = 16;
/// An all-reduce runs its ring over slices of n parts of this size, so that what the
/// reduce-scatter sums is still in cache when the all-gather sends it.
const SLICE_PART_BYTES: usize = 256 << 10;
/// Broadcast forwards in pieces of this size so that a chain of ranks works at once.
const CHAIN_CHUNK_BYTES: usize = 1 << 20;

/// One rank's view of a group while it runs a collective.
pub(crate) struct Ctx<'a> {
    pub links: &'a mut Links,
    /// Global ranks of the group, in group order.
    pub ranks: &'a [usize],
    /// This rank's index in `ranks`.
    pub me: usize,
    pub deadline: Deadline,
}

impl Ctx<'_> {
    fn n(&self) -> usize {
        self.ranks.len()
    }
    /// The global rank `k` places after this one in group order (k may be negative).
    fn at(&self, k: isize) -> usize {
        let n = self.n() as isize;
        self.ranks[(self.me as isize + k).rem_euclid(n) as usize]
    }
    fn idx(&self, k: isize) -> usize {
        (self.me as isize + k).rem_euclid(self.n() as isize) as usize
    }
    fn xchg(&mut self, sends: &mut [SendOp], recvs: &mut [RecvOp]) -> Result<()> {
        exchange(self.links, sends, recvs, self.deadline)
    }
}

/// Splits `len` elements into `n` contiguous parts, the first `len % n` one longer.
pub(crate) fn even_counts(len: usize, n: usize) -> Vec<usize> {
    (0..n).map(|i| len / n + usize::from(i < len % n)).collect()
}

pub(crate) fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|c| {
            start += c;
            start - c..start
        })
        .collect()
}

fn bytes<T: Element>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// A shared view of `a` and a mutable one of `b`, two disjoint ranges of `buf`.
fn split_two<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    // Compare ends, not starts: an empty part (a zero count) may start where the other does.
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

/// Calls `f` with the received bytes viewed as elements (copying only if misaligned).
fn as_elems<T: Element>(raw: &[u8], f: impl FnOnce(&[T])) {
    match bytemuck::try_cast_slice::<u8, T>(raw) {
        Ok(v) => f(v),
        Err(_) => f(&bytemuck::pod_collect_to_vec::<u8, T>(raw)),
    }
}

/// Folds received bytes `raw` into `dst`, or into `a` written to `dst` when given (`dst` and
/// `a` are bytes of `T` buffers, so aligned for `T`).
fn fold<T: Element>(
    dst: &mut [u8],
    a: Option<&[u8]>,
    raw: &[u8],
    op: ReduceOp,
    scale: Option<f32>,
) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    let a: Option<&[T]> = a.map(bytemuck::cast_slice);
    as_elems::<T>(raw, |src| combine_into(dst, a, src, op, scale));
}

/// Whether a message of `bytes` per rank in a group of `n` takes the direct (one-round) path.
fn goes_direct(bytes: usize, n: usize) -> bool {
    bytes <= DIRECT_MAX_BYTES && n <= DIRECT_MAX_RANKS
}

fn avg_scale(op: ReduceOp, n: usize) -> Option<f32> {
    (op == ReduceOp::Avg).then_some(1.0 / n as f32)
}

pub(crate) fn all_reduce<T: Element>(cx: &mut Ctx, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let n = cx.n();
    if n == 1 {
        return Ok(()); // a group of one: sum, max and avg (divided by 1) are the input
    }
    if goes_direct(std::mem::size_of_val(buf), n) {
        return all_reduce_direct(cx, buf, op);
    }
    // Slice by slice, so that a slice's parts are still in cache when the all-gather sends
    // what the reduce-scatter just summed: one pass over memory instead of two.
    let slice = SLICE_PART_BYTES / std::mem::size_of::<T>() * n;
    for chunk in buf.chunks_mut(slice) {
        let segs = ranges(&even_counts(chunk.len(), n));
        ring(cx, chunk, &segs, 0..2 * (n - 1), op)?;
    }
    Ok(())
}

/// Steps `steps` of the ring all-reduce over the parts `segs` of `buf`, as one exchange.
/// Step j sends part me-j-1 to the next rank and receives part me-j-2 from the previous
/// one, folding it in for j < n-1 (the reduce-scatter) and copying it after (the
/// all-gather). Each send after the first relays the receive before it, so a piece moves
/// on as soon as it is final; a receive that overwrites a part first waits until this
/// rank has sent that part.
fn ring<T: Element>(
    cx: &mut Ctx,
    buf: &mut [T],
    segs: &[Range<usize>],
    steps: Range<usize>,
    op: ReduceOp,
) -> Result<()> {
    let n = cx.n();
    let (next, prev) = (cx.at(1), cx.at(-1));
    let part = |j: usize, k: usize| cx.idx(-((j + k) as isize));
    let sum = |_: usize, d: &mut [u8], s: &[u8]| fold::<T>(d, None, s, op, None);
    let last = |_: usize, d: &mut [u8], s: &[u8]| fold::<T>(d, None, s, op, avg_scale(op, n));
    let regions = Region::parts(buf, segs);
    let mut sends = Vec::with_capacity(steps.len());
    let mut recvs = Vec::with_capacity(steps.len());
    for (k, j) in steps.clone().enumerate() {
        let send = SendOp::region(next, regions[part(j, 1)]);
        sends.push(if k > 0 { send.relay(k - 1) } else { send });
        let recv = RecvOp::region(prev, regions[part(j, 2)]);
        recvs.push(match j + 1 < n {
            true if j + 2 == n => recv.reducing(&last),
            true => recv.reducing(&sum),
            // The part was sent at step j-(n-1), or in an earlier exchange.
            false => match (j + 1 - n).checked_sub(steps.start) {
                Some(sent) => recv.after_send(sent),
                None => recv,
            },
        });
    }
    cx.xchg(&mut sends, &mut recvs)
}

/// Every rank sends its whole buffer to every other and reduces all of them in group order,
/// so that every rank computes the bit-identical result.
fn all_reduce_direct<T: Element>(cx: &mut Ctx, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    let mut inbox: Vec<Vec<T>> = (0..n)
        .map(|i| {
            if i == me {
                Vec::new()
            } else {
                vec![T::default(); buf.len()]
            }
        })
        .collect();
    {
        let peers: Vec<usize> = (1..n as isize).map(|k| cx.at(k)).collect();
        let mut sends: Vec<SendOp> = peers.iter().map(|&p| SendOp::new(p, bytes(buf))).collect();
        let mut recvs: Vec<RecvOp> = inbox
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| *i != me)
            .map(|(i, v)| RecvOp::to(cx.ranks[i], bytemuck::cast_slice_mut(v)))
            .collect();
        cx.xchg(&mut sends, &mut recvs)?;
    }
    inbox[me] = buf.to_vec();
    let (first, rest) = inbox.split_first().unwrap();
    buf.copy_from_slice(first);
    for (i, src) in rest.iter().enumerate() {
        let scale = if i + 2 == n { avg_scale(op, n) } else { None };
        combine(buf, src, op, scale);
    }
    Ok(())
}

/// Ring reduce-scatter in place: afterwards `buf[ranges(counts)[me]]` holds the reduction of
/// that part over the group (other parts hold partial sums).
pub(crate) fn reduce_scatter_v<T: Element>(
    cx: &mut Ctx,
    buf: &mut [T],
    counts: &[usize],
    op: ReduceOp,
) -> Result<()> {
    let n = cx.n();
    check_counts(buf.len(), counts, n)?;
    if n == 1 {
        return Ok(()); // a group of one: sum, max and avg (divided by 1) are the input
    }
    ring(cx, buf, &ranges(counts), 0..n - 1, op)
}

/// Out-of-place reduce-scatter of equal parts: `output` receives the reduction of part `me`
/// of every rank's `input`, which stays as it is. The ring runs slice by slice, so partial
/// sums need only a scratch of n-2 slice parts rather than a copy of `input`.
pub(crate) fn reduce_scatter_into<T: Element>(
    cx: &mut Ctx,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, c) = (cx.n(), output.len());
    debug_assert_eq!(
        input.len(),
        n * c,
        "Group::reduce_scatter checks the lengths"
    );
    if n == 1 {
        output.copy_from_slice(input); // sum, max and avg (divided by 1) of one input
        return Ok(());
    }
    let q = (SLICE_PART_BYTES / std::mem::size_of::<T>()).min(c).max(1);
    let mut scratch = vec![T::default(); (n - 2) * q];
    for lo in (0..c).step_by(q) {
        let hi = (lo + q).min(c);
        let parts: Vec<&[T]> = (0..n).map(|i| &input[i * c + lo..i * c + hi]).collect();
        let slots = ranges(&vec![hi - lo; n - 2]);
        ring_into(cx, &parts, &mut scratch, &slots, &mut output[lo..hi], op)?;
    }
    Ok(())
}

/// One slice of `reduce_scatter_into`: the reduce-scatter steps of `ring`, where step j folds
/// the received partial sum and this rank's input part into slot j of `scratch` (the last
/// step into `out`), and the next step relays it.
fn ring_into<T: Element>(
    cx: &mut Ctx,
    parts: &[&[T]],
    scratch: &mut [T],
    slots: &[Range<usize>],
    out: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let n = cx.n();
    let (next, prev) = (cx.at(1), cx.at(-1));
    let part = |j: usize| bytes(parts[cx.idx(-(j as isize) - 2)]);
    let folds: Vec<_> = (0..n - 1)
        .map(|j| {
            let (a, scale) = (part(j), avg_scale(op, n).filter(|_| j + 2 == n));
            move |off: usize, d: &mut [u8], raw: &[u8]| {
                fold::<T>(d, Some(&a[off..off + raw.len()]), raw, op, scale);
            }
        })
        .collect();
    let mut dests = Region::parts(scratch, slots);
    dests.push(Region::whole(out));
    let mut sends = vec![SendOp::new(next, bytes(parts[cx.idx(-1)]))];
    let mut recvs = Vec::with_capacity(n - 1);
    for (j, fold) in folds.iter().enumerate() {
        recvs.push(RecvOp::region(prev, dests[j]).reducing(fold));
        if j > 0 {
            sends.push(SendOp::region(next, dests[j - 1]).relay(j - 1));
        }
    }
    cx.xchg(&mut sends, &mut recvs)
}

/// Ring all-gather in place: `buf[ranges(counts)[i]]` of every rank i ends up everywhere.
pub(crate) fn all_gather_v<T: Element>(
    cx: &mut Ctx,
    buf: &mut [T],
    counts: &[usize],
) -> Result<()> {
    let n = cx.n();
    check_counts(buf.len(), counts, n)?;
    if n == 1 {
        return Ok(());
    }
    if goes_direct(std::mem::size_of_val(buf), n) {
        return all_gather_direct(cx, buf, counts);
    }
    // The all-gather is the second half of the all-reduce's ring: nothing is folded.
    ring(cx, buf, &ranges(counts), n - 1..2 * (n - 1), ReduceOp::Sum)
}

fn all_gather_direct<T: Element>(cx: &mut Ctx, buf: &mut [T], counts: &[usize]) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    let segs = ranges(counts);
    let mine = buf[segs[me].clone()].to_vec();
    let peers: Vec<usize> = (1..n as isize).map(|k| cx.at(k)).collect();
    let mut sends: Vec<SendOp> = peers
        .iter()
        .map(|&p| SendOp::new(p, bytes(&mine)))
        .collect();
    let mut recvs = recv_parts(cx.ranks, me, buf, counts);
    cx.xchg(&mut sends, &mut recvs)
}

/// A receive from every other group member (`ranks`, this rank at `me`) into its part of
/// `buf`, cut by `counts`.
fn recv_parts<'a, T: Element>(
    ranks: &[usize],
    me: usize,
    buf: &'a mut [T],
    counts: &[usize],
) -> Vec<RecvOp<'a>> {
    let mut parts: Vec<&mut [T]> = Vec::with_capacity(counts.len());
    let mut rest = buf;
    for c in counts {
        let (head, tail) = rest.split_at_mut(*c);
        parts.push(head);
        rest = tail;
    }
    parts
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != me)
        .map(|(i, p)| RecvOp::to(ranks[i], bytemuck::cast_slice_mut(p)))
        .collect()
}

/// All-to-all with parts of any sizes: `input[ranges(send)[j]]` goes to group index j, and what
/// index i sends lands in `output[ranges(recv)[i]]`. Every send and receive progresses in one
/// exchange (each pair's bytes keep their order on its link), this rank's own part is copied.
/// As MPI's `Alltoallv`, each rank's `send[j]` must equal rank j's `recv[i]`.
pub(crate) fn all_to_all_v<T: Element>(
    cx: &mut Ctx,
    input: &[T],
    send: &[usize],
    output: &mut [T],
    recv: &[usize],
) -> Result<()> {
    let (n, me) = (cx.n(), cx.me);
    check_counts(input.len(), send, n)?;
    check_counts(output.len(), recv, n)?;
    if send[me] != recv[me] {
        return Err(CommError::Invalid(format!(
            "all_to_all: this rank sends itself {} elements and expects {}",
            send[me], recv[me]
        )));
    }
    let (to, from) = (ranges(send), ranges(recv));
    output[from[me].clone()].copy_from_slice(&input[to[me].clone()]);
    let mut sends: Vec<SendOp> = (0..n)
        .filter(|&j| j != me)
        .map(|j| SendOp::new(cx.ranks[j], bytes(&input[to[j].clone()])))
        .collect();
    let mut recvs = recv_parts(cx.ranks, me, output, recv);
    cx.xchg(&mut sends, &mut recvs)
}

fn check_counts(len: usize, counts: &[usize], n: usize) -> Result<()> {
    if counts.len() != n || counts.iter().sum::<usize>() != len {
        return Err(CommError::Invalid(format!(
            "counts {:?} do not split {len} elements over a group of {n}",
            if counts.len() > 8 {
                &counts[..8]
            } else {
                counts
            }
        )));
    }
    Ok(())
}

/// Broadcast from group index `root`: small messages go straight from the root to everyone,
/// large ones down a chain in pieces, each rank forwarding a piece while the next arrives.
pub(crate) fn broadcast<T: Element>(cx: &mut Ctx, buf: &mut [T], root: usize) -> Result<()> {
    let n = cx.n();
    if n == 1 {
        return Ok(());
    }
    let data: &mut [u8] = bytemuck::cast_slice_mut(buf);
    if goes_direct(data.len(), n) {
        return broadcast_direct(cx, data, root);
    }
    let pos = (cx.me + n - root) % n;
    let prev = (pos > 0).then(|| cx.at(-1));
    let next = (pos + 1 < n).then(|| cx.at(1));
    let Some(prev) = prev else {
        return cx.xchg(&mut [SendOp::new(next.unwrap(), data)], &mut []);
    };
    let pieces: Vec<Range<usize>> = (0..data.len())
        .step_by(CHAIN_CHUNK_BYTES)
        .map(|s| s..(s + CHAIN_CHUNK_BYTES).min(data.len()))
        .collect();
    // Iteration c receives piece c and forwards piece c-1.
    for c in 0..=pieces.len() {
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let (fwd, into): (&[u8], &mut [u8]) = match (c.checked_sub(1), pieces.get(c)) {
            (Some(f), Some(r)) => split_two(data, pieces[f].clone(), r.clone()),
            (Some(f), None) => (&data[pieces[f].clone()], &mut []),
            (None, Some(r)) => (&[], &mut data[r.clone()]),
            (None, None) => (&[], &mut []),
        };
        if let (Some(next), true) = (next, c > 0) {
            sends.push(SendOp::new(next, fwd));
        }
        if c < pieces.len() {
            recvs.push(RecvOp::to(prev, into));
        }
        cx.xchg(&mut sends, &mut recvs)?;
    }
    Ok(())
}

fn broadcast_direct(cx: &mut Ctx, data: &mut [u8], root: usize) -> Result<()> {
    if cx.me == root {
        let peers: Vec<usize> = (1..cx.n() as isize).map(|k| cx.at(k)).collect();
        let mut sends: Vec<SendOp> = peers.iter().map(|&p| SendOp::new(p, data)).collect();
        return cx.xchg(&mut sends, &mut []);
    }
    cx.xchg(&mut [], &mut [RecvOp::to(cx.ranks[root], data)])
}

/// Dissemination barrier: ceil(log2 n) rounds of one byte each way.
pub(crate) fn barrier(cx: &mut Ctx) -> Result<()> {
    let mut dist = 1;
    while dist < cx.n() {
        let (to, from) = (cx.at(dist as isize), cx.at(-(dist as isize)));
        cx.xchg(
            &mut [SendOp::new(to, &[1u8])],
            &mut [RecvOp::to(from, &mut [0u8])],
        )?;
        dist *= 2;
    }
    Ok(())
}

/// Point-to-point: an 8-byte length header, then the data.
pub(crate) fn send<T: Element>(cx: &mut Ctx, buf: &[T], to: usize) -> Result<()> {
    let header = (buf.len() as u64).to_le_bytes();
    cx.xchg(
        &mut [SendOp::new(to, &header), SendOp::new(to, bytes(buf))],
        &mut [],
    )
}

/// Point-to-point sends and receives in one exchange, all progressing together; the lengths
/// are known to both ends (no header), and several to one peer pair up in list order.
pub(crate) fn send_recv(
    cx: &mut Ctx,
    sends: &[(usize, &[u8])],
    recvs: &mut [(usize, &mut [u8])],
) -> Result<()> {
    let mut sends: Vec<SendOp> = sends.iter().map(|(to, b)| SendOp::new(*to, b)).collect();
    let mut recvs: Vec<RecvOp> = recvs
        .iter_mut()
        .map(|(from, b)| RecvOp::to(*from, b))
        .collect();
    cx.xchg(&mut sends, &mut recvs)
}

pub(crate) fn recv<T: Element>(cx: &mut Ctx, buf: &mut [T], from: usize) -> Result<()> {
    let mut header = [0u8; 8];
    cx.xchg(&mut [], &mut [RecvOp::to(from, &mut header)])?;
    let count = u64::from_le_bytes(header) as usize;
    if count != buf.len() {
        return Err(CommError::Invalid(format!(
            "recv: rank {from} sent {count} elements, this rank expected {}",
            buf.len()
        )));
    }
    cx.xchg(
        &mut [],
        &mut [RecvOp::to(from, bytemuck::cast_slice_mut(buf))],
    )
}
