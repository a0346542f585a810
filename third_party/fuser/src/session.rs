//! Filesystem session
//!
//! A session runs a filesystem implementation while it is being mounted to a specific mount
//! point. A session begins by mounting the filesystem and ends by unmounting it. While the
//! filesystem is mounted, the session loop receives, dispatches and replies to kernel requests
//! for filesystem operations under its mount point.

use std::borrow::Cow;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::fd::BorrowedFd;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::thread::{self};

use log::debug;
use log::error;
use log::info;
use log::warn;
use nix::unistd::Uid;
use nix::unistd::geteuid;
use parking_lot::Mutex;

use crate::Errno;
use crate::Filesystem;
use crate::KernelConfig;
use crate::MountOption;
use crate::ReplyEmpty;
use crate::Request;
use crate::channel::Channel;
use crate::channel::ChannelSender;
use crate::dev_fuse::DevFuse;
use crate::passthrough::BackingId;
use crate::ll;
use crate::ll::Operation;
use crate::ll::ResponseErrno;
use crate::ll::Version;
use crate::ll::flags::init_flags::InitFlags;
use crate::ll::fuse_abi as abi;
use crate::mnt::Mount;
use crate::mnt::mount_options::Config;
use crate::mnt::mount_options::check_option_conflicts;
use crate::notify::Notifier;
use crate::read_buf::FuseReadBuf;
use crate::reply::Reply;
use crate::reply::ReplyRaw;
use crate::reply::ReplySender;
use crate::request::RequestWithSender;

/// The max size of write requests from the kernel. The absolute minimum is 4k,
/// FUSE recommends at least 128k, max 16M. The FUSE default is 16M on macOS
/// and 128k on other systems.
pub(crate) const MAX_WRITE_SIZE: usize = 16 * 1024 * 1024;

#[derive(Default, Debug, Eq, PartialEq, Clone, Copy)]
/// How requests should be filtered based on the calling UID.
pub enum SessionACL {
    /// Allow requests from any user. Corresponds to the `allow_other` mount option.
    All,
    /// Allow requests from root. Corresponds to the `allow_root` mount option.
    RootAndOwner,
    /// Allow requests from the owning UID. This is FUSE's default mode of operation.
    #[default]
    Owner,
}

impl SessionACL {
    /// Returns the mount option string for kernel/fusermount/libfuse paths.
    /// Both `All` and `RootAndOwner` map to `allow_other` - the kernel only
    /// understands `allow_other`, and fuser enforces the root-only restriction internally.
    #[allow(dead_code)]
    pub(crate) fn to_mount_option(self) -> Option<&'static str> {
        match self {
            SessionACL::All | SessionACL::RootAndOwner => Some("allow_other"),
            SessionACL::Owner => None,
        }
    }
}

/// Calls `destroy` on drop.
#[derive(Debug)]
pub(crate) struct FilesystemHolder<FS: Filesystem> {
    pub(crate) fs: Option<FS>,
}

impl<FS: Filesystem> FilesystemHolder<FS> {
    fn destroy(&mut self) {
        if let Some(mut fs) = self.fs.take() {
            fs.destroy();
        }
    }
}

impl<FS: Filesystem> Drop for FilesystemHolder<FS> {
    fn drop(&mut self) {
        self.destroy();
    }
}

#[derive(Debug)]
struct UmountOnDrop {
    mount: Arc<Mutex<Option<Mount>>>,
}

impl UmountOnDrop {
    fn umount(&self) -> io::Result<()> {
        if let Some(mount) = self.mount.lock().take() {
            mount.umount()?;
        }
        Ok(())
    }
}

impl Drop for UmountOnDrop {
    fn drop(&mut self) {
        if let Err(e) = self.umount() {
            warn!("Failed to umount filesystem: {}", e);
        }
    }
}

/// The session data structure
#[derive(Debug)]
pub struct Session<FS: Filesystem> {
    /// Filesystem operation implementations. None after `destroy` called.
    pub(crate) filesystem: FilesystemHolder<FS>,
    /// Communication channel to the kernel driver
    pub(crate) ch: Channel,
    /// Handle to the mount.  Dropping this unmounts.
    mount: UmountOnDrop,
    /// Whether to restrict access to owner, root + owner, or unrestricted
    /// Used to implement `allow_root` and `auto_unmount`
    pub(crate) allowed: SessionACL,
    /// User that launched the fuser process
    pub(crate) session_owner: Uid,
    /// FUSE protocol version, as reported by the kernel.
    /// The field is set to `Some` when the init message is received.
    pub(crate) proto_version: Option<Version>,
    pub(crate) config: Config,
    /// How FUSE over io_uring starts at `run`.
    pub(crate) rings: RingStart,
}

/// How a session's FUSE over io_uring starts at `run`.
pub(crate) enum RingStart {
    /// Requests come through /dev/fuse only.
    Off,
    /// INIT settled the transport on these rings, made before its reply.
    #[cfg(target_os = "linux")]
    Made(crate::uring::Rings),
    /// A connection taken over whose INIT settled the transport: the rings
    /// are started again on the memory the earlier daemon left, and its
    /// entries' slots recovered (see `uring.rs`).
    Resume,
}

impl std::fmt::Debug for RingStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RingStart::Off => "Off",
            #[cfg(target_os = "linux")]
            RingStart::Made(_) => "Made",
            RingStart::Resume => "Resume",
        })
    }
}

impl<FS: Filesystem> AsFd for Session<FS> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.ch.as_fd()
    }
}

impl<FS: Filesystem> Session<FS> {
    /// Create a new session by mounting the given filesystem to the given mountpoint
    /// # Errors
    /// Returns an error if the options are incorrect, or if the fuse device can't be mounted.
    pub fn new<P: AsRef<Path>>(
        filesystem: FS,
        mountpoint: P,
        options: &Config,
    ) -> io::Result<Session<FS>> {
        check_option_conflicts(options)?;

        let mountpoint = mountpoint.as_ref();
        info!("Mounting {}", mountpoint.display());
        // If AutoUnmount is requested, but not AllowRoot or AllowOther, return an error
        // because fusermount needs allow_root or allow_other to handle the auto_unmount option
        if options.mount_options.contains(&MountOption::AutoUnmount)
            && options.acl == SessionACL::Owner
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("auto_unmount requires acl != Owner, got: {:?}", options.acl),
            ));
        }
        let (file, mount) = Mount::new(mountpoint, &options.mount_options, options.acl)?;

        let ch = Channel::new(file);

        let mut session = Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(Some(mount))),
            },
            allowed: options.acl,
            session_owner: geteuid(),
            proto_version: None,
            config: options.clone(),
            rings: RingStart::Off,
        };

        session.handshake()?;

        Ok(session)
    }

    /// Wrap an existing /dev/fuse file descriptor. This doesn't mount the
    /// filesystem anywhere; that must be done separately.
    pub fn from_fd(
        filesystem: FS,
        fd: OwnedFd,
        acl: SessionACL,
        config: Config,
    ) -> io::Result<Self> {
        let ch = Channel::new(Arc::new(DevFuse(File::from(fd))));
        let mut session = Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(None)),
            },
            allowed: acl,
            session_owner: geteuid(),
            proto_version: None,
            config,
            rings: RingStart::Off,
        };

        session.handshake()?;

        Ok(session)
    }

    /// Take over a live connection on `fd`, a descriptor of a /dev/fuse
    /// connection whose INIT an earlier daemon answered (the descriptor
    /// outlived that daemon). No handshake: the kernel sends no second
    /// INIT, and `Filesystem::init` is not called; the caller restores what
    /// the first init settled. Requests the earlier daemon read and did not
    /// answer are sent again after [`Notifier::resend`]. With
    /// `config.io_uring` (set it when the connection's INIT settled FUSE
    /// over io_uring) the rings are started again on the ring memory the
    /// earlier daemon left (`Config::io_uring_memory`), answering what its
    /// entries held.
    pub fn resume_fd(filesystem: FS, fd: OwnedFd, acl: SessionACL, config: Config) -> io::Result<Self> {
        let ch = Channel::new(Arc::new(DevFuse(File::from(fd))));
        let rings = if config.io_uring { RingStart::Resume } else { RingStart::Off };
        Ok(Session {
            filesystem: FilesystemHolder {
                fs: Some(filesystem),
            },
            ch,
            mount: UmountOnDrop {
                mount: Arc::new(Mutex::new(None)),
            },
            allowed: acl,
            session_owner: geteuid(),
            proto_version: Some(Version(abi::FUSE_KERNEL_VERSION, abi::FUSE_KERNEL_MINOR_VERSION)),
            config,
            rings,
        })
    }

    /// A backing id an earlier daemon registered on this connection
    /// (`BackingId::raw`), owned from now on: dropping it closes it.
    ///
    /// # Safety
    /// `id` must be registered on this connection and owned by nothing else.
    pub unsafe fn adopt_backing_id(&self, id: u32) -> BackingId {
        unsafe { BackingId::wrap_raw(&self.ch.0, id) }
    }

    /// Run the session loop in a background thread. If the returned handle is dropped,
    /// the filesystem is unmounted and the given session ends.
    pub fn spawn(self) -> io::Result<BackgroundSession> {
        let sender = self.ch.sender();
        // Take the fuse_session, so that we can unmount it
        let mount = std::mem::take(&mut *self.mount.mount.lock());
        let guard = thread::Builder::new()
            .name("fuser-bg".to_string())
            .spawn(move || self.run())?;
        Ok(BackgroundSession {
            guard,
            sender,
            mount,
        })
    }

    /// Run the session loop that receives kernel requests and dispatches them to method
    /// calls into the filesystem. This read-dispatch-loop is non-concurrent to prevent
    /// having multiple buffers (which take up much memory), but the filesystem methods
    /// may run concurrent by spawning threads.
    /// # Errors
    /// Returns any final error when the session comes to an end.
    pub fn run(self) -> io::Result<()> {
        let Session {
            filesystem,
            ch,
            mount: _do_not_umount_yet,
            allowed,
            session_owner,
            proto_version: _,
            config,
            rings,
        } = self;

        let n_threads = config.n_threads.unwrap_or(1);

        if !cfg!(target_os = "linux") && n_threads != 1 {
            // TODO: check whether it works on macOS/FreeBSD and enable if it works.
            return Err(io::Error::other(
                "n_threads != 1 is only supported on Linux",
            ));
        }

        let Some(n_threads_minus_one) = n_threads.checked_sub(1) else {
            return Err(io::Error::other("n_threads"));
        };

        let mut filesystem = Arc::new(filesystem);

        let mut channels = Vec::with_capacity(n_threads);

        for _ in 0..n_threads_minus_one {
            if config.clone_fd {
                #[cfg(target_os = "linux")]
                {
                    channels.push(ch.clone_fd()?);
                    continue;
                }
                #[cfg(not(target_os = "linux"))]
                {
                    return Err(io::Error::other("clone_fd is only supported on Linux"));
                }
            } else {
                channels.push(ch.clone());
            }
        }
        #[cfg(target_os = "linux")]
        let ring_dev = ch.clone();
        channels.push(ch);

        let mut threads = Vec::with_capacity(n_threads);

        // While rings serve, /dev/fuse carries forgets and interrupts only.
        #[cfg(target_os = "linux")]
        let (ring_threads, serving) = spawn_rings(&ring_dev, &filesystem, allowed, session_owner, rings, &config)?;
        #[cfg(not(target_os = "linux"))]
        let (_, serving) = (rings, None::<Arc<RingsServing>>);

        for (i, ch) in channels.into_iter().enumerate() {
            let read = match (&serving, i) {
                (None, _) => DevRead::Always,
                (Some(s), 0) => DevRead::Pacing(s.clone()),
                (Some(s), _) => DevRead::Standby(s.clone()),
            };
            let thread_name = format!("fuser-{i}");
            let event_loop = SessionEventLoop {
                thread_name: thread_name.clone(),
                filesystem: filesystem.clone(),
                ch,
                allowed,
                session_owner,
            };
            threads.push(
                thread::Builder::new()
                    .name(thread_name)
                    .spawn(move || event_loop.event_loop(read))?,
            );
        }

        let mut reply: io::Result<()> = Ok(());
        for thread in threads {
            let res = match thread.join() {
                Ok(res) => res,
                Err(_) => {
                    return Err(io::Error::other("event loop thread panicked"));
                }
            };
            if let Err(e) = res {
                if reply.is_ok() {
                    reply = Err(e);
                }
            }
        }

        #[cfg(target_os = "linux")]
        for thread in ring_threads {
            match thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!("FUSE ring thread ended: {e}"),
                Err(_) => return Err(io::Error::other("ring thread panicked")),
            }
        }

        let Some(filesystem) = Arc::get_mut(&mut filesystem) else {
            return Err(io::Error::other(
                "BUG: must have one refcount for filesystem",
            ));
        };

        filesystem.destroy();

        reply
    }

    fn handshake(&mut self) -> io::Result<()> {
        let mut buf = FuseReadBuf::new();
        let buf = buf.as_mut();

        loop {
            // Read the init request from the kernel
            let size = match self.ch.receive_retrying(buf) {
                Ok(size) => size,
                Err(nix::errno::Errno::ENODEV) => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        "FUSE device disconnected during handshake",
                    ));
                }
                Err(err) => return Err(err.into()),
            };

            // Parse the request
            let request = match ll::AnyRequest::try_from(&buf[..size]) {
                Ok(request) => request,
                Err(err) => {
                    error!("{err}");
                    return Err(io::Error::new(io::ErrorKind::InvalidData, err.to_string()));
                }
            };

            // Extract the init operation
            let op = match request.operation() {
                Ok(op) => op,
                Err(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "Failed to parse FUSE operation",
                    ));
                }
            };

            let init = match op {
                ll::Operation::Init(init) => init,
                _ => {
                    error!("Received non-init FUSE operation before init: {}", request);
                    // Send error response and return error - non-init during handshake is invalid
                    <ReplyRaw as Reply>::new(
                        request.unique(),
                        ReplySender::Channel(self.ch.sender()),
                    )
                    .send_ll(&ResponseErrno(ll::Errno::EIO));
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "Received non-init FUSE operation during handshake",
                    ));
                }
            };

            let v = init.version();
            if v.0 > abi::FUSE_KERNEL_VERSION {
                // Kernel has a newer major version than we support.
                // Send our version and wait for a second INIT request with a compatible version.
                debug!(
                    "INIT: Kernel version {} > our version {}, sending our version and waiting for next init",
                    v.0,
                    abi::FUSE_KERNEL_VERSION
                );
                let response = init.reply_version_only();
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&response);
                continue;
            }

            // We don't support ABI versions before 7.6
            if v < Version(7, 6) {
                error!("Unsupported FUSE ABI version {v}");
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&ResponseErrno(ll::Errno::EPROTO));
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("Unsupported FUSE ABI version {v}"),
                ));
            }

            // The rings are made before the filesystem is offered the
            // transport: one this process cannot make is not offered.
            #[cfg_attr(not(target_os = "linux"), allow(unused_mut))]
            let mut offered = init.capabilities();
            #[cfg(target_os = "linux")]
            let made = match self.config.io_uring && offered.contains(InitFlags::FUSE_OVER_IO_URING) {
                true => match crate::uring::Rings::make(&self.ch.0, &self.config) {
                    Ok(rings) => Some(rings),
                    Err(e) => {
                        warn!("FUSE over io_uring not used ({e}); requests go through /dev/fuse");
                        offered.remove(InitFlags::FUSE_OVER_IO_URING);
                        None
                    }
                },
                false => None,
            };
            let mut config = KernelConfig::new(offered, init.max_readahead(), v);

            // Call filesystem init method and give it a chance to return an error
            let Some(filesystem) = &mut self.filesystem.fs else {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "Bug: filesystem must be initialized during handshake",
                ));
            };
            let res = filesystem.init(Request::ref_cast(request.header()), &mut config);
            if let Err(error) = res {
                #[cfg(target_os = "linux")]
                if let Some(rings) = made {
                    rings.discard(self.config.io_uring_memory);
                }
                let errno = Errno::from_i32(error.raw_os_error().unwrap_or(0));
                <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                    .send_ll(&ResponseErrno(errno));
                return Err(error);
            }

            // Remember the ABI version supported by kernel and mark the session initialized.
            self.proto_version = Some(v);

            // Log capability status for debugging
            for bit in 0..64 {
                let bitflags = InitFlags::from_bits_retain(1 << bit);
                if bitflags == InitFlags::FUSE_INIT_EXT {
                    continue;
                }
                let bitflag_is_known = InitFlags::all().contains(bitflags);
                let kernel_supports = init.capabilities().contains(bitflags);
                let we_requested = config.requested.contains(bitflags);
                // On macOS, there's a clash between linux and macOS constants,
                // so we pick macOS ones (last).
                let name = if let Some((name, _)) = bitflags.iter_names().last() {
                    Cow::Borrowed(name)
                } else {
                    Cow::Owned(format!("(1 << {bit})"))
                };
                if we_requested && kernel_supports {
                    debug!("capability {name} enabled")
                } else if we_requested {
                    debug!("capability {name} not supported by kernel")
                } else if kernel_supports {
                    debug!("capability {name} not requested by client")
                } else if bitflag_is_known {
                    debug!("capability {name} not supported nor requested")
                }
            }

            #[cfg(target_os = "linux")]
            if let Some(rings) = made {
                if config.requested.contains(InitFlags::FUSE_OVER_IO_URING) {
                    // Every request and reply fits an entry's payload buffer:
                    // the kernel caps the pages, this the writes.
                    config.max_write = config.max_write.min(rings.area.payload() as u32);
                    self.rings = RingStart::Made(rings);
                } else {
                    rings.discard(self.config.io_uring_memory);
                }
            }

            // Reply with our desired version and settings.
            debug!(
                "INIT response: ABI {}.{}, flags {:#x}, max readahead {}, max write {}",
                abi::FUSE_KERNEL_VERSION,
                abi::FUSE_KERNEL_MINOR_VERSION,
                init.capabilities() & config.requested,
                config.max_readahead,
                config.max_write
            );

            let response = init.reply(&config);
            <ReplyRaw as Reply>::new(request.unique(), ReplySender::Channel(self.ch.sender()))
                .send_ll(&response);

            return Ok(());
        }
    }

    /// Unmount the filesystem
    pub fn unmount(&mut self) -> io::Result<()> {
        self.mount.umount()
    }

    /// Returns a thread-safe object that can be used to unmount the Filesystem
    pub fn unmount_callable(&mut self) -> SessionUnmounter {
        SessionUnmounter {
            mount: self.mount.mount.clone(),
        }
    }

    /// Returns an object that can be used to send notifications to the kernel
    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.ch.sender())
    }
}

#[derive(Debug)]
/// A thread-safe object that can be used to unmount a Filesystem
pub struct SessionUnmounter {
    mount: Arc<Mutex<Option<Mount>>>,
}

impl SessionUnmounter {
    /// Unmount the filesystem
    pub fn unmount(&mut self) -> io::Result<()> {
        if let Some(mount) = std::mem::take(&mut *self.mount.lock()) {
            mount.umount()?;
        }
        Ok(())
    }
}

pub(crate) struct SessionEventLoop<FS: Filesystem> {
    /// Cache thread name for faster `debug!`.
    pub(crate) thread_name: String,
    pub(crate) ch: Channel,
    pub(crate) filesystem: Arc<FilesystemHolder<FS>>,
    pub(crate) allowed: SessionACL,
    pub(crate) session_owner: Uid,
}

/// The ring threads of a session, and whether every one still serves
/// (`None`: no rings).
type RingThreads = (Vec<JoinHandle<io::Result<()>>>, Option<Arc<RingsServing>>);

/// How long the /dev/fuse reader of a connection that rings serve waits
/// after a forget before it reads again: the forgets queued meanwhile come
/// in one `BATCH_FORGET`. An unlink storm queues a forget an unlink, and a
/// wakeup of this thread each cost as much as a third of the unlink's own
/// round trip (2 CPUs, 20,000 unlinks from one process: 17.0-18.8k/s read
/// one by one, 22.2-24.2k/s paced). What else comes through /dev/fuse then,
/// an `INTERRUPT`, waits this long at most.
const FORGET_PACE: std::time::Duration = std::time::Duration::from_millis(1);

/// Whether every ring thread of the session still serves. Once the rings
/// are ready the kernel sends every request through them but `FORGET`,
/// `BATCH_FORGET` and `INTERRUPT`, which stay on /dev/fuse; one thread reads
/// those (and paces its reads after forgets: [`FORGET_PACE`]), the others
/// stand by. When a ring thread ends (the kernel refused its registration
/// and sends requests through /dev/fuse again, or the connection ended),
/// the pace stops and the others read too. `ended` is a leaf lock, taken
/// alone to set, read or wait on the flag.
#[derive(Default)]
pub(crate) struct RingsServing {
    ended: Mutex<bool>,
    changed: parking_lot::Condvar,
}

impl RingsServing {
    /// A ring thread ended: /dev/fuse may carry every request from now on.
    fn ring_ended(&self) {
        *self.ended.lock() = true;
        self.changed.notify_all();
    }

    fn serving(&self) -> bool {
        !*self.ended.lock()
    }

    /// Wait until a ring thread ends.
    fn wait_for_end(&self) {
        let mut ended = self.ended.lock();
        while !*ended {
            self.changed.wait(&mut ended);
        }
    }
}

/// What a /dev/fuse thread does, by whether rings serve the connection.
enum DevRead {
    /// No rings: every request comes through /dev/fuse.
    Always,
    /// Rings serve: read, waiting [`FORGET_PACE`] after a forget while they do.
    Pacing(Arc<RingsServing>),
    /// Rings serve: read only once a ring thread ended.
    Standby(Arc<RingsServing>),
}

impl<FS: Filesystem> SessionEventLoop<FS> {
    fn event_loop(&self, read: DevRead) -> io::Result<()> {
        let pacing = match read {
            DevRead::Always => None,
            DevRead::Pacing(serving) => Some(serving),
            DevRead::Standby(serving) => {
                serving.wait_for_end();
                None
            }
        };
        // Buffer for receiving requests from the kernel. Only one is allocated and
        // it is reused immediately after dispatching to conserve memory and allocations.
        let mut buf = FuseReadBuf::new();
        let buf = buf.as_mut();
        loop {
            // Read the next request from the given channel to kernel driver
            // The kernel driver makes sure that we get exactly one request per read
            match self.ch.receive_retrying(buf) {
                Ok(size) => match RequestWithSender::new(self.ch.sender(), &buf[..size]) {
                    // Dispatch request
                    Some(req) => {
                        // Decoded once: whether it ends the loop, or (while
                        // rings serve) is a forget to pace after.
                        let (destroy, forget) = match req.request.operation() {
                            Ok(Operation::Destroy(_)) => (true, false),
                            Ok(Operation::Forget(_) | Operation::BatchForget(_)) => (false, pacing.is_some()),
                            _ => (false, false),
                        };
                        if destroy {
                            req.reply::<ReplyEmpty>().ok();
                            return Ok(());
                        }
                        req.dispatch(self);
                        if forget && pacing.as_ref().is_some_and(|s| s.serving()) {
                            thread::sleep(FORGET_PACE);
                        }
                    }
                    // Quit loop on illegal request
                    None => {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "Invalid request",
                        ));
                    }
                },
                Err(nix::errno::Errno::ENODEV) => return Ok(()),
                Err(err) => return Err(err.into()),
            }
        }
    }
}

/// Starts the ring threads of FUSE over io_uring, each pinned to its
/// queue's CPU and holding one entry. The kernel hands a request to
/// the entry that became free last, so one process's requests go to the
/// thread that answered its last one, on the CPU the process sleeps on;
/// a request that blocks (a disk sync, a commit on etcd) holds up only
/// its own thread. Resuming, the threads are those of the earlier daemon's
/// slots; an area that cannot be mapped again where it was is an error,
/// since the requests in it would wait for ever. So is a thread that
/// cannot start: INIT promised the kernel a ring on every queue.
/// Returns the threads, and with rings the flag that says they all serve.
#[cfg(target_os = "linux")]
fn spawn_rings<FS: Filesystem>(
    ch: &Channel,
    filesystem: &Arc<FilesystemHolder<FS>>,
    allowed: SessionACL,
    session_owner: Uid,
    start: RingStart,
    config: &Config,
) -> io::Result<RingThreads> {
    use crate::uring::{RingArea, Rings};
    let (rings, resume) = match start {
        RingStart::Off => return Ok((Vec::new(), None)),
        RingStart::Made(rings) => (rings, false),
        RingStart::Resume => match config.io_uring_memory.map(RingArea::reopen).transpose()?.flatten() {
            Some(area) => (Rings::reopened(&ch.0, area)?, true),
            // No area left: the earlier daemon never started its rings.
            None => (Rings::make(&ch.0, config)?, false),
        },
    };
    let Rings { area, rings } = rings;
    let serving = Arc::new(RingsServing::default());
    let mut threads = Vec::with_capacity(rings.len());
    for (slot, ring) in rings.into_iter().enumerate() {
        if config.io_uring_refused {
            ring.refuse_registration();
        }
        let thread_name = format!("fuser-ring-{slot}");
        let event_loop = SessionEventLoop {
            thread_name: thread_name.clone(),
            filesystem: filesystem.clone(),
            ch: ch.clone(),
            allowed,
            session_owner,
        };
        let serving = serving.clone();
        let t = thread::Builder::new().name(thread_name).spawn(move || {
            let r = event_loop.ring_loop(ring, resume);
            serving.ring_ended();
            r
        })?;
        threads.push(t);
    }
    info!(
        "FUSE over io_uring: {} ring threads, {} bytes an entry{}",
        threads.len(),
        area.payload(),
        if resume { ", taken over from the earlier daemon" } else { "" }
    );
    Ok((threads, Some(serving)))
}

#[cfg(target_os = "linux")]
impl<FS: Filesystem> SessionEventLoop<FS> {
    /// The loop of one ring thread: each request its ring completes is
    /// dispatched as one read from /dev/fuse would be, its reply committed
    /// to the entry it came in.
    fn ring_loop(&self, ring: Arc<crate::uring::Ring>, resume: bool) -> io::Result<()> {
        ring.pin();
        ring.serve(resume, |data| {
            match RequestWithSender::new(ChannelSender::ring(ring.clone()), data) {
                Some(req) => {
                    if let Ok(Operation::Destroy(_)) = req.request.operation() {
                        req.reply::<ReplyEmpty>().ok();
                        return false;
                    }
                    req.dispatch(self);
                }
                None => {
                    // Answer it, or the entry and its caller would wait forever.
                    let unique = data.get(8..16).and_then(|b| b.try_into().ok()).map_or(0, u64::from_ne_bytes);
                    let sender = ReplySender::Channel(ChannelSender::ring(ring.clone()));
                    <ReplyRaw as Reply>::new(ll::RequestId(unique), sender)
                        .send_ll(&ResponseErrno(ll::Errno::EIO));
                }
            }
            true
        })
    }
}

/// The background session data structure
#[derive(Debug)]
pub struct BackgroundSession {
    /// Thread guard of the background session
    pub guard: JoinHandle<io::Result<()>>,
    /// Object for creating Notifiers for client use
    sender: ChannelSender,
    /// Ensures the filesystem is unmounted when the session ends
    mount: Option<Mount>,
}

impl BackgroundSession {
    /// Unmount the filesystem and join the background thread.
    pub fn umount_and_join(mut self) -> io::Result<()> {
        if let Some(mount) = self.mount.take() {
            mount.umount()?;
        }
        self.join()
    }

    /// Returns an object that can be used to send notifications to the kernel
    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.sender.clone())
    }

    /// Join the filesystem thread.
    pub fn join(self) -> io::Result<()> {
        self.guard
            .join()
            .map_err(|_panic: Box<dyn std::any::Any + Send>| {
                io::Error::new(
                    io::ErrorKind::Other,
                    "filesystem background thread panicked",
                )
            })?
    }
}
