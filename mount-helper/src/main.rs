//! `mount.converged` (and `mount.fuse.converged`): called by mount(8) as
//! `mount.converged SOURCE DIR [-sfnv] [-o OPTIONS] [-t TYPE]`, for
//! `mount -t converged` and `/etc/fstab` lines. Translates the options into a
//! `converged mount` and returns once the mount answers.

use std::ffi::OsString;
use std::process::ExitCode;

/// The first argument a daemon started by this helper gets (see `cli::main_with`).
const DAEMON_ARG: &str = "--converged-daemon";

/// Options mount(8) or fstab commonly carry that mean nothing to converged.
fn ignored(opt: &str) -> bool {
    matches!(
        opt,
        "defaults"
            | "rw"
            | "auto"
            | "noauto"
            | "user"
            | "nouser"
            | "users"
            | "_netdev"
            | "nofail"
            | "exec"
            | "async"
            | "loop"
    ) || opt.starts_with("x-")
        || opt.starts_with("comment=")
}

const USAGE: &str = "usage: mount.converged SOURCE MOUNTPOINT [-sfnv] [-o data_dir=DIR[,meta=URI][,new_node][,ro][,meta_wait=2m][,verify_reads][,threads=N]
                                                 [,attr_timeout=S][,log_file=F][,node_id=ID][,allow_suid][,allow_dev][,noexec][,noatime|relatime|strictatime][,nodiratime]
                                                 [,listen=ADDR,tls_dir=DIR][,labels=K=V+K=V][,replicas=N][,durability=replicated|local][,nowsync][,repair_delay=5m]
                                                 [,etcd_ca=F,etcd_cert=F,etcd_key=F][,etcd_user=U,etcd_password_file=F]
                                                 [,object_store=URI,s3_endpoint=URL,backfill_delay=5s,evict_high=90,evict_low=80]
                                                 [,failure_domain=LABEL][,peer_timeout=S][,lease_ttl=S][,meta_op_wait=5m]]
SOURCE is `local` or `converged:NAME` (embedded metadata in the data dir; NAME is shown as the source) or a metadata URI such as redb:///nvme/converged/meta.redb
or etcd://m1:2379,m2:2379,m3:2379/vol1 (etcds:// for TLS; a cluster volume; options as for `converged mount`).
A data dir is mounted only once it has an identity: give new_node at its first mount (not in a line kept for boot).
Mounts are nosuid,nodev unless allow_suid or allow_dev is given (mount(8) drops `suid` and `dev` before calling
this helper); _netdev waits up to 60s for the metadata service (meta_wait=).
`-o remount,ro` (or rw, [no]suid, [no]dev, [no]exec, noatime, relatime, strictatime) changes a mount in place.";

/// How long a `_netdev` mount waits for its metadata service unless `meta_wait=` says.
const NETDEV_META_WAIT: &str = "60s";

fn translate<'a>(args: &'a [String]) -> Result<Vec<OsString>, String> {
    let mut positional = Vec::new();
    let mut options: Vec<&'a str> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" => options.extend(it.next().ok_or("-o needs a value")?.split(',')),
            "-t" => {
                it.next().ok_or("-t needs a value")?;
            }
            // sloppy, fake, no-mtab, verbose: accepted as mount(8) passes them.
            "-s" | "-f" | "-n" | "-v" => {}
            s if s.starts_with("-o") && s.len() > 2 => options.extend(s[2..].split(',')),
            s if s.starts_with('-') => return Err(format!("unknown flag {s}")),
            _ => positional.push(a.clone()),
        }
    }
    let [source, mountpoint] = positional.as_slice() else {
        return Err(format!("expected SOURCE and MOUNTPOINT, got {} arguments", positional.len()));
    };
    if options.contains(&"remount") {
        return remount(mountpoint, &options);
    }
    let mut out: Vec<OsString> = vec!["converged".into(), "mount".into(), mountpoint.into()];
    let mut data_dir = None;
    // The mount's source as findmnt and df show it.
    let mut fsname = format!("converged:{source}");
    let mut meta = None;
    let mut meta_wait = None;
    let mut new_node = false;
    // A `nosuid` or `nodev` anywhere on the line wins over an allow_ option.
    let (mut suid, mut dev) = (false, false);
    let (nosuid, nodev) = (options.contains(&"nosuid"), options.contains(&"nodev"));
    let mut etcd_access: Vec<String> = Vec::new();
    match source.as_str() {
        "local" | "converged" => {}
        // A single-node volume with a name of its own, shown as the mount's source (so
        // that two of them on one host, findmnt -S and umount by source tell apart).
        s if s.strip_prefix("converged:").is_some_and(|n| !n.is_empty() && !n.contains('/')) => fsname = s.to_string(),
        s if s.contains("://") || s.starts_with("memory:") => meta = Some(s.to_string()),
        s => {
            return Err(format!("source {s:?} is neither `local`, `converged:NAME` nor a metadata URI (redb:///path)"))
        }
    }
    for opt in options.iter().filter(|o| !o.is_empty()) {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (*opt, None),
        };
        let need = |v: Option<&'a str>| -> Result<&'a str, String> {
            v.filter(|v| !v.is_empty()).ok_or(format!("option {key} needs a value ({key}=...)"))
        };
        match key {
            "data_dir" => data_dir = Some(need(value)?.to_string()),
            "meta" => meta = Some(need(value)?.to_string()),
            "verify_reads" => out.push("--verify-reads".into()),
            "ro" => out.push("--read-only".into()),
            // mount(8) drops `suid` and `dev` (its own defaults) before it
            // calls a helper, so fstab lines name them allow_suid, allow_dev.
            "suid" | "allow_suid" => suid = true,
            "dev" | "allow_dev" => dev = true,
            "noexec" => out.push("--noexec".into()),
            "new_node" => new_node = true,
            "nosuid" | "nodev" => {}
            "noatime" | "relatime" | "strictatime" => out.extend(["--atime".into(), key.into()]),
            "atime" => out.extend(["--atime".into(), "relatime".into()]),
            "nodiratime" => out.push("--nodiratime".into()),
            "meta_wait" => meta_wait = Some(need(value)?.to_string()),
            "etcd_ca" | "etcd_cert" | "etcd_key" | "etcd_user" | "etcd_password_file" => {
                etcd_access.push(format!("{}={}", &key["etcd_".len()..], need(value)?));
            }
            "threads" => out.extend(["--threads".into(), need(value)?.into()]),
            "attr_timeout" => out.extend(["--attr-timeout".into(), need(value)?.into()]),
            "log_file" => out.extend(["--log-file".into(), need(value)?.into()]),
            "node_id" | "listen" | "tls_dir" | "lease_ttl" | "replicas" | "durability" | "failure_domain"
            | "peer_timeout" | "object_store" | "s3_endpoint" | "backfill_delay" | "backfill_workers"
            | "evict_high" | "evict_low" | "metrics" | "object_copy_limit" | "repair_delay" | "repair_bandwidth"
            | "sweep_grace" | "scrub_period" | "meta_op_wait" => {
                out.extend([format!("--{}", key.replace('_', "-")).into(), need(value)?.into()])
            }
            "keep_deleted_objects" => out.push("--keep-deleted-objects".into()),
            "nowsync" => out.push("--nowsync".into()),
            // Commas separate mount options, so labels are joined with `+` here.
            "labels" => out.extend(["--labels".into(), need(value)?.replace('+', ",").into()]),
            _ if ignored(opt) => {}
            _ => return Err(format!("unknown mount option {opt:?}")),
        }
    }
    if suid && !nosuid {
        out.push("--suid".into());
    }
    if dev && !nodev {
        out.push("--dev".into());
    }
    let data_dir = data_dir.ok_or("missing the data_dir=DIR mount option")?;
    out.extend(["--data-dir".into(), data_dir.into()]);
    if !etcd_access.is_empty() {
        let m = meta
            .as_mut()
            .filter(|m| m.starts_with("etcd"))
            .ok_or("etcd_* options need an etcd:// or etcds:// source")?;
        m.push(if m.contains('?') { '&' } else { '?' });
        m.push_str(&etcd_access.join("&"));
    }
    if let Some(m) = meta {
        out.extend(["--meta".into(), m.into()]);
    }
    // At boot, an empty data dir is a disk that did not mount: never make a volume of it.
    out.push(if new_node { "--new-node" } else { "--require-identity" }.into());
    if let Some(w) = meta_wait.or(options.contains(&"_netdev").then(|| NETDEV_META_WAIT.to_string())) {
        out.extend(["--meta-wait".into(), w.into()]);
    }
    out.extend(["--source".into(), fsname.into()]);
    Ok(out)
}

/// `mount -o remount,...`: the flags that can change in place, as `converged remount`.
/// Options naming the volume (data_dir=, meta=, ...) cannot change and are ignored, as
/// mount(8) passes the whole fstab line again.
fn remount(mountpoint: &str, options: &[&str]) -> Result<Vec<OsString>, String> {
    let mut out: Vec<OsString> = vec!["converged".into(), "remount".into(), mountpoint.into()];
    for opt in options {
        let flag: &[&str] = match *opt {
            "ro" => &["--read-only"],
            "rw" => &["--read-write"],
            "suid" => &["--suid", "true"],
            "nosuid" => &["--suid", "false"],
            "dev" => &["--dev", "true"],
            "nodev" => &["--dev", "false"],
            "exec" => &["--exec", "true"],
            "noexec" => &["--exec", "false"],
            "noatime" => &["--atime", "noatime"],
            "relatime" => &["--atime", "relatime"],
            "strictatime" => &["--atime", "strictatime"],
            _ => &[],
        };
        out.extend(flag.iter().map(OsString::from));
    }
    Ok(out)
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == DAEMON_ARG) {
        // Re-executed by ourselves as the background daemon.
        let rest = std::iter::once(OsString::from("converged")).chain(args.into_iter().skip(2));
        return converged_fs::cli::main_with(rest, &[DAEMON_ARG.into()]);
    }
    let strings: Result<Vec<String>, _> = args.into_iter().skip(1).map(OsString::into_string).collect();
    let Ok(strings) = strings else {
        eprintln!("mount.converged: arguments must be valid UTF-8");
        return ExitCode::from(1);
    };
    if strings.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match translate(&strings) {
        Ok(argv) => converged_fs::cli::main_with(argv, &[DAEMON_ARG.into()]),
        Err(e) => {
            eprintln!("mount.converged: {e}\n{USAGE}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn fstab_options_translate() {
        let out = translate(&s(&["local", "/mnt/data", "-o", "rw,_netdev,data_dir=/nvme/c,verify_reads"])).unwrap();
        let out: Vec<String> = out.into_iter().map(|o| o.into_string().unwrap()).collect();
        assert_eq!(
            out,
            s(&[
                "converged",
                "mount",
                "/mnt/data",
                "--verify-reads",
                "--data-dir",
                "/nvme/c",
                "--require-identity",
                "--meta-wait",
                "60s",
                "--source",
                "converged:local"
            ])
        );
    }

    #[test]
    fn cluster_fstab_line_translates() {
        // etcd://m1:2379,m2:2379/vol1 /mnt/data converged data_dir=/nvme/c,listen=0.0.0.0:7400,... 0 0
        let opts = "data_dir=/nvme/c,listen=0.0.0.0:7400,tls_dir=/etc/converged/n1,node_id=n1,labels=rack=r1+zone=z2,durability=local";
        let out = translate(&s(&["etcd://m1:2379,m2:2379/vol1", "/mnt/data", "-o", opts])).unwrap();
        let out: Vec<String> = out.into_iter().map(|o| o.into_string().unwrap()).collect();
        let joined = out.join(" ");
        for want in [
            "--listen 0.0.0.0:7400",
            "--tls-dir /etc/converged/n1",
            "--node-id n1",
            "--labels rack=r1,zone=z2",
            "--durability local",
            "--meta etcd://m1:2379,m2:2379/vol1",
        ] {
            assert!(joined.contains(want), "{want} missing from {joined}");
        }
    }

    #[test]
    fn object_store_options_translate() {
        let opts = "data_dir=/nvme/c,object_store=s3://ckpt/run1,s3_endpoint=http://127.0.0.1:9000,backfill_delay=2s,keep_deleted_objects";
        let out = translate(&s(&["local", "/mnt/data", "-o", opts])).unwrap();
        let joined = out.into_iter().map(|o| o.into_string().unwrap()).collect::<Vec<_>>().join(" ");
        for want in [
            "--object-store s3://ckpt/run1",
            "--s3-endpoint http://127.0.0.1:9000",
            "--backfill-delay 2s",
            "--keep-deleted-objects",
        ] {
            assert!(joined.contains(want), "{want} missing from {joined}");
        }
    }

    #[test]
    fn boot_and_security_options_translate() {
        let opts = "data_dir=/nvme/c,ro,suid,nodev,new_node,meta_wait=5m,etcd_ca=/e/ca.pem,etcd_cert=/e/c.pem,etcd_key=/e/c.key,etcd_user=conv,etcd_password_file=/e/pw";
        let out = translate(&s(&["etcds://m1:2379/vol1", "/mnt/data", "-o", opts])).unwrap();
        let joined = out.into_iter().map(|o| o.into_string().unwrap()).collect::<Vec<_>>().join(" ");
        for want in [
            "--read-only",
            "--suid",
            "--new-node",
            "--meta-wait 5m",
            "--meta etcds://m1:2379/vol1?ca=/e/ca.pem&cert=/e/c.pem&key=/e/c.key&user=conv&password_file=/e/pw",
        ] {
            assert!(joined.contains(want), "{want} missing from {joined}");
        }
        assert!(!joined.contains("--dev") && !joined.contains("--require-identity"), "{joined}");
        // mount(8) passes allow_suid and allow_dev (it drops suid and dev); a nosuid on the
        // same line (xfstests' `-o nosuid` over the configured options) wins.
        let joined = |o: &str| {
            translate(&s(&["local", "/mnt", "-o", o]))
                .unwrap()
                .into_iter()
                .map(|o| o.into_string().unwrap())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let j = joined("data_dir=/x,allow_suid,allow_dev");
        assert!(j.contains("--suid") && j.contains("--dev"), "{j}");
        let j = joined("nosuid,data_dir=/x,allow_suid,allow_dev");
        assert!(!j.contains("--suid") && j.contains("--dev"), "{j}");
        let e = translate(&s(&["local", "/mnt", "-o", "data_dir=/x,etcd_user=a"])).unwrap_err();
        assert!(e.contains("etcd"), "{e}");
    }

    #[test]
    fn bad_options_are_refused_with_their_name() {
        let e = translate(&s(&["local", "/mnt", "-o", "data_dir=/x,bogus=1"])).unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        let e = translate(&s(&["local", "/mnt", "-o", "rw"])).unwrap_err();
        assert!(e.contains("data_dir"), "{e}");
        let e = translate(&s(&["nfs-server:/x", "/mnt", "-o", "data_dir=/x"])).unwrap_err();
        assert!(e.contains("neither"), "{e}");
    }
}
