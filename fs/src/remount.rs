//! `converged remount`: change a mount's flags in place, as `mount -o
//! remount,ro` asks the helper to. FUSE takes a remount through the old
//! mount API and ignores its data string, so only the flags change: the
//! superblock's read-only bit, and the mount's nosuid, nodev, noexec and
//! atime policy. Every flag not named keeps its current value (a remount
//! sets them all at once, so an unnamed one would otherwise be cleared).

use std::path::PathBuf;

use anyhow::{bail, Context};

use crate::config::AtimePolicy;

#[derive(clap::Args, Debug)]
pub struct RemountArgs {
    /// The mount point of a converged mount.
    pub mountpoint: PathBuf,
    /// Make the mount read-only: writes fail with EROFS.
    #[arg(long, conflicts_with = "read_write")]
    pub read_only: bool,
    /// Make the mount writable again.
    #[arg(long)]
    pub read_write: bool,
    /// Honour set-user-ID and set-group-ID bits (`suid`), or not (`nosuid`).
    #[arg(long, value_name = "BOOL")]
    pub suid: Option<bool>,
    /// Allow device files (`dev`), or not (`nodev`).
    #[arg(long, value_name = "BOOL")]
    pub dev: Option<bool>,
    /// Allow executing programs (`exec`), or not (`noexec`).
    #[arg(long, value_name = "BOOL")]
    pub exec: Option<bool>,
    /// The kernel's atime flag. The daemon keeps the policy it was mounted with (it updates
    /// atime itself); remount with umount and mount to change that.
    #[arg(long, value_enum)]
    pub atime: Option<AtimePolicy>,
}

/// The mount flags to pass to a remount: the current ones (from statvfs)
/// with those named in `a` changed.
fn flags(current: u64, a: &RemountArgs) -> u64 {
    let keep = |st: u64, ms: u64, set: Option<bool>| match set {
        Some(true) => ms,
        Some(false) => 0,
        None if current & st != 0 => ms,
        None => 0,
    };
    let mut f = libc::MS_REMOUNT;
    let ro = if a.read_only {
        Some(true)
    } else if a.read_write {
        Some(false)
    } else {
        None
    };
    f |= keep(libc::ST_RDONLY, libc::MS_RDONLY, ro);
    f |= keep(libc::ST_NOSUID, libc::MS_NOSUID, a.suid.map(|v| !v));
    f |= keep(libc::ST_NODEV, libc::MS_NODEV, a.dev.map(|v| !v));
    f |= keep(libc::ST_NOEXEC, libc::MS_NOEXEC, a.exec.map(|v| !v));
    f |= keep(libc::ST_NODIRATIME, libc::MS_NODIRATIME, None);
    let atime = a.atime.unwrap_or(if current & libc::ST_NOATIME != 0 {
        AtimePolicy::Noatime
    } else if current & libc::ST_RELATIME != 0 {
        AtimePolicy::Relatime
    } else {
        AtimePolicy::Strictatime
    });
    f | match atime {
        AtimePolicy::Noatime => libc::MS_NOATIME,
        AtimePolicy::Relatime => libc::MS_RELATIME,
        AtimePolicy::Strictatime => libc::MS_STRICTATIME,
    }
}

pub fn remount(a: &RemountArgs) -> anyhow::Result<()> {
    let mp = a.mountpoint.canonicalize().with_context(|| format!("mount point {}", a.mountpoint.display()))?;
    match crate::config::mount_source(&mp) {
        Some(src) if src.starts_with("fuse.converged ") => {}
        Some(src) => bail!("{} is not a converged mount ({src})", mp.display()),
        None => bail!("{} is not mounted", mp.display()),
    }
    let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())?;
    let st = crate::blocks::statvfs(&mp).with_context(|| format!("statvfs {}", mp.display()))?;
    let f = flags(st.f_flag, a);
    // The kernel refuses read-only (EBUSY) while a file is open for writing
    // or an unlinked file is still in use. FUSE sends a release after
    // close(2) has returned and holds the inode until the daemon answers, so
    // a file just closed (an unlinked one purged by its release) can be
    // busy for a moment: retried for that moment, then refused.
    let deadline = std::time::Instant::now() + RELEASES_IN_FLIGHT;
    loop {
        // SAFETY: mount(2) with valid C strings; FUSE ignores the data of a remount.
        let r = unsafe { libc::mount(std::ptr::null(), c.as_ptr(), std::ptr::null(), f, std::ptr::null()) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e).with_context(|| format!("remount {}", mp.display()));
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "remount {}: a file is open for writing there (or an unlinked file is still open), so it cannot \
                 become read-only",
                mp.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// How long a remount to read-only waits out releases the kernel has not
/// yet had answered.
const RELEASES_IN_FLIGHT: std::time::Duration = std::time::Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    fn args(f: impl FnOnce(&mut RemountArgs)) -> RemountArgs {
        let mut a = RemountArgs {
            mountpoint: PathBuf::new(),
            read_only: false,
            read_write: false,
            suid: None,
            dev: None,
            exec: None,
            atime: None,
        };
        f(&mut a);
        a
    }

    #[test]
    fn unnamed_flags_keep_their_current_value() {
        let current = libc::ST_NOSUID | libc::ST_NODEV | libc::ST_RELATIME;
        let f = flags(current, &args(|a| a.read_only = true));
        assert_eq!(f, libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_RELATIME);
        let f = flags(current | libc::ST_RDONLY, &args(|a| a.read_write = true));
        assert_eq!(f, libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_RELATIME);
        let f = flags(current, &args(|a| (a.suid, a.atime) = (Some(true), Some(AtimePolicy::Noatime))));
        assert_eq!(f, libc::MS_REMOUNT | libc::MS_NODEV | libc::MS_NOATIME);
    }
}
