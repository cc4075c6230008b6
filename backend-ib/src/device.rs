//! One opened HCA port: device context, protection domain, port and GID, and memory registration.
//!
//! # Device selection
//! `MSCCLPP_HCA_DEVICES` lists HCAs as `name` or `name:port` (NCCL's spelling); `TransportKind::Ib(i)`
//! uses entry `i`. Without the variable, entry `i` is the `i`-th device libibverbs reports. Without a
//! port, the first ACTIVE port is used.
//!
//! # GID
//! `MSCCLPP_IB_GID_INDEX` wins. Otherwise InfiniBand ports use index 0 (routing is by LID), and RoCE
//! ports the first RoCE v2 entry with an IPv4-mapped address, else the first RoCE v2 entry, else 0,
//! read from sysfs `gid_attrs/types` (RoCE v1 does not cross IP subnets, and IPv4-mapped entries are
//! what the switches route in common fabrics).

use crate::ffi::*;
use crate::library::{DeviceList, Verbs};
use mscclpp_core::env::{Env, IbvMode};
use mscclpp_core::transport::MemoryRegion;
use mscclpp_core::{Error, Result};
use mscclpp_noib::{IbUnavailableReason, SYSFS_INFINIBAND};
use std::ffi::c_void;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// One entry of `MSCCLPP_HCA_DEVICES`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HcaSpec {
    pub name: String,
    /// 1-based port; `None` = first active port.
    pub port: Option<u8>,
}

impl HcaSpec {
    /// Parses `name` or `name:port`. Errors name `MSCCLPP_HCA_DEVICES` and the entry.
    pub fn parse(entry: &str) -> Result<HcaSpec> {
        let bad = |reason: String| Error::Env {
            var: "MSCCLPP_HCA_DEVICES",
            value: entry.to_string(),
            reason,
        };
        let (name, port) = match entry.split_once(':') {
            None => (entry, None),
            Some((name, port)) => {
                let p: u8 = port.parse().map_err(|_| {
                    bad(format!(
                        "port {port:?} of {name:?} is not a number from 1 to 255"
                    ))
                })?;
                if p == 0 {
                    return Err(bad(format!(
                        "port 0 of {name:?}: ports are numbered from 1"
                    )));
                }
                (name, Some(p))
            }
        };
        if name.is_empty() {
            return Err(bad("an entry has an empty device name".into()));
        }
        Ok(HcaSpec {
            name: name.to_string(),
            port,
        })
    }
}

/// The HCA entry `index` refers to: the `index`-th of `MSCCLPP_HCA_DEVICES`, else of `found`.
pub fn select_hca(requested: &[String], found: &[String], index: u8) -> Result<HcaSpec> {
    let i = usize::from(index);
    if requested.is_empty() {
        return match found.get(i) {
            Some(name) => Ok(HcaSpec {
                name: name.clone(),
                port: None,
            }),
            None => Err(IbUnavailableReason::NoDevice {
                requested: vec![],
                found: found.to_vec(),
            }
            .into()),
        };
    }
    let Some(entry) = requested.get(i) else {
        return Err(Error::InvalidArgument(format!(
            "IB{index} asked for, but MSCCLPP_HCA_DEVICES={} lists only {} device(s)",
            requested.join(","),
            requested.len()
        )));
    };
    let spec = HcaSpec::parse(entry)?;
    if !found.contains(&spec.name) {
        return Err(IbUnavailableReason::NoDevice {
            requested: requested.to_vec(),
            found: found.to_vec(),
        }
        .into());
    }
    Ok(spec)
}

/// Chooses the GID index on a RoCE port from sysfs (see the module docs); `None` when sysfs has no
/// RoCE v2 entry (the caller then uses 0).
pub fn auto_roce_gid_index(sysfs: &Path, device: &str, port: u8, table_len: u32) -> Option<u32> {
    let port_dir = sysfs.join(device).join("ports").join(port.to_string());
    let mut first_v2 = None;
    for i in 0..table_len {
        let ty = std::fs::read_to_string(port_dir.join("gid_attrs/types").join(i.to_string()));
        let Ok(ty) = ty else { continue };
        if !ty.trim().eq_ignore_ascii_case("RoCE v2") {
            continue;
        }
        let gid =
            std::fs::read_to_string(port_dir.join("gids").join(i.to_string())).unwrap_or_default();
        let gid = gid.trim();
        if gid.is_empty() || gid.chars().all(|c| c == '0' || c == ':') {
            continue;
        }
        if gid.starts_with("0000:0000:0000:0000:0000:ffff:") {
            return Some(i);
        }
        first_v2.get_or_insert(i);
    }
    first_v2
}

/// Port facts the transport needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    pub lid: u16,
    pub link_layer: u8,
    /// `enum ibv_mtu` value.
    pub active_mtu: u32,
    pub max_msg_sz: u32,
    pub gid_tbl_len: u32,
}

impl PortInfo {
    pub fn is_ethernet(&self) -> bool {
        self.link_layer == IBV_LINK_LAYER_ETHERNET
    }
}

/// The resources of one opened device, shared by its transports and memory registrations, which
/// keep it alive (an MR or QP must be destroyed before its PD and context).
pub(crate) struct DeviceInner {
    pub(crate) verbs: Arc<Verbs>,
    pub(crate) ctx: *mut IbvContext,
    pub(crate) pd: *mut IbvPd,
    pub(crate) name: String,
    pub(crate) index: u8,
    pub(crate) port: PortInfo,
    pub(crate) gid: IbvGid,
    pub(crate) gid_index: u32,
    pub(crate) attr: IbvDeviceAttr,
    pub(crate) mode: IbvMode,
}

// SAFETY: libibverbs objects may be used from any thread (rdma-core serialises per object
// internally); the raw pointers are only freed in Drop, when no other reference exists.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; shared use only calls thread-safe verbs.
unsafe impl Sync for DeviceInner {}

impl DeviceInner {
    /// `device mlx5_0 port 1`, for error messages.
    pub(crate) fn describe(&self) -> String {
        format!("device {} port {}", self.name, self.port.port)
    }

    /// An [`Error::Driver`] for a failed verb, with errno text, device and port.
    pub(crate) fn verbs_error(&self, call: &'static str, code: i32, doing: &str) -> Error {
        verbs_error(call, code, &format!("{doing} on {}", self.describe()))
    }
}

/// An [`Error::Driver`] for verb `call` that failed with errno `code`.
pub(crate) fn verbs_error(call: &'static str, code: i32, context: &str) -> Error {
    Error::Driver {
        call,
        code: i64::from(code),
        message: format!("{context}: {}", std::io::Error::from_raw_os_error(code)),
    }
}

/// errno after a verb returned NULL (0 if the library left it unset).
pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // SAFETY: the PD and context were created by this library and every MR/QP/CQ holding an
        // Arc to us is gone, so nothing uses them any more.
        unsafe {
            let rc = (self.verbs.dealloc_pd)(self.pd);
            if rc != 0 {
                tracing::warn!(target: mscclpp_core::log::target::NET, "ibv_dealloc_pd on {}: errno {rc}", self.describe());
            }
            let rc = (self.verbs.close_device)(self.ctx);
            if rc != 0 {
                tracing::warn!(target: mscclpp_core::log::target::NET, "ibv_close_device on {}: errno {rc}", self.describe());
            }
        }
    }
}

/// An opened HCA port ready to register memory and create [`crate::IbTransport`]s. Cheap to clone.
#[derive(Clone)]
pub struct IbContext {
    pub(crate) inner: Arc<DeviceInner>,
}

impl fmt::Debug for IbContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbContext")
            .field("device", &self.inner.name)
            .field("index", &self.inner.index)
            .field("port", &self.inner.port)
            .field("gid_index", &self.inner.gid_index)
            .field("atomics", &self.supports_atomics())
            .field("library", &self.inner.verbs.path())
            .finish()
    }
}

impl IbContext {
    /// Opens HCA entry `index` (see the module docs) with an already loaded library.
    pub fn open(verbs: Arc<Verbs>, env: &Env, index: u8) -> Result<IbContext> {
        let list = DeviceList::get(&verbs)?;
        let devices: Vec<(String, *mut IbvDevice)> = list.iter().collect();
        let found: Vec<String> = devices.iter().map(|(n, _)| n.clone()).collect();
        let spec = select_hca(&env.hca_devices, &found, index)?;
        let dev = devices
            .iter()
            .find(|(n, _)| *n == spec.name)
            .map(|(_, d)| *d)
            .ok_or_else(|| {
                Error::Internal(format!("device {} vanished from the list", spec.name))
            })?;
        // SAFETY: `dev` belongs to `list`, which is still alive.
        let ctx = unsafe { (verbs.open_device)(dev) };
        drop(list);
        if ctx.is_null() {
            return Err(verbs_error(
                "ibv_open_device",
                last_errno(),
                &format!(
                    "opening device {} (permissions on /dev/infiniband?)",
                    spec.name
                ),
            ));
        }
        // From here on, a failure must close `ctx`; `Opened` does that.
        let mut opened = Opened {
            verbs: &verbs,
            ctx,
            pd: std::ptr::null_mut(),
        };
        let mut attr = IbvDeviceAttr::default();
        // SAFETY: live context, valid out-struct.
        let rc = unsafe { (verbs.query_device)(ctx, &mut attr) };
        if rc != 0 {
            return Err(verbs_error(
                "ibv_query_device",
                rc,
                &format!("device {}", spec.name),
            ));
        }
        let port = choose_port(&verbs, ctx, &spec, attr.phys_port_cnt)?;
        let gid_index = match env.ib_gid_index {
            Some(i) => i,
            None if port.is_ethernet() => auto_roce_gid_index(
                Path::new(SYSFS_INFINIBAND),
                &spec.name,
                port.port,
                port.gid_tbl_len,
            )
            .unwrap_or(0),
            None => 0,
        };
        if port.gid_tbl_len > 0 && gid_index >= port.gid_tbl_len {
            return Err(Error::Env {
                var: "MSCCLPP_IB_GID_INDEX",
                value: gid_index.to_string(),
                reason: format!(
                    "device {} port {} has only {} GID entries",
                    spec.name, port.port, port.gid_tbl_len
                ),
            });
        }
        let mut gid = IbvGid::default();
        let gid_arg = i32::try_from(gid_index).unwrap_or(i32::MAX);
        // SAFETY: live context, valid out-union.
        let rc = unsafe { (verbs.query_gid)(ctx, port.port, gid_arg, &mut gid) };
        if rc != 0 {
            return Err(verbs_error(
                "ibv_query_gid",
                last_errno().max(rc),
                &format!(
                    "GID index {gid_index} of device {} port {}",
                    spec.name, port.port
                ),
            ));
        }
        if port.is_ethernet() && gid.raw == [0; 16] {
            return Err(Error::InvalidArgument(format!(
                "GID index {gid_index} of RoCE device {} port {} is empty; set MSCCLPP_IB_GID_INDEX to a populated entry (see show_gids)",
                spec.name, port.port
            )));
        }
        // SAFETY: live context.
        let pd = unsafe { (verbs.alloc_pd)(ctx) };
        if pd.is_null() {
            return Err(verbs_error(
                "ibv_alloc_pd",
                last_errno(),
                &format!("device {}", spec.name),
            ));
        }
        opened.pd = pd;
        let ctx_ptr = opened.disarm();
        let inner = DeviceInner {
            verbs: verbs.clone(),
            ctx: ctx_ptr,
            pd,
            name: spec.name,
            index,
            port,
            gid,
            gid_index,
            attr,
            mode: env.ibv_mode,
        };
        tracing::info!(target: mscclpp_core::log::target::NET,
            "opened IB{index}: {} (lid {}, {} link, GID index {gid_index}, atomics {})",
            inner.describe(), port.lid,
            if port.is_ethernet() { "RoCE" } else { "InfiniBand" },
            inner.attr.atomic_cap != IBV_ATOMIC_NONE);
        Ok(IbContext {
            inner: Arc::new(inner),
        })
    }

    pub fn device_name(&self) -> &str {
        &self.inner.name
    }

    /// The `i` of `TransportKind::Ib(i)`.
    pub fn index(&self) -> u8 {
        self.inner.index
    }

    pub fn port(&self) -> PortInfo {
        self.inner.port
    }

    pub fn gid(&self) -> [u8; 16] {
        self.inner.gid.raw
    }

    pub fn gid_index(&self) -> u32 {
        self.inner.gid_index
    }

    /// Whether the HCA performs RDMA atomics (`atomic_cap != IBV_ATOMIC_NONE`).
    pub fn supports_atomics(&self) -> bool {
        self.inner.attr.atomic_cap != IBV_ATOMIC_NONE
    }

    /// The signalling mode from `MSCCLPP_IBV_MODE`.
    pub fn mode(&self) -> IbvMode {
        self.inner.mode
    }

    /// Registers `size` bytes at `ptr` for local and remote read, write and atomics. Device memory
    /// works where the kernel has GPUDirect RDMA (nvidia-peermem / amdgpu peer memory).
    ///
    /// # Safety
    /// `ptr..ptr+size` must stay allocated until the returned [`IbMemory`] is dropped; peers may
    /// write into it at any time while it is registered and advertised.
    pub unsafe fn register(&self, ptr: *mut u8, size: usize) -> Result<IbMemory> {
        if ptr.is_null() || size == 0 {
            return Err(Error::InvalidArgument(format!(
                "cannot register {size} bytes at {ptr:p} with {}",
                self.inner.describe()
            )));
        }
        let access = IBV_ACCESS_LOCAL_WRITE
            | IBV_ACCESS_REMOTE_WRITE
            | IBV_ACCESS_REMOTE_READ
            | IBV_ACCESS_REMOTE_ATOMIC;
        // SAFETY: live PD; the caller guarantees the range stays valid.
        let mr = unsafe {
            self.inner
                .verbs
                .reg_mr(self.inner.pd, ptr.cast::<c_void>(), size, access)
        };
        if mr.is_null() {
            return Err(self.inner.verbs_error(
                "ibv_reg_mr",
                last_errno(),
                &format!("registering {size} bytes at {ptr:p} (GPU memory needs nvidia-peermem; locked-memory limit: ulimit -l)"),
            ));
        }
        // SAFETY: a non-null MR returned by ibv_reg_mr.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(IbMemory {
            device: self.inner.clone(),
            mr,
            addr: ptr as u64,
            size: size as u64,
            lkey,
            rkey,
        })
    }
}

/// Closes a half-opened device on an early return.
struct Opened<'a> {
    verbs: &'a Verbs,
    ctx: *mut IbvContext,
    pd: *mut IbvPd,
}

impl Opened<'_> {
    fn disarm(self) -> *mut IbvContext {
        let ctx = self.ctx;
        std::mem::forget(self);
        ctx
    }
}

impl Drop for Opened<'_> {
    fn drop(&mut self) {
        // SAFETY: both were created by this library and nothing else refers to them yet.
        unsafe {
            if !self.pd.is_null() {
                (self.verbs.dealloc_pd)(self.pd);
            }
            (self.verbs.close_device)(self.ctx);
        }
    }
}

fn query_port(verbs: &Verbs, ctx: *mut IbvContext, name: &str, port: u8) -> Result<IbvPortAttr> {
    let mut attr = IbvPortAttr::default();
    // SAFETY: live context; `attr` is at least as large as what the symbol writes (ffi.rs).
    let rc = unsafe { (verbs.query_port)(ctx, port, &mut attr) };
    if rc != 0 {
        return Err(verbs_error(
            "ibv_query_port",
            rc,
            &format!("device {name} port {port}"),
        ));
    }
    Ok(attr)
}

fn choose_port(verbs: &Verbs, ctx: *mut IbvContext, spec: &HcaSpec, ports: u8) -> Result<PortInfo> {
    let info = |port: u8, a: &IbvPortAttr| PortInfo {
        port,
        lid: a.lid,
        link_layer: a.link_layer,
        active_mtu: a.active_mtu,
        max_msg_sz: a.max_msg_sz,
        gid_tbl_len: u32::try_from(a.gid_tbl_len).unwrap_or(0),
    };
    if let Some(p) = spec.port {
        if p > ports {
            return Err(Error::Env {
                var: "MSCCLPP_HCA_DEVICES",
                value: format!("{}:{p}", spec.name),
                reason: format!("device {} has {ports} port(s)", spec.name),
            });
        }
        let a = query_port(verbs, ctx, &spec.name, p)?;
        if a.state != IBV_PORT_ACTIVE {
            return Err(Error::IbUnavailable(format!(
                "device {} port {p} is not active (state {}; 4 = ACTIVE)",
                spec.name, a.state
            )));
        }
        return Ok(info(p, &a));
    }
    let mut states = Vec::new();
    for p in 1..=ports {
        let a = query_port(verbs, ctx, &spec.name, p)?;
        if a.state == IBV_PORT_ACTIVE
            && matches!(
                a.link_layer,
                IBV_LINK_LAYER_INFINIBAND | IBV_LINK_LAYER_ETHERNET | IBV_LINK_LAYER_UNSPECIFIED
            )
        {
            return Ok(info(p, &a));
        }
        states.push(format!("port {p}: state {}", a.state));
    }
    Err(Error::IbUnavailable(format!(
        "device {} has no active port ({}; 4 = ACTIVE)",
        spec.name,
        if states.is_empty() {
            "no ports".to_string()
        } else {
            states.join(", ")
        }
    )))
}

/// A registered memory region; deregistered on drop.
pub struct IbMemory {
    device: Arc<DeviceInner>,
    mr: *mut IbvMr,
    addr: u64,
    size: u64,
    lkey: u32,
    rkey: u32,
}

// SAFETY: the MR handle is only used for deregistration, which libibverbs allows from any thread.
unsafe impl Send for IbMemory {}
// SAFETY: shared access only reads plain fields.
unsafe impl Sync for IbMemory {}

impl fmt::Debug for IbMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "IbMemory({:#x}+{} on {}, lkey {:#x}, rkey {:#x})",
            self.addr, self.size, self.device.name, self.lkey, self.rkey
        )
    }
}

impl IbMemory {
    /// The region as the local side names it in `Transport::write`'s `src` (key = lkey).
    pub fn local(&self) -> MemoryRegion {
        MemoryRegion {
            addr: self.addr,
            size: self.size,
            key: self.lkey,
        }
    }

    /// The region to advertise to peers, their `dst` (key = rkey).
    pub fn remote(&self) -> MemoryRegion {
        MemoryRegion {
            addr: self.addr,
            size: self.size,
            key: self.rkey,
        }
    }
}

impl Drop for IbMemory {
    fn drop(&mut self) {
        // SAFETY: `mr` came from ibv_reg_mr on `device`, which is alive (we hold an Arc).
        let rc = unsafe { (self.device.verbs.dereg_mr)(self.mr) };
        if rc != 0 {
            tracing::warn!(target: mscclpp_core::log::target::NET,
                "ibv_dereg_mr of {self:?} failed: {}", std::io::Error::from_raw_os_error(rc));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use std::path::PathBuf;

    #[rstest]
    #[case("mlx5_0", "mlx5_0", None)]
    #[case("mlx5_1:2", "mlx5_1", Some(2))]
    #[case("rocep1s0f0:1", "rocep1s0f0", Some(1))]
    fn hca_spec_parses(#[case] entry: &str, #[case] name: &str, #[case] port: Option<u8>) {
        assert_eq!(
            HcaSpec::parse(entry).unwrap(),
            HcaSpec {
                name: name.into(),
                port
            }
        );
    }

    #[rstest]
    #[case("mlx5_0:0", "ports are numbered from 1")]
    #[case("mlx5_0:x", "not a number")]
    #[case("mlx5_0:256", "not a number")]
    #[case(":1", "empty device name")]
    fn hca_spec_rejects(#[case] entry: &str, #[case] text: &str) {
        match HcaSpec::parse(entry) {
            Err(Error::Env { var, value, reason }) => {
                assert_eq!(var, "MSCCLPP_HCA_DEVICES");
                assert_eq!(value, entry);
                assert!(reason.contains(text), "{reason}");
            }
            other => panic!("{entry}: expected an Env error, got {other:?}"),
        }
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[rstest]
    #[case(&[], &["mlx5_0", "mlx5_1"], 1, "mlx5_1", None)]
    #[case(&["mlx5_1:2", "mlx5_0"], &["mlx5_0", "mlx5_1"], 0, "mlx5_1", Some(2))]
    #[case(&["mlx5_1:2", "mlx5_0"], &["mlx5_0", "mlx5_1"], 1, "mlx5_0", None)]
    fn hca_selection(
        #[case] requested: &[&str],
        #[case] found: &[&str],
        #[case] index: u8,
        #[case] name: &str,
        #[case] port: Option<u8>,
    ) {
        let spec = select_hca(&names(requested), &names(found), index).unwrap();
        assert_eq!((spec.name.as_str(), spec.port), (name, port));
    }

    #[test]
    fn hca_selection_errors() {
        let e = select_hca(&[], &[], 0).unwrap_err();
        assert!(
            matches!(e, Error::IbUnavailable(ref m) if m.contains("no InfiniBand HCA")),
            "{e}"
        );
        let e = select_hca(&names(&["mlx5_9"]), &names(&["mlx5_0"]), 0).unwrap_err();
        assert!(
            matches!(e, Error::IbUnavailable(ref m) if m.contains("mlx5_9") && m.contains("found: mlx5_0")),
            "{e}"
        );
        let e = select_hca(&names(&["mlx5_0"]), &names(&["mlx5_0"]), 1).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("IB1")),
            "{e}"
        );
    }

    /// A sysfs port directory with the given (type, gid) entries.
    fn fake_port(tag: &str, entries: &[(&str, &str)]) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("mscclpp-ib-gid-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let port = root.join("mlx5_0/ports/1");
        std::fs::create_dir_all(port.join("gid_attrs/types")).unwrap();
        std::fs::create_dir_all(port.join("gids")).unwrap();
        for (i, (ty, gid)) in entries.iter().enumerate() {
            if !ty.is_empty() {
                std::fs::write(
                    port.join("gid_attrs/types").join(i.to_string()),
                    format!("{ty}\n"),
                )
                .unwrap();
            }
            std::fs::write(port.join("gids").join(i.to_string()), format!("{gid}\n")).unwrap();
        }
        root
    }

    const ZERO: &str = "0000:0000:0000:0000:0000:0000:0000:0000";
    const V6: &str = "fe80:0000:0000:0000:0a42:a1ff:fe00:0001";
    const V4: &str = "0000:0000:0000:0000:0000:ffff:c0a8:0102";

    #[rstest]
    #[case("v4", &[("IB/RoCE v1", V6), ("RoCE v2", V6), ("IB/RoCE v1", V4), ("RoCE v2", V4)], Some(3))]
    #[case("v6", &[("IB/RoCE v1", V6), ("RoCE v2", V6)], Some(1))]
    #[case("none", &[("IB/RoCE v1", V6), ("", ZERO)], None)]
    #[case("empty", &[("RoCE v2", ZERO), ("RoCE v2", V4)], Some(1))]
    fn roce_gid_choice(
        #[case] tag: &str,
        #[case] entries: &[(&str, &str)],
        #[case] want: Option<u32>,
    ) {
        let root = fake_port(tag, entries);
        let got = auto_roce_gid_index(&root, "mlx5_0", 1, entries.len() as u32 + 2);
        let _ = std::fs::remove_dir_all(&root);
        assert_eq!(got, want);
    }
}
