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
            | "noexec"
            | "suid"
            | "nosuid"
            | "dev"
            | "nodev"
            | "atime"
            | "noatime"
            | "relatime"
            | "strictatime"
            | "nodiratime"
            | "async"
            | "loop"
    ) || opt.starts_with("x-")
        || opt.starts_with("comment=")
}

const USAGE: &str = "usage: mount.converged SOURCE MOUNTPOINT [-sfnv] [-o data_dir=DIR[,meta=URI][,verify_reads][,threads=N][,attr_timeout=S][,log_file=F][,node_id=ID]
                                                 [,listen=ADDR,tls_dir=DIR][,labels=K=V+K=V][,replicas=N][,durability=replicated|local][,repair_delay=5m]
                                                 [,object_store=URI,s3_endpoint=URL,backfill_delay=5s,evict_high=90,evict_low=80]
                                                 [,failure_domain=LABEL][,peer_timeout=S][,lease_ttl=S]]
SOURCE is `local` (embedded metadata in the data dir) or a metadata URI such as redb:///nvme/converged/meta.redb
or etcd://m1:2379,m2:2379,m3:2379/vol1 (a cluster volume; options as for `converged mount`)";

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
    let mut out: Vec<OsString> = vec!["converged".into(), "mount".into(), mountpoint.into()];
    let mut data_dir = None;
    let mut meta = None;
    match source.as_str() {
        "local" | "converged" => {}
        s if s.contains("://") || s.starts_with("memory:") => meta = Some(s.to_string()),
        s => return Err(format!("source {s:?} is neither `local` nor a metadata URI (redb:///path)")),
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
            "threads" => out.extend(["--threads".into(), need(value)?.into()]),
            "attr_timeout" => out.extend(["--attr-timeout".into(), need(value)?.into()]),
            "log_file" => out.extend(["--log-file".into(), need(value)?.into()]),
            "node_id" | "listen" | "tls_dir" | "lease_ttl" | "replicas" | "durability" | "failure_domain"
            | "peer_timeout" | "object_store" | "s3_endpoint" | "backfill_delay" | "backfill_workers"
            | "evict_high" | "evict_low" | "metrics" | "object_copy_limit" | "repair_delay" | "repair_bandwidth"
            | "sweep_grace" => out.extend([format!("--{}", key.replace('_', "-")).into(), need(value)?.into()]),
            "keep_deleted_objects" => out.push("--keep-deleted-objects".into()),
            // Commas separate mount options, so labels are joined with `+` here.
            "labels" => out.extend(["--labels".into(), need(value)?.replace('+', ",").into()]),
            "ro" => return Err("read-only mounts are not supported yet".into()),
            _ if ignored(opt) => {}
            _ => return Err(format!("unknown mount option {opt:?}")),
        }
    }
    let data_dir = data_dir.ok_or("missing the data_dir=DIR mount option")?;
    out.extend(["--data-dir".into(), data_dir.into()]);
    if let Some(m) = meta {
        out.extend(["--meta".into(), m.into()]);
    }
    out.extend(["--source".into(), format!("converged:{source}").into()]);
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
    fn bad_options_are_refused_with_their_name() {
        let e = translate(&s(&["local", "/mnt", "-o", "data_dir=/x,bogus=1"])).unwrap_err();
        assert!(e.contains("bogus"), "{e}");
        let e = translate(&s(&["local", "/mnt", "-o", "rw"])).unwrap_err();
        assert!(e.contains("data_dir"), "{e}");
        let e = translate(&s(&["nfs-server:/x", "/mnt", "-o", "data_dir=/x"])).unwrap_err();
        assert!(e.contains("neither"), "{e}");
    }
}
