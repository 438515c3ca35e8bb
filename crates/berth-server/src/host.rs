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

/// Issue 36: bytes free to an unprivileged writer on the file system of `path` (the
/// workspaces'), as `statvfs` says; `None` if it cannot be told.
pub fn disk_free(path: &Path) -> Option<u64> {
    let st = rustix::fs::statvfs(path).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Issue 36: PSI's `some avg10` of the file at `path` (`/proc/pressure/memory`, `cpu`,
/// `io`, or a file in its format), in hundredths of a percent; `None` if it cannot be
/// read (a kernel without PSI): admission then goes without that figure.
///
/// Read on the daemon's own thread once a second, so never more than
/// `PSI_READ_BYTES_MAX` and never waiting: opened non-blocking, a FIFO or a device named
/// there reads as nothing rather than stalling the daemon.
pub fn pressure_bp(path: &Path) -> Option<u32> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let nonblock = rustix::fs::OFlags::NONBLOCK.bits() as i32;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nonblock)
        .open(path)
        .ok()?;
    let mut text = String::new();
    file.take(PSI_READ_BYTES_MAX)
        .read_to_string(&mut text)
        .ok()?;
    parse_pressure(&text)
}

/// PSI's two lines are under 200 bytes; more is not a PSI file.
const PSI_READ_BYTES_MAX: u64 = 4_096;

/// `some avg10=12.34 avg60=… total=…` as 1234 (at most 100.00%).
pub fn parse_pressure(text: &str) -> Option<u32> {
    let some = text.lines().find_map(|l| l.strip_prefix("some "))?;
    let avg10 = some
        .split_whitespace()
        .find_map(|f| f.strip_prefix("avg10="))?;
    let bp = berth_core::validate::parse_hundredths(avg10)?;
    Some(bp.min(berth_core::PRESSURE_BP_MAX))
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

    /// Issue 36: PSI as the kernel writes it; anything else reads as no figure.
    #[test]
    fn memory_pressure_is_read_as_psi_writes_it() {
        let psi = "some avg10=12.34 avg60=1.00 avg300=0.50 total=123\nfull avg10=3.00 avg60=0.00 avg300=0.00 total=9\n";
        assert_eq!(super::parse_pressure(psi), Some(1_234));
        assert_eq!(super::parse_pressure("some avg10=7.5 total=1"), Some(750));
        assert_eq!(
            super::parse_pressure("some avg10=100.00 total=1"),
            Some(10_000)
        );
        assert_eq!(
            super::parse_pressure("some avg10=400.00 total=1"),
            Some(10_000)
        );
        for bad in [
            "",
            "full avg10=1.00",
            "some avg10=x",
            "some avg60=1.00",
            "some avg10=-1.0",
        ] {
            assert_eq!(super::parse_pressure(bad), None, "{bad:?}");
        }
    }

    /// A FIFO named as the source reads as no figure at once (a blocking open would
    /// stall the daemon's thread for good), and a file reads as its figure.
    #[test]
    fn a_pressure_source_that_would_block_reads_as_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let started = std::time::Instant::now();
        assert_eq!(super::pressure_bp(&fifo), None);
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        let file = dir.path().join("memory");
        std::fs::write(&file, "some avg10=3.25 avg60=0.00 avg300=0.00 total=1\n").unwrap();
        assert_eq!(super::pressure_bp(&file), Some(325));
    }
}
