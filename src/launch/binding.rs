//! `--bind_cores_to_rank` / `--bind_core_list`: each local rank gets its own contiguous share
//! of the host's cores and as many compute threads, as DeepSpeed's launcher does with
//! numactl. Here the launcher sets each rank's CPU affinity itself (sched_setaffinity before
//! exec), so no numactl is needed; memory then lands near the cores by first touch.

use std::os::unix::process::CommandExt;
use std::process::Command;

use anyhow::{bail, Context};

/// The cores each local rank is bound to, in local-rank order.
pub fn plan(list: Option<&str>, local_ranks: usize) -> anyhow::Result<Vec<Vec<usize>>> {
    let usable = allowed_cores().context("reading this process's CPU affinity")?;
    let cores = match list {
        Some(spec) => {
            let cores =
                parse_core_list(spec).with_context(|| format!("--bind_core_list {spec:?}"))?;
            if let Some(c) = cores.iter().find(|c| !usable.contains(c)) {
                bail!("--bind_core_list {spec:?}: core {c} is not available here (usable: {usable:?})");
            }
            cores
        }
        None => usable,
    };
    let per_rank = cores.len() / local_ranks.max(1);
    if per_rank == 0 {
        bail!(
            "--bind_cores_to_rank: {} cores cannot give each of {local_ranks} ranks one",
            cores.len()
        );
    }
    Ok(cores
        .chunks(per_rank)
        .take(local_ranks)
        .map(<[usize]>::to_vec)
        .collect())
}

/// Parses `1,3-5,7` into [1, 3, 4, 5, 7] (DeepSpeed's --bind_core_list syntax).
pub fn parse_core_list(spec: &str) -> anyhow::Result<Vec<usize>> {
    let mut cores = Vec::new();
    for item in spec.split(',').map(str::trim) {
        let number = |s: &str| {
            s.trim()
                .parse::<usize>()
                .with_context(|| format!("{s:?} is not a core number"))
        };
        match item.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (number(lo)?, number(hi)?);
                if lo > hi {
                    bail!("range {item:?} runs backwards");
                }
                cores.extend(lo..=hi);
            }
            None => cores.push(number(item)?),
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(c) = cores.iter().find(|c| !seen.insert(**c)) {
        bail!("core {c} is listed twice");
    }
    Ok(cores)
}

/// Binds the process `cmd` starts to `cores` and gives it as many compute threads.
pub fn bind(cmd: &mut Command, cores: &[usize]) {
    let threads = cores.len().to_string();
    cmd.env("OMP_NUM_THREADS", &threads)
        .env("RAYON_NUM_THREADS", &threads);
    // SAFETY: a cpu_set_t built before fork; the closure only calls sched_setaffinity, which
    // is async-signal-safe.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cores {
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    unsafe {
        cmd.pre_exec(
            move || match libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            },
        );
    }
}

/// The cores this process may run on.
fn allowed_cores() -> std::io::Result<Vec<usize>> {
    // SAFETY: sched_getaffinity fills a zeroed cpu_set_t of the size we pass.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let max = 8 * std::mem::size_of_val(&set);
    // SAFETY: CPU_ISSET reads the set within its size.
    Ok((0..max)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_lists_parse_as_deepspeed_writes_them() {
        assert_eq!(parse_core_list("1,3-5,7").unwrap(), vec![1, 3, 4, 5, 7]);
        assert_eq!(parse_core_list(" 0 - 2 ").unwrap(), vec![0, 1, 2]);
        for bad in ["", "a", "3-1", "1,1", "1-", "-2"] {
            assert!(parse_core_list(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn each_rank_gets_a_contiguous_share() {
        let usable = allowed_cores().unwrap();
        let plan = plan(None, 1).unwrap();
        assert_eq!(plan, vec![usable.clone()]);
        if usable.len() >= 2 {
            let two = format!("{},{}", usable[0], usable[1]);
            assert_eq!(
                super::plan(Some(&two), 2).unwrap(),
                vec![vec![usable[0]], vec![usable[1]]]
            );
        }
        let err = super::plan(None, usable.len() + 1).unwrap_err();
        assert!(format!("{err:#}").contains("ranks one"), "{err:#}");
        let err = super::plan(Some("100000"), 1).unwrap_err();
        assert!(format!("{err:#}").contains("not available"), "{err:#}");
    }
}
