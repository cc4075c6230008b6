//! Network interfaces: listing them (getifaddrs), choosing the bootstrap's address from
//! `MSCCLPP_SOCKET_IFNAME` / `MSCCLPP_SOCKET_FAMILY`, and parsing `ifname:ip:port` strings.

use crate::env::SocketFamily;
use crate::error::{Error, Result};
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};

/// One address of one network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceAddr {
    pub name: String,
    pub ip: IpAddr,
    /// IPv6 scope id (the interface index for link-local addresses), 0 otherwise.
    pub scope_id: u32,
    pub is_up: bool,
    pub is_loopback: bool,
}

/// Every IPv4/IPv6 address of every interface, in the kernel's order.
pub fn list_interfaces() -> Result<Vec<InterfaceAddr>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `head` on success; we free it below.
    let rc = unsafe { libc::getifaddrs(&mut head) };
    if rc != 0 {
        return Err(Error::io(
            "getifaddrs (listing network interfaces)",
            std::io::Error::last_os_error(),
        ));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned and has not been freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose family says its real type.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let (ip, scope_id) = if family == libc::AF_INET {
            // SAFETY: the family is AF_INET, so this is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            (
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
                0,
            )
        } else if family == libc::AF_INET6 {
            // SAFETY: the family is AF_INET6, so this is a sockaddr_in6.
            let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
            (
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                sin6.sin6_scope_id,
            )
        } else {
            continue;
        };
        let flags = ifa.ifa_flags;
        out.push(InterfaceAddr {
            name,
            ip,
            scope_id,
            is_up: flags & (libc::IFF_UP as libc::c_uint) != 0,
            is_loopback: flags & (libc::IFF_LOOPBACK as libc::c_uint) != 0,
        });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

fn family_matches(ip: &IpAddr, family: Option<SocketFamily>) -> bool {
    match family {
        None => true,
        Some(SocketFamily::Inet) => ip.is_ipv4(),
        Some(SocketFamily::Inet6) => ip.is_ipv6(),
    }
}

/// Summary of what exists, for error messages: `lo (127.0.0.1, ::1), eth0 (10.0.0.5)`.
fn describe(all: &[InterfaceAddr]) -> String {
    let mut names: Vec<(String, Vec<String>)> = Vec::new();
    for a in all {
        let ip = a.ip.to_string();
        match names.iter_mut().find(|(n, _)| *n == a.name) {
            Some((_, ips)) => ips.push(ip),
            None => names.push((a.name.clone(), vec![ip])),
        }
    }
    if names.is_empty() {
        return "none".into();
    }
    names
        .iter()
        .map(|(n, ips)| format!("{n} ({})", ips.join(", ")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Does interface `name` match the `MSCCLPP_SOCKET_IFNAME` list `spec`? NCCL's syntax: a comma
/// list of prefixes; `=` before the list means exact names; `^` before it means "all but these".
fn name_matches(spec: &str, name: &str) -> bool {
    let (exclude, rest) = match spec.strip_prefix('^') {
        Some(r) => (true, r),
        None => (false, spec),
    };
    let (exact, list) = match rest.strip_prefix('=') {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let hit = list
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|p| {
            if exact {
                name == p
            } else {
                name.starts_with(p)
            }
        });
    hit != exclude
}

fn to_socket_addr(a: &InterfaceAddr, port: u16) -> SocketAddr {
    match a.ip {
        IpAddr::V4(ip) => SocketAddr::new(IpAddr::V4(ip), port),
        IpAddr::V6(ip) => SocketAddr::V6(std::net::SocketAddrV6::new(ip, port, 0, a.scope_id)),
    }
}

/// Picks this host's bootstrap address (port 0) from the interfaces in `all`.
///
/// With `ifname` the first up interface matching it (see `name_matches`) and `family` wins; an
/// unknown name is an error listing what exists. Without it: the first up non-loopback,
/// non-virtual-bridge interface, IPv4 preferred when no family is set, loopback as last resort
/// (a single host job still works without any network).
pub fn choose_address(
    all: &[InterfaceAddr],
    ifname: Option<&str>,
    family: Option<SocketFamily>,
) -> Result<SocketAddr> {
    let usable = |a: &&InterfaceAddr| {
        a.is_up
            && family_matches(&a.ip, family)
            // A link-local IPv6 without a scope cannot be connected to.
            && !matches!(a.ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80 && a.scope_id == 0)
    };
    if let Some(spec) = ifname {
        let named: Vec<&InterfaceAddr> =
            all.iter().filter(|a| name_matches(spec, &a.name)).collect();
        if named.is_empty() {
            return Err(Error::Bootstrap(format!(
                "network interface {spec:?} (MSCCLPP_SOCKET_IFNAME) not found; interfaces present: {}",
                describe(all)
            )));
        }
        let mut candidates: Vec<&InterfaceAddr> = named.iter().copied().filter(usable).collect();
        if family.is_none() {
            // Stable sort: IPv4 first, kernel order otherwise.
            candidates.sort_by_key(|a| a.ip.is_ipv6());
        }
        return candidates
            .first()
            .map(|a| to_socket_addr(a, 0))
            .ok_or_else(|| {
                Error::Bootstrap(format!(
                    "network interface {spec:?} (MSCCLPP_SOCKET_IFNAME) has no usable {} address \
                     (up, family {}); its addresses: {}",
                    match family {
                        Some(SocketFamily::Inet) => "IPv4",
                        Some(SocketFamily::Inet6) => "IPv6",
                        None => "IP",
                    },
                    family.map_or("any".to_string(), |f| format!("{f:?}")),
                    describe(&named.iter().map(|a| (*a).clone()).collect::<Vec<_>>())
                ))
            });
    }
    let virtual_prefixes = ["docker", "virbr", "veth", "br-"];
    let rank_of = |a: &InterfaceAddr| {
        let virt = virtual_prefixes.iter().any(|p| a.name.starts_with(p));
        (a.is_loopback, virt, family.is_none() && a.ip.is_ipv6())
    };
    let mut candidates: Vec<&InterfaceAddr> = all.iter().filter(usable).collect();
    candidates.sort_by_key(|a| rank_of(a));
    candidates
        .first()
        .map(|a| to_socket_addr(a, 0))
        .ok_or_else(|| {
            Error::Bootstrap(format!(
                "no usable network interface for family {}; interfaces present: {}",
                family.map_or("any".to_string(), |f| format!("{f:?}")),
                describe(all)
            ))
        })
}

/// A parsed bootstrap address string: the root's socket address and, for `ifname:ip:port`, the
/// interface this rank should use for its own listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootSpec {
    pub interface: Option<String>,
    pub addr: SocketAddr,
}

/// Parses `ip:port`, `[v6]:port`, `host:port` (resolved, first address of `family`) and
/// `ifname:` followed by any of those.
pub fn parse_root_spec(s: &str, family: Option<SocketFamily>) -> Result<RootSpec> {
    let s = s.trim();
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "bootstrap address {s:?}: {why} (expected ip:port, [ipv6]:port, host:port or \
             ifname:ip:port)"
        ))
    };
    if let Ok(addr) = s.parse::<SocketAddr>() {
        if addr.port() == 0 {
            return Err(bad("port 0 cannot be agreed on by every rank"));
        }
        return Ok(RootSpec {
            interface: None,
            addr,
        });
    }
    // `ifname:rest` when the text before the first ':' is not itself followed by a port only.
    let (interface, rest) = match s.split_once(':') {
        Some((first, rest)) if rest.contains(':') && !first.starts_with('[') => {
            if first.is_empty() {
                return Err(bad("empty interface name"));
            }
            (Some(first.to_string()), rest)
        }
        _ => (None, s),
    };
    let addr = match rest.parse::<SocketAddr>() {
        Ok(a) => a,
        Err(_) => {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| bad("missing ':port'"))?;
            let port: u16 = port
                .parse()
                .map_err(|_| bad(&format!("port {port:?} is not a number in 1..=65535")))?;
            if host.is_empty() {
                return Err(bad("empty host"));
            }
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let resolved: Vec<SocketAddr> = (host, port)
                .to_socket_addrs()
                .map_err(|e| bad(&format!("cannot resolve host {host:?}: {e}")))?
                .collect();
            let mut matching: Vec<SocketAddr> = resolved
                .iter()
                .copied()
                .filter(|a| family_matches(&a.ip(), family))
                .collect();
            matching.sort_by_key(|a| a.is_ipv6());
            *matching.first().ok_or_else(|| {
                bad(&format!(
                    "host {host:?} has no address of family {family:?} (resolved: {resolved:?})"
                ))
            })?
        }
    };
    if addr.port() == 0 {
        return Err(bad("port 0 cannot be agreed on by every rank"));
    }
    Ok(RootSpec { interface, addr })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn ifa(name: &str, ip: &str, lo: bool) -> InterfaceAddr {
        InterfaceAddr {
            name: name.into(),
            ip: ip.parse().unwrap(),
            scope_id: 0,
            is_up: true,
            is_loopback: lo,
        }
    }

    fn host() -> Vec<InterfaceAddr> {
        vec![
            ifa("lo", "127.0.0.1", true),
            ifa("lo", "::1", true),
            ifa("docker0", "172.17.0.1", false),
            ifa("eth0", "2001:db8::5", false),
            ifa("eth0", "10.0.0.5", false),
        ]
    }

    #[rstest]
    #[case(None, None, "10.0.0.5:0")]
    #[case(None, Some(SocketFamily::Inet6), "[2001:db8::5]:0")]
    #[case(Some("lo"), None, "127.0.0.1:0")]
    #[case(Some("lo"), Some(SocketFamily::Inet6), "[::1]:0")]
    #[case(Some("=docker0"), None, "172.17.0.1:0")]
    #[case(Some("^eth,docker"), None, "127.0.0.1:0")]
    fn chooses(
        #[case] ifname: Option<&str>,
        #[case] family: Option<SocketFamily>,
        #[case] want: &str,
    ) {
        let got = choose_address(&host(), ifname, family).unwrap();
        assert_eq!(got, want.parse::<SocketAddr>().unwrap());
    }

    #[test]
    fn unknown_interface_lists_existing() {
        let e = choose_address(&host(), Some("ib9"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"ib9\""), "{e}");
        assert!(e.contains("eth0 (2001:db8::5, 10.0.0.5)"), "{e}");
    }

    #[rstest]
    #[case("127.0.0.1:5000", None, "127.0.0.1:5000")]
    #[case("[::1]:5000", None, "[::1]:5000")]
    #[case("eth0:10.0.0.5:5000", Some("eth0"), "10.0.0.5:5000")]
    #[case("lo:[::1]:7", Some("lo"), "[::1]:7")]
    #[case("localhost:5000", None, "127.0.0.1:5000")]
    fn parses(#[case] s: &str, #[case] iface: Option<&str>, #[case] addr: &str) {
        let spec =
            parse_root_spec(s, Some(SocketFamily::Inet).filter(|_| !s.contains('['))).unwrap();
        assert_eq!(spec.interface.as_deref(), iface);
        assert_eq!(spec.addr, addr.parse::<SocketAddr>().unwrap());
    }

    #[rstest]
    #[case("127.0.0.1")]
    #[case("127.0.0.1:0")]
    #[case("127.0.0.1:99999")]
    #[case(":1:2")]
    fn rejects(#[case] s: &str) {
        assert!(parse_root_spec(s, None).is_err(), "{s}");
    }
}
