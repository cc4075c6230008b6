//! CPU affinity: host threads that talk to a GPU run on the CPUs next to it.
//!
//! Why: on a two-socket host every driver call and every poll of pinned host memory crosses the
//! socket link when the thread runs on the far socket, which adds microseconds to each kernel
//! launch and to each proxy round trip. MSCCL++ binds its proxy thread to the GPU's NUMA node for
//! the same reason; NCCL sets its threads' affinity from the GPU's PCI locality.
//!
//! The GPU's local CPUs come from Linux sysfs (`/sys/bus/pci/devices/<bus id>/local_cpulist`),
//! intersected with the CPUs the process may use (a container's cpuset), so binding never asks
//! for a CPU the process does not have.

use crate::error::{Error, Result};

/// Parses a Linux CPU list such as `0-3,8,10-11` into sorted CPU numbers.
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>> {
    let bad = |part: &str| Error::InvalidArgument(format!("CPU list '{text}': bad part '{part}'"));
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = match part.split_once('-') {
            Some((lo, hi)) => (lo, hi),
            None => (part, part),
        };
        let lo: usize = lo.trim().parse().map_err(|_| bad(part))?;
        let hi: usize = hi.trim().parse().map_err(|_| bad(part))?;
        if hi < lo || hi >= libc::CPU_SETSIZE as usize {
            return Err(bad(part));
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// The sysfs name of a PCI bus id: CUDA writes `0000:1b:00.0`, NVML `00000000:1B:00.0`; sysfs
/// uses a four-digit domain in lower case.
fn sysfs_bus_id(pci_bus_id: &str) -> String {
    let id = pci_bus_id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => id,
    }
}

/// The CPUs local to the PCI device `pci_bus_id` that this process may run on; `None` when sysfs
/// does not say (not Linux, a virtual device) or when none of them is allowed.
pub fn local_cpus(pci_bus_id: &str) -> Option<Vec<usize>> {
    let path = format!(
        "/sys/bus/pci/devices/{}/local_cpulist",
        sysfs_bus_id(pci_bus_id)
    );
    let local = parse_cpu_list(&std::fs::read_to_string(path).ok()?).ok()?;
    let allowed = allowed_cpus().ok()?;
    let both: Vec<usize> = local.into_iter().filter(|c| allowed.contains(c)).collect();
    (!both.is_empty()).then_some(both)
}

/// The CPUs the calling thread may run on now.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a valid, writable cpu_set_t.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(Error::io(
            "sched_getaffinity",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: CPU_ISSET reads the set within CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Restricts the calling thread to `cpus`.
pub fn bind_current_thread(cpus: &[usize]) -> Result<()> {
    if cpus.is_empty() {
        return Err(Error::InvalidArgument(
            "binding a thread to an empty CPU set".into(),
        ));
    }
    // SAFETY: a zeroed cpu_set_t is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            return Err(Error::InvalidArgument(format!(
                "CPU {c} is beyond the {} a cpu_set_t holds",
                libc::CPU_SETSIZE
            )));
        }
        // SAFETY: `c` is below CPU_SETSIZE (checked above).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid cpu_set_t.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(Error::io(
            format!("sched_setaffinity to CPUs {}", format_cpu_list(cpus)),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Binds the calling thread to the CPUs local to the PCI device `pci_bus_id` and says what it did,
/// for a report line: `CPUs 0-47 (local to 0000:1b:00.0)`, or why the thread stays unbound.
pub fn bind_current_thread_near(pci_bus_id: &str) -> String {
    match local_cpus(pci_bus_id) {
        Some(cpus) => match bind_current_thread(&cpus) {
            Ok(()) => format!("CPUs {} (local to {pci_bus_id})", format_cpu_list(&cpus)),
            Err(e) => format!("unbound ({e})"),
        },
        None => format!("unbound (no allowed CPU is listed as local to {pci_bus_id})"),
    }
}

/// Writes sorted CPU numbers back as a compact list (`0-3,8`), for logs and reports.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_print_back() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n").unwrap(),
            [0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpu_list("5").unwrap(), [5]);
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<usize>::new());
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[]), "");
        for bad in ["3-1", "a", "1-", "0-99999"] {
            let e = parse_cpu_list(bad).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn bus_ids_map_to_sysfs_names() {
        assert_eq!(sysfs_bus_id("0000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(sysfs_bus_id("00000000:1B:00.0"), "0000:1b:00.0");
    }

    #[test]
    fn binding_to_the_allowed_cpus_succeeds_and_an_empty_set_is_refused() {
        let allowed = allowed_cpus().unwrap();
        assert!(!allowed.is_empty());
        std::thread::spawn(move || {
            bind_current_thread(&allowed[..1]).unwrap();
            assert_eq!(allowed_cpus().unwrap(), allowed[..1]);
        })
        .join()
        .unwrap();
        assert!(bind_current_thread(&[]).is_err());
        assert!(local_cpus("not-a-bus-id").is_none());
    }
}
