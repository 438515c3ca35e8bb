//! Who listens (C6): the TCP sockets in `LISTEN` state from `/proc/net/tcp` and
//! `/proc/net/tcp6` (one read each for the whole host), and the sockets a process
//! holds from `/proc/<pid>/fd`. The parsers are pure and tested on the kernel's text.

use std::collections::BTreeMap;

/// `st` of a listening socket in `/proc/net/tcp{,6}` (include/net/tcp_states.h).
const TCP_LISTEN: &str = "0A";
/// Lines read from one `/proc/net/tcp{,6}`: a host with more sockets than this is
/// read in part (the limit keeps a scan bounded; listeners are a small share).
pub const SOCKET_LINES_MAX: usize = 1 << 20;
/// Descriptors looked at per process.
pub const FDS_PER_PROCESS_MAX: usize = 1 << 16;

/// Listening sockets by inode, with their local port.
pub fn listening() -> std::io::Result<BTreeMap<u64, u16>> {
    let mut all = BTreeMap::new();
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match std::fs::read_to_string(file) {
            Ok(text) => parse_listening(&text, &mut all),
            // A kernel without IPv6 has no tcp6.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && file.ends_with('6') => {}
            Err(e) => return Err(e),
        }
    }
    Ok(all)
}

/// The `LISTEN` lines of one `/proc/net/tcp{,6}` text: `sl local rem st … inode`.
pub fn parse_listening(text: &str, into: &mut BTreeMap<u64, u16>) {
    into.extend(sockets_in(text, TCP_LISTEN));
}

/// (inode, local port) of each socket line of a `/proc/net/{tcp,udp}{,6}` text in
/// state `st` (`sl local rem st … inode`); inode 0 (a socket being torn down) left out.
fn sockets_in<'a>(text: &'a str, st: &'a str) -> impl Iterator<Item = (u64, u16)> + 'a {
    text.lines()
        .skip(1)
        .take(SOCKET_LINES_MAX)
        .filter_map(move |line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[3] != st {
                return None;
            }
            let port = f[1]
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())?;
            let inode = f[9].parse::<u64>().ok().filter(|&i| i != 0)?;
            Some((inode, port))
        })
}

/// `st` of an unconnected UDP socket in `/proc/net/udp{,6}` (TCP_CLOSE): bound and
/// receiving from anyone, UDP's way of listening.
const UDP_UNCONNECTED: &str = "07";

/// The ports the kernel hands out for an unbound send (`ip_local_port_range`): a
/// client's UDP socket (a resolver's `sendto` without `connect`) sits unconnected on
/// one of these, so only ports outside it count as a UDP listener.
pub fn ephemeral_ports() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().filter_map(|x| x.parse::<u16>().ok());
            Some((it.next()?, it.next()?))
        })
        .unwrap_or((32_768, 60_999))
}

/// What an analysis run may not hold (C6): TCP sockets in `LISTEN`, and UDP sockets
/// bound, unconnected, on a port outside the ephemeral range (issue 32 concern: UDP
/// was not policed). By inode, with the local port.
pub fn listening_any() -> std::io::Result<BTreeMap<u64, u16>> {
    let mut all = listening()?;
    let ephemeral = ephemeral_ports();
    for file in ["/proc/net/udp", "/proc/net/udp6"] {
        match std::fs::read_to_string(file) {
            Ok(text) => parse_udp_bound(&text, ephemeral, &mut all),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(all)
}

/// The bound, unconnected lines of one `/proc/net/udp{,6}` text on a port outside
/// `ephemeral` (`sl local rem st … inode`, as for TCP).
pub fn parse_udp_bound(text: &str, ephemeral: (u16, u16), into: &mut BTreeMap<u64, u16>) {
    let outside =
        |&(_, port): &(u64, u16)| port != 0 && !(ephemeral.0..=ephemeral.1).contains(&port);
    into.extend(sockets_in(text, UDP_UNCONNECTED).filter(outside));
}

/// The socket inodes `pid` holds open. A process that is gone holds none.
pub fn sockets_of(pid: i32) -> std::io::Result<Vec<u64>> {
    let dir = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in dir.take(FDS_PER_PROCESS_MAX) {
        let Ok(entry) = entry else { continue };
        if let Ok(target) = std::fs::read_link(entry.path()) {
            if let Some(inode) = socket_inode(&target.to_string_lossy()) {
                out.push(inode);
            }
        }
    }
    Ok(out)
}

/// `socket:[12345]` is socket inode 12345.
pub fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// A process's command line as people read it (NULs as spaces), at most 256 bytes.
pub fn cmdline(pid: i32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let text: String = String::from_utf8_lossy(&raw)
        .replace('\0', " ")
        .trim()
        .chars()
        .take(256)
        .collect();
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_sockets_and_socket_links_are_read_from_the_kernels_text() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:A2C4 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0000000000000000 20 4 30 10 -1
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1 0000000000000000 100 0 0 10 0
";
        let tcp6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:C350 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5151 1 0000000000000000 100 0 0 10 0
";
        let mut all = BTreeMap::new();
        parse_listening(tcp, &mut all);
        parse_listening(tcp6, &mut all);
        // 8080 and 22 listen; the established connection (st 01) does not count.
        assert_eq!(all, BTreeMap::from([(17, 22), (4242, 8080), (5151, 50000)]));
        assert_eq!(socket_inode("socket:[4242]"), Some(4242));
        assert_eq!(socket_inode("pipe:[4242]"), None);
        assert_eq!(socket_inode("/dev/null"), None);
    }

    /// A real listener of this process is found by both halves.
    #[test]
    fn a_real_listener_is_seen() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let all = listening().unwrap();
        let mine = sockets_of(std::process::id() as i32).unwrap();
        assert!(
            mine.iter().any(|i| all.get(i) == Some(&port)),
            "port {port} not among {all:?} for my sockets {mine:?}"
        );
    }

    /// Issue 32 concern: UDP was not policed. A bound, unconnected UDP socket on a
    /// port outside the ephemeral range counts; a connected one, or one on an
    /// ephemeral port (a client's), does not.
    #[test]
    fn udp_sockets_bound_outside_the_ephemeral_range_count_as_listening() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops
  1: 0100007F:1F90 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 111 2 0 0
  2: 0100007F:9C40 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 222 2 0 0
  3: 0100007F:1F91 0100007F:0035 01 00000000:00000000 00:00000000 00000000     0        0 333 2 0 0
";
        let mut got = BTreeMap::new();
        parse_udp_bound(text, (32_768, 60_999), &mut got);
        assert_eq!(got, BTreeMap::from([(111, 8080)]));
    }
}
