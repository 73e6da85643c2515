//! How much memory this process may still fill: the system's `MemAvailable`, and what its
//! memory cgroups leave it under their limits — cgroup v2 (`memory.max`) and v1
//! (`memory.limit_in_bytes`, still the memory controller of many container hosts), each
//! limit of the process's cgroup and of every ancestor up to the hierarchy's mount, the
//! least of them. A container's limit is often far below `MemAvailable`, which sees the host.
//!
//! A cgroup's usage counts its page cache, and the kernel reclaims the inactive file pages
//! first, before any limit is hit; they are counted as free (usage less `inactive_file`, the
//! "working set" container runtimes report).

use std::path::{Path, PathBuf};

/// Bytes of memory this process may still fill: `MemAvailable`, less where a memory cgroup's
/// limit leaves less. `None` where `/proc/meminfo` cannot be read (off Linux).
pub(crate) fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = (meminfo.lines())
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let left = cgroup_memory_left(&cgroups, &mounts).unwrap_or(u64::MAX);
    Some(kib.saturating_mul(1024).min(left))
}

/// The two kinds of memory cgroup, and the files each keeps its limit and usage in.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Version {
    V1,
    V2,
}

impl Version {
    /// The limit's and the usage's file names.
    fn files(self) -> (&'static str, &'static str) {
        match self {
            Version::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
            Version::V2 => ("memory.max", "memory.current"),
        }
    }
}

/// The least that the memory cgroups of a process leave it (`cgroups`: its
/// `/proc/self/cgroup`; `mounts`: its `/proc/self/mountinfo`), over its cgroup and every
/// ancestor, v1 and v2 alike. `None` where no limit is set or none can be read.
fn cgroup_memory_left(cgroups: &str, mounts: &str) -> Option<u64> {
    let mut least: Option<u64> = None;
    for line in cgroups.lines() {
        // `hierarchy:controllers:path`; the path may hold colons.
        let mut parts = line.splitn(3, ':');
        let (Some(hierarchy), Some(controllers), Some(path)) =
            (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let version = match (hierarchy, controllers) {
            ("0", "") => Version::V2,
            (_, c) if c.split(',').any(|c| c == "memory") => Version::V1,
            _ => continue,
        };
        let Some((root, mount)) = mount_of(mounts, version) else {
            continue;
        };
        // The cgroup's directory: its path below the mount's root, under the mount point.
        let Ok(below) = Path::new(path).strip_prefix(&root) else {
            continue;
        };
        let mut dir = mount.join(below);
        loop {
            if let Some(left) = left_in(&dir, version) {
                least = Some(least.map_or(left, |l| l.min(left)));
            }
            if dir == mount || !dir.pop() {
                break;
            }
        }
    }
    least
}

/// The root (the cgroup it shows) and mount point of the cgroup hierarchy of `version` that
/// holds the memory controller, from a `/proc/self/mountinfo`.
fn mount_of(mounts: &str, version: Version) -> Option<(PathBuf, PathBuf)> {
    mounts.lines().find_map(|line| {
        // `id parent major:minor root mountpoint options… - fstype source superoptions`
        let (before, after) = line.split_once(" - ")?;
        let mut fields = before.split(' ');
        let (root, mount) = (fields.nth(3)?, fields.next()?);
        let mut after = after.split(' ');
        let (fstype, superoptions) = (after.next()?, after.nth(1).unwrap_or(""));
        let ours = match version {
            Version::V2 => fstype == "cgroup2",
            Version::V1 => fstype == "cgroup" && superoptions.split(',').any(|o| o == "memory"),
        };
        ours.then(|| {
            (
                PathBuf::from(unescape(root)),
                PathBuf::from(unescape(mount)),
            )
        })
    })
}

/// A mountinfo path with its octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let mut rest = field;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let code = rest
            .get(at + 1..at + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(byte as char);
                rest = &rest[at + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[at + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// What one cgroup directory leaves under its limit: the limit less the usage, the usage
/// without its inactive file pages. `None` where it sets no limit (`max`, or v1's "unlimited",
/// a number near `i64::MAX`) or its files cannot be read.
fn left_in(dir: &Path, version: Version) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let number = |name: &str| read(name)?.trim().parse::<u64>().ok();
    let (limit, usage) = version.files();
    let limit = number(limit).filter(|&l| l < 1 << 62)?;
    let usage = number(usage)?;
    let stat = read("memory.stat").unwrap_or_default();
    // v1's `total_inactive_file` counts the cgroup's descendants as its usage does.
    let key = match version {
        Version::V1 => "total_inactive_file",
        Version::V2 => "inactive_file",
    };
    let inactive = (stat.lines())
        .find_map(|l| {
            l.strip_prefix(key)?
                .strip_prefix(' ')?
                .trim()
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(inactive)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test's cgroup tree.
    fn test_dir(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("embers-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Writes a cgroup directory's files under `dir`.
    fn cgroup(dir: &Path, files: &[(&str, &str)]) {
        std::fs::create_dir_all(dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
    }

    #[test]
    fn a_v1_memory_cgroup_leaves_the_least_of_its_own_and_its_ancestors_limits() {
        let tmp = test_dir("cgroup-v1");
        let mount = tmp.join("memory");
        // The root: no limit. The parent: 4000 under a limit of 10000 (1000 of it inactive
        // file pages, counted free). The process's cgroup: 1000 left under 3000.
        cgroup(
            &mount,
            &[
                ("memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory.usage_in_bytes", "7\n"),
            ],
        );
        cgroup(
            &mount.join("jobs"),
            &[
                ("memory.limit_in_bytes", "10000\n"),
                ("memory.usage_in_bytes", "7000\n"),
                (
                    "memory.stat",
                    "cache 5000\ninactive_file 9\ntotal_inactive_file 1000\n",
                ),
            ],
        );
        let own = mount.join("jobs/train 1");
        cgroup(
            &own,
            &[
                ("memory.limit_in_bytes", "3000\n"),
                ("memory.usage_in_bytes", "2000\n"),
            ],
        );
        let mounts = format!(
            "25 1 0:22 / /sys rw - sysfs sysfs rw\n\
             35 31 0:32 / {} rw,relatime - cgroup cgroup rw,memory\n",
            mount.display()
        );
        // /proc/self/cgroup writes a path's space plainly (mountinfo writes it `\040`).
        let cgroups = "4:memory:/jobs/train 1\n0::/\n";
        assert_eq!(cgroup_memory_left(cgroups, &mounts), Some(1000));
        // The parent's limit binds once the process's own is lifted.
        cgroup(&own, &[("memory.limit_in_bytes", "9223372036854771712\n")]);
        assert_eq!(cgroup_memory_left(cgroups, &mounts), Some(4000));
        // No limit anywhere: none.
        cgroup(
            &mount.join("jobs"),
            &[("memory.limit_in_bytes", "9223372036854771712\n")],
        );
        assert_eq!(cgroup_memory_left(cgroups, &mounts), None);
        std::fs::remove_dir_all(tmp).unwrap();
    }

    #[test]
    fn a_v2_cgroup_below_a_namespaced_mount_reads_max_and_current() {
        let tmp = test_dir("cgroup-v2");
        let mount = tmp.join("unified fs");
        let own = mount.join("pod/app");
        cgroup(
            &mount,
            &[("memory.max", "max\n"), ("memory.current", "1\n")],
        );
        cgroup(
            &mount.join("pod"),
            &[("memory.max", "max\n"), ("memory.current", "50\n")],
        );
        cgroup(
            &own,
            &[
                ("memory.max", "8192\n"),
                ("memory.current", "6000\n"),
                ("memory.stat", "anon 4000\nfile 2000\ninactive_file 1500\n"),
            ],
        );
        // The mount shows the cgroup `/kube` as its root; the process's path is below it.
        let mounts = format!(
            "40 31 0:33 /kube {} rw,nosuid - cgroup2 cgroup2 rw\n",
            mount.display().to_string().replace(' ', "\\040")
        );
        assert_eq!(
            cgroup_memory_left("0::/kube/pod/app\n", &mounts),
            Some(8192 - 4500)
        );
        // A path outside the mount's root, or no cgroup2 mount: nothing read.
        assert_eq!(cgroup_memory_left("0::/elsewhere/app\n", &mounts), None);
        assert_eq!(cgroup_memory_left("0::/kube/pod/app\n", ""), None);
        std::fs::remove_dir_all(tmp).unwrap();
    }

    #[test]
    fn this_process_gets_a_figure_no_larger_than_mem_available() {
        let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") else {
            return; // not Linux
        };
        let kib: u64 = (meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:")))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("MemAvailable in /proc/meminfo");
        let available = available_memory().expect("a figure on Linux");
        // MemAvailable moves between the two reads; allow it 1 GiB.
        assert!(
            available <= kib * 1024 + (1 << 30),
            "{available} vs {kib} kB"
        );
        assert!(available > 0);
    }
}
