//! Whether the launcher bound this rank to fewer cores than its share of the host.
//!
//! Open MPI's `mpirun` binds each process to one core when it starts two or fewer (to a socket
//! beyond), whatever the host has: on a 32-core machine `mpirun -np 2` leaves each rank one core
//! for its compute threads and its comm stream, and the other 30 idle. A rank sees it in its
//! allowed CPUs against its launcher's (Linux: `Cpus_allowed_list` in `/proc/<pid>/status`;
//! elsewhere nothing is said).

/// One line for the user when this process may run on fewer cores than its launcher (its
/// parent: `mpirun` or `orted`) had for each of `local_ranks` ranks; `None` when it may use its
/// share, or when the system does not say. `compute_threads` is what the rank computes on.
pub fn binding_note(local_ranks: usize, compute_threads: usize) -> Option<String> {
    let mine = allowed_cpus("self")?;
    let launcher = allowed_cpus(&std::os::unix::process::parent_id().to_string())?;
    note_for(mine, launcher, local_ranks, compute_threads)
}

/// The note for a rank allowed `mine` CPUs whose launcher was allowed `launcher` for
/// `local_ranks` ranks.
fn note_for(mine: usize, launcher: usize, local_ranks: usize, compute_threads: usize) -> Option<String> {
    let share = launcher / local_ranks.max(1);
    if mine >= share.max(1) {
        return None;
    }
    let cores = |n: usize| {
        if n == 1 {
            "1 core".to_string()
        } else {
            format!("{n} cores")
        }
    };
    Some(format!(
        "mpirun bound this rank to {} of the {} it had for {local_ranks} rank(s) on this host: \
         the rank's {compute_threads} compute thread(s) and its comm stream share {}; \
         `mpirun --bind-to none`, or `--map-by slot:PE={share}`, gives each rank {}",
        cores(mine),
        cores(launcher),
        if mine == 1 { "it" } else { "them" },
        cores(share)
    ))
}

/// CPUs process `pid` (`self` or a number) may run on, from `/proc`.
fn allowed_cpus(pid: &str) -> Option<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    cpus_in_list(list.trim())
}

/// How many CPUs a kernel CPU list names (`0-3,8,10-11` is 7).
fn cpus_in_list(list: &str) -> Option<usize> {
    list.split(',').try_fold(0usize, |n, part| {
        let count = match part.split_once('-') {
            Some((lo, hi)) => {
                hi.trim()
                    .parse::<usize>()
                    .ok()?
                    .checked_sub(lo.trim().parse::<usize>().ok()?)?
                    + 1
            }
            None => {
                part.trim().parse::<usize>().ok()?;
                1
            }
        };
        Some(n + count)
    })
}

#[cfg(test)]
mod tests {
    use super::{allowed_cpus, cpus_in_list, note_for};

    #[test]
    fn a_cpu_list_counts_its_ranges_and_singles() {
        assert_eq!(cpus_in_list("0-3,8,10-11"), Some(7));
        assert_eq!(cpus_in_list("5"), Some(1));
        assert_eq!(cpus_in_list("0-1"), Some(2));
        assert_eq!(cpus_in_list(""), None);
        assert_eq!(cpus_in_list("3-1"), None);
        assert_eq!(cpus_in_list("a-b"), None);
    }

    #[test]
    fn a_rank_below_its_share_is_told_how_to_get_it() {
        // mpirun -np 2 on 32 cores: one core each.
        let note = note_for(1, 32, 2, 1).expect("one core of a 16-core share");
        assert!(note.contains("bound this rank to 1 core of the 32 cores"), "{note}");
        assert!(
            note.contains("--map-by slot:PE=16") && note.ends_with("gives each rank 16 cores"),
            "{note}"
        );
        // Its share or more: nothing to say (2 ranks on 2 cores bound one each, or unbound).
        assert_eq!(note_for(1, 2, 2, 1), None);
        assert_eq!(note_for(32, 32, 2, 16), None);
        // More ranks than cores: the share is less than one core.
        assert_eq!(note_for(1, 2, 4, 1), None);
    }

    #[test]
    fn this_process_sees_its_own_cpus_on_linux() {
        if std::path::Path::new("/proc/self/status").exists() {
            assert!(allowed_cpus("self").is_some_and(|n| n >= 1));
        }
    }
}
