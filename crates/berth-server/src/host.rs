//! What the host reports: cpus, memory, disk, and MemAvailable samples (A10).

use std::path::Path;

fn meminfo_field(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
}

pub fn memory_total() -> u64 {
    meminfo_field("MemTotal").unwrap_or(8 << 30)
}

pub fn memory_available() -> Option<u64> {
    meminfo_field("MemAvailable")
}

pub fn cpus() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

pub fn disk_total(path: &Path) -> u64 {
    rustix::fs::statvfs(path)
        .map(|s| s.f_blocks * s.f_frsize)
        .unwrap_or(0)
}

/// The kernel's ephemeral port range (`net.ipv4.ip_local_port_range`), if readable.
pub fn ephemeral_ports() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|p| p.parse::<u16>().ok());
    Some((it.next()??, it.next()??))
}

/// The primary group of `uid` in the password database (through NSS); `None` when
/// there is no such user. The one lookup of a user berth makes: whether a token may
/// be made for a uid, and the group a user's workspace is given.
pub fn passwd_gid(uid: u32) -> Option<u32> {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: a zeroed passwd is a valid out-parameter; `buf` outlives the call and its
    // length is passed; `found` is only compared with null, never dereferenced.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    (rc == 0 && !found.is_null()).then_some(pwd.pw_gid)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_reports_plausible_figures() {
        assert!(super::memory_total() > 64 << 20);
        let avail = super::memory_available().unwrap();
        assert!(avail > 0 && avail <= super::memory_total());
        assert!(super::cpus() >= 1);
        assert!(super::disk_total(std::path::Path::new("/")) > 0);
    }
}
