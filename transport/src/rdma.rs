//! RDMA verbs backend (feature `rdma`): device discovery and the verbs setup
//! (device context, protection domain) that a future RDMA data path would build
//! its queue pairs on. It moves no data. CI compiles it but never exercises it:
//! there is no RDMA hardware there, so every test sees "no device".
//! Nothing selects this backend yet: peers talk over [`QuicTransport`](crate::QuicTransport),
//! which stays the transport whenever [`devices`] finds none.

use std::ffi::CStr;
use std::io;
use std::os::raw::c_int;
use std::ptr::NonNull;

use rdma_sys::{
    ibv_alloc_pd, ibv_close_device, ibv_context, ibv_dealloc_pd, ibv_device, ibv_free_device_list, ibv_get_device_guid,
    ibv_get_device_list, ibv_get_device_name, ibv_open_device, ibv_pd,
};

/// An RDMA device as libibverbs names it (`mlx5_0`, `rxe0`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    pub name: String,
    /// The node GUID in host byte order (as `ibv_devinfo` prints it).
    pub guid: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RdmaError {
    /// A verbs call on a device failed; `source` carries the errno it left.
    #[error("rdma device {device}: {call} failed: {source}")]
    Verbs { device: String, call: &'static str, source: io::Error },
}

/// The RDMA devices of this host. A host without any (no driver, no kernel
/// support: `ibv_get_device_list` fails with ENOSYS, ENODEV, ...) has none,
/// which is not an error: the caller stays on QUIC.
pub fn devices() -> Result<Vec<RdmaDevice>, RdmaError> {
    let Some(list) = DeviceList::get() else { return Ok(Vec::new()) };
    Ok(list.iter().map(|dev| RdmaDevice { name: device_name(dev), guid: device_guid(dev) }).collect())
}

/// Whether this host has at least one RDMA device.
pub fn available() -> bool {
    devices().is_ok_and(|found| !found.is_empty())
}

/// An open device with a protection domain, both released on drop. Not `Send`
/// or `Sync` yet: the data path that uses it will decide its threading.
#[derive(Debug)]
pub struct RdmaContext {
    device: String,
    ctx: NonNull<ibv_context>,
    pd: NonNull<ibv_pd>,
}

impl RdmaContext {
    pub fn device(&self) -> &str {
        &self.device
    }
}

impl Drop for RdmaContext {
    fn drop(&mut self) {
        // SAFETY: `pd` was allocated on `ctx` by `open_first` and is released
        // only here, before its context; nothing else holds either pointer.
        // Failures cannot be reported from drop; the kernel reclaims both when
        // the process exits.
        unsafe {
            ibv_dealloc_pd(self.pd.as_ptr());
            ibv_close_device(self.ctx.as_ptr());
        }
    }
}

/// Open the first RDMA device and allocate a protection domain on it;
/// `Ok(None)` when the host has no device.
pub fn open_first() -> Result<Option<RdmaContext>, RdmaError> {
    let Some(list) = DeviceList::get() else { return Ok(None) };
    let Some(dev) = list.iter().next() else { return Ok(None) };
    let device = device_name(dev);
    // SAFETY: `dev` comes from `list`, which is still alive. The context keeps
    // its own reference to the device, so `list` may be freed afterwards.
    let ctx = unsafe { ibv_open_device(dev) };
    let Some(ctx) = NonNull::new(ctx) else { return Err(verbs_error(device, "ibv_open_device")) };
    // SAFETY: `ctx` is an open context that nothing else uses yet.
    let pd = unsafe { ibv_alloc_pd(ctx.as_ptr()) };
    let Some(pd) = NonNull::new(pd) else {
        // Read errno before ibv_close_device can overwrite it.
        let err = verbs_error(device, "ibv_alloc_pd");
        // SAFETY: `ctx` is open, owns no resources and is not used after this.
        unsafe { ibv_close_device(ctx.as_ptr()) };
        return Err(err);
    };
    Ok(Some(RdmaContext { device, ctx, pd }))
}

/// The array `ibv_get_device_list` returns, freed on drop.
struct DeviceList {
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList {
    /// `None` when libibverbs returns no list: whatever the errno, that means
    /// no device this process can use.
    fn get() -> Option<DeviceList> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the array returned is ours until
        // `ibv_free_device_list`, which only `Drop` calls.
        let list = unsafe { ibv_get_device_list(&mut n) };
        let Some(list) = NonNull::new(list) else {
            tracing::debug!(err = %io::Error::last_os_error(), "no RDMA device list");
            return None;
        };
        Some(DeviceList { list, len: usize::try_from(n).unwrap_or(0) })
    }

    fn iter(&self) -> impl Iterator<Item = *mut ibv_device> + '_ {
        // SAFETY: the array holds `len` device pointers (then a NULL) and lives
        // as long as `self`.
        (0..self.len).map(|i| unsafe { *self.list.as_ptr().add(i) })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: `list` came from `ibv_get_device_list` and is freed once, here.
        unsafe { ibv_free_device_list(self.list.as_ptr()) }
    }
}

fn device_name(dev: *mut ibv_device) -> String {
    // SAFETY: `dev` is an entry of a live device list; the name it returns is
    // a NUL-terminated string owned by the device, copied out here.
    let name = unsafe { ibv_get_device_name(dev) };
    if name.is_null() {
        return String::new();
    }
    // SAFETY: checked non-NULL above; see the previous comment.
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

fn device_guid(dev: *mut ibv_device) -> u64 {
    // SAFETY: `dev` is an entry of a live device list.
    u64::from_be(unsafe { ibv_get_device_guid(dev) })
}

fn verbs_error(device: String, call: &'static str) -> RdmaError {
    RdmaError::Verbs { device, call, source: io::Error::last_os_error() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_reads_a_missing_device_list_as_no_device() {
        let found = devices().expect("no device list must read as no device, not an error");
        println!("rdma devices: {found:?}");
        assert_eq!(available(), !found.is_empty());
        if found.is_empty() {
            assert!(open_first().expect("nothing to open is not an error").is_none());
        }
    }
}
