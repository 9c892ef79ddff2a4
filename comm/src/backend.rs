//! Which engine moves a group's data (`--dist_backend`, DeepSpeed's `dist_backend`), and the
//! one place a collective is sent to it: the built-in links (shared memory and TCP, the
//! algorithms of `algo`) or MPI's own collectives (feature `mpi`). `Group` does not know which.

use crate::algo::{self, Ctx};
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::link::Links;
use std::sync::Mutex;

#[cfg(feature = "mpi")]
use crate::mpi_backend::{MpiGroup, MpiWorld};
#[cfg(feature = "nccl")]
use crate::nccl_net::NcclNet;

/// Variable naming the backend when no `--dist_backend` is given.
pub const BACKEND_VAR: &str = "DS_RS_DIST_BACKEND";

/// DeepSpeed's `dist_backend` names that ds-rs has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// ds-comm's own transport: shared memory within a host, TCP between hosts.
    #[default]
    Ds,
    /// MPI's collectives (OpenMPI: its shared memory, TCP, UCX or verbs transports).
    Mpi,
    /// NCCL, on GPUs.
    Nccl,
}

impl Backend {
    pub fn parse(name: &str) -> Result<Backend> {
        match name {
            "ds" => Ok(Backend::Ds),
            "mpi" => Ok(Backend::Mpi),
            "nccl" => Ok(Backend::Nccl),
            other => Err(CommError::Env(format!(
                "dist_backend {other:?}: expected \"ds\" (the built-in shared memory and TCP \
                 transport), \"mpi\" or \"nccl\""
            ))),
        }
    }

    /// `DS_RS_DIST_BACKEND`, else this build's default: the built-in transport on CPU.
    pub fn from_env() -> Result<Backend> {
        match std::env::var(BACKEND_VAR) {
            Ok(v) if !v.is_empty() => {
                Backend::parse(&v).map_err(|e| CommError::Env(format!("{BACKEND_VAR}: {e}")))
            }
            _ => Ok(Backend::default()),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Ds => "ds",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }

    /// Refuses a backend this build cannot run, saying what would.
    pub fn check_built(self) -> Result<()> {
        match self {
            Backend::Ds => Ok(()),
            Backend::Mpi if cfg!(feature = "mpi") => Ok(()),
            Backend::Mpi => Err(CommError::Env(
                "dist_backend mpi: this ds-rs was built without MPI; build it with \
                 `cargo build --release --features mpi` (scripts/install-mpi.sh installs OpenMPI)"
                    .into(),
            )),
            Backend::Nccl if cfg!(feature = "nccl") => Ok(()),
            Backend::Nccl => Err(CommError::Env(
                "dist_backend nccl: this is the CPU build of ds-rs, whose tensors live in host \
                 memory; use \"ds\" (the default) or \"mpi\""
                    .into(),
            )),
        }
    }
}

/// What a rank's communicator moves data over.
pub(crate) enum Net {
    Links(Mutex<Links>),
    #[cfg(feature = "mpi")]
    Mpi(MpiWorld),
    /// The links, and NCCL for collectives on GPU memory.
    #[cfg(feature = "nccl")]
    Nccl(Mutex<Links>, NcclNet),
}

impl Net {
    pub fn backend(&self) -> Backend {
        match self {
            Net::Links(_) => Backend::Ds,
            #[cfg(feature = "mpi")]
            Net::Mpi(_) => Backend::Mpi,
            #[cfg(feature = "nccl")]
            Net::Nccl(..) => Backend::Nccl,
        }
    }
}

/// One collective's way to its peers: the links with the group's view of them, or the MPI
/// communicator of the group.
pub(crate) enum Exec<'a, 'b> {
    Links(&'a mut Ctx<'b>),
    #[cfg(feature = "mpi")]
    Mpi(&'a MpiGroup<'b>),
    /// NCCL where the buffers are GPU memory, else the links.
    #[cfg(feature = "nccl")]
    Nccl(&'a mut Ctx<'b>, &'a NcclNet),
}

impl Exec<'_, '_> {
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::all_reduce(cx, buf, op),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.all_reduce(buf, op),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, n) => n.all_reduce(cx, buf, op),
        }
    }

    pub fn reduce_scatter_into<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::reduce_scatter_into(cx, input, output, op),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.reduce_scatter_into(input, output, op),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, n) => n.reduce_scatter_into(cx, input, output, op),
        }
    }

    pub fn reduce_scatter_v<T: Element>(
        &mut self,
        buf: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::reduce_scatter_v(cx, buf, counts, op),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.reduce_scatter_v(buf, counts, op),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, n) => n.reduce_scatter_v(cx, buf, counts, op),
        }
    }

    pub fn all_gather_v<T: Element>(&mut self, buf: &mut [T], counts: &[usize]) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::all_gather_v(cx, buf, counts),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.all_gather_v(buf, counts),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, n) => n.all_gather_v(cx, buf, counts),
        }
    }

    /// Note [all-to-all under nccl]: `--dist_backend nccl` runs all-to-all over the links for
    /// host and GPU buffers alike (managed memory, which the host reads), not through NCCL's
    /// grouped sends and receives: those are not measured on a GPU yet, and the experts' token
    /// exchange they would carry is not built yet (issue 37).
    pub fn all_to_all_v<T: Element>(
        &mut self,
        input: &[T],
        send: &[usize],
        output: &mut [T],
        recv: &[usize],
    ) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::all_to_all_v(cx, input, send, output, recv),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.all_to_all_v(input, send, output, recv),
            // Note [all-to-all under nccl]
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, _) => algo::all_to_all_v(cx, input, send, output, recv),
        }
    }

    /// `root` is the root's index in the group.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::broadcast(cx, buf, root),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.broadcast(buf, root),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, n) => n.broadcast(cx, buf, root),
        }
    }

    /// `to` and `from` below are global ranks.
    pub fn send<T: Element>(&mut self, buf: &[T], to: usize) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::send(cx, buf, to),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.send(buf, to),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, _) => algo::send(cx, buf, to),
        }
    }

    pub fn recv<T: Element>(&mut self, buf: &mut [T], from: usize) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::recv(cx, buf, from),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.recv(buf, from),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, _) => algo::recv(cx, buf, from),
        }
    }

    pub fn send_recv(
        &mut self,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::send_recv(cx, sends, recvs),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.send_recv(sends, recvs),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, _) => algo::send_recv(cx, sends, recvs),
        }
    }

    pub fn barrier(&mut self) -> Result<()> {
        match self {
            Exec::Links(cx) => algo::barrier(cx),
            #[cfg(feature = "mpi")]
            Exec::Mpi(g) => g.barrier(),
            #[cfg(feature = "nccl")]
            Exec::Nccl(cx, _) => algo::barrier(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_ones_list_the_choices() {
        for b in [Backend::Ds, Backend::Mpi, Backend::Nccl] {
            assert_eq!(Backend::parse(b.name()).unwrap(), b);
        }
        let e = Backend::parse("gloo").unwrap_err().to_string();
        assert!(e.contains("\"gloo\"") && e.contains("\"mpi\""), "{e}");
        assert_eq!(Backend::Nccl.check_built().is_ok(), cfg!(feature = "nccl"));
        assert_eq!(Backend::Mpi.check_built().is_ok(), cfg!(feature = "mpi"));
    }
}
