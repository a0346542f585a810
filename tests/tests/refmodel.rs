//! Reference-model test: random sequences of namespace and data operations
//! run on a real mount and on a plain in-memory model. Every operation must
//! give the same result (success or the same errno), and the trees and bytes
//! must match, including after remounts.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

type Ino = u64;

#[derive(Clone, Debug, PartialEq)]
enum Node {
    Dir(BTreeMap<String, Ino>),
    File(Vec<u8>),
    /// Targets never exist, so following a symlink always finds nothing.
    Symlink(String),
}

/// The model: inodes by number; the root is inode 0.
struct Model {
    nodes: BTreeMap<Ino, Node>,
    next: Ino,
}

type R<T> = Result<T, i32>;

impl Model {
    fn new() -> Self {
        Model { nodes: BTreeMap::from([(0, Node::Dir(BTreeMap::new()))]), next: 1 }
    }

    fn dir(&self, ino: Ino) -> &BTreeMap<String, Ino> {
        match &self.nodes[&ino] {
            Node::Dir(d) => d,
            _ => unreachable!(),
        }
    }

    fn dir_mut(&mut self, ino: Ino) -> &mut BTreeMap<String, Ino> {
        match self.nodes.get_mut(&ino).unwrap() {
            Node::Dir(d) => d,
            _ => unreachable!(),
        }
    }

    /// Resolve the parent directory of `path` (components are followed).
    fn parent(&self, path: &str) -> R<(Ino, String)> {
        let mut parts: Vec<&str> = path.split('/').collect();
        let name = parts.pop().unwrap().to_string();
        let mut cur = 0;
        for p in parts {
            let Some(&next) = self.dir(cur).get(p) else { return Err(libc::ENOENT) };
            match &self.nodes[&next] {
                Node::Dir(_) => cur = next,
                Node::File(_) => return Err(libc::ENOTDIR),
                Node::Symlink(_) => return Err(libc::ENOENT),
            }
        }
        Ok((cur, name))
    }

    fn lookup(&self, path: &str) -> R<Option<Ino>> {
        let (p, name) = self.parent(path)?;
        Ok(self.dir(p).get(&name).copied())
    }

    fn links(&self, ino: Ino) -> usize {
        self.nodes
            .values()
            .filter_map(|n| if let Node::Dir(d) = n { Some(d) } else { None })
            .flat_map(|d| d.values())
            .filter(|i| **i == ino)
            .count()
    }

    fn new_node(&mut self, n: Node) -> Ino {
        let ino = self.next;
        self.next += 1;
        self.nodes.insert(ino, n);
        ino
    }

    fn gc(&mut self, ino: Ino) {
        if self.links(ino) == 0 {
            self.nodes.remove(&ino);
        }
    }

    fn create(&mut self, path: &str, data: &[u8]) -> R<()> {
        let (p, name) = self.parent(path)?;
        if self.dir(p).contains_key(&name) {
            return Err(libc::EEXIST);
        }
        let ino = self.new_node(Node::File(data.to_vec()));
        self.dir_mut(p).insert(name, ino);
        Ok(())
    }

    fn file_for_write(&mut self, path: &str) -> R<&mut Vec<u8>> {
        let ino = self.lookup(path)?.ok_or(libc::ENOENT)?;
        match self.nodes.get_mut(&ino).unwrap() {
            Node::File(d) => Ok(d),
            Node::Dir(_) => Err(libc::EISDIR),
            Node::Symlink(_) => Err(libc::ENOENT),
        }
    }

    fn write(&mut self, path: &str, off: usize, data: &[u8]) -> R<()> {
        let f = self.file_for_write(path)?;
        if f.len() < off + data.len() {
            f.resize(off + data.len(), 0);
        }
        f[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn truncate(&mut self, path: &str, len: usize) -> R<()> {
        self.file_for_write(path)?.resize(len, 0);
        Ok(())
    }

    fn mkdir(&mut self, path: &str) -> R<()> {
        let (p, name) = self.parent(path)?;
        if self.dir(p).contains_key(&name) {
            return Err(libc::EEXIST);
        }
        let ino = self.new_node(Node::Dir(BTreeMap::new()));
        self.dir_mut(p).insert(name, ino);
        Ok(())
    }

    fn symlink(&mut self, target: &str, path: &str) -> R<()> {
        let (p, name) = self.parent(path)?;
        if self.dir(p).contains_key(&name) {
            return Err(libc::EEXIST);
        }
        let ino = self.new_node(Node::Symlink(target.into()));
        self.dir_mut(p).insert(name, ino);
        Ok(())
    }

    fn unlink(&mut self, path: &str) -> R<()> {
        let (p, name) = self.parent(path)?;
        let ino = *self.dir(p).get(&name).ok_or(libc::ENOENT)?;
        if matches!(self.nodes[&ino], Node::Dir(_)) {
            return Err(libc::EISDIR);
        }
        self.dir_mut(p).remove(&name);
        self.gc(ino);
        Ok(())
    }

    fn rmdir(&mut self, path: &str) -> R<()> {
        let (p, name) = self.parent(path)?;
        let ino = *self.dir(p).get(&name).ok_or(libc::ENOENT)?;
        match &self.nodes[&ino] {
            Node::Dir(d) if !d.is_empty() => return Err(libc::ENOTEMPTY),
            Node::Dir(_) => {}
            _ => return Err(libc::ENOTDIR),
        }
        self.dir_mut(p).remove(&name);
        self.nodes.remove(&ino);
        Ok(())
    }

    fn link(&mut self, from: &str, to: &str) -> R<()> {
        let src = self.lookup(from)?.ok_or(libc::ENOENT)?;
        let (p, name) = self.parent(to)?;
        if self.dir(p).contains_key(&name) {
            return Err(libc::EEXIST);
        }
        if matches!(self.nodes[&src], Node::Dir(_)) {
            return Err(libc::EPERM);
        }
        self.dir_mut(p).insert(name, src);
        Ok(())
    }

    /// Linux's order of checks for rename(2).
    fn rename(&mut self, from: &str, to: &str) -> R<()> {
        let (sp, sname) = self.parent(from)?;
        let (dp, dname) = self.parent(to)?;
        let src = *self.dir(sp).get(&sname).ok_or(libc::ENOENT)?;
        let src_dir = matches!(self.nodes[&src], Node::Dir(_));
        if from == to {
            return Ok(());
        }
        if to.starts_with(&format!("{from}/")) {
            return Err(libc::EINVAL);
        }
        let dst = self.dir(dp).get(&dname).copied();
        if from.starts_with(&format!("{to}/")) && dst.is_some() {
            return Err(libc::ENOTEMPTY);
        }
        if let Some(dst) = dst {
            if dst == src {
                return Ok(());
            }
            match (src_dir, &self.nodes[&dst]) {
                (true, Node::Dir(d)) if !d.is_empty() => return Err(libc::ENOTEMPTY),
                (true, Node::Dir(_)) => {}
                (true, _) => return Err(libc::ENOTDIR),
                (false, Node::Dir(_)) => return Err(libc::EISDIR),
                (false, _) => {}
            }
        }
        self.dir_mut(sp).remove(&sname);
        if let Some(old) = self.dir_mut(dp).insert(dname, src) {
            self.gc(old);
        }
        Ok(())
    }

    /// path -> description (kind, size and checksum of the bytes, links).
    fn tree(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let mut stack = vec![(0, String::new())];
        while let Some((ino, prefix)) = stack.pop() {
            for (name, child) in self.dir(ino) {
                let path = format!("{prefix}{name}");
                let node = match &self.nodes[child] {
                    Node::Dir(_) => {
                        stack.push((*child, format!("{path}/")));
                        Node::Dir(BTreeMap::new())
                    }
                    other => other.clone(),
                };
                let links = if matches!(node, Node::File(_)) { self.links(*child) } else { 1 };
                out.insert(path, describe(&node, links));
            }
        }
        out
    }
}

/// One line per entry, so a mismatch prints readably.
fn describe(node: &Node, links: usize) -> String {
    match node {
        Node::Dir(_) => "dir".into(),
        Node::File(d) => format!("file {} bytes fnv {:08x} links {links}", d.len(), crc(d)),
        Node::Symlink(t) => format!("symlink -> {t}"),
    }
}

fn crc(d: &[u8]) -> u32 {
    // FNV-1a: enough to tell contents apart in a failure message.
    d.iter().fold(0x811c9dc5u32, |h, b| (h ^ *b as u32).wrapping_mul(0x01000193))
}

fn real_tree(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let path = e.path();
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let md = fs::symlink_metadata(&path).unwrap();
            let entry = if md.is_dir() {
                stack.push(path);
                (Node::Dir(BTreeMap::new()), 1)
            } else if md.file_type().is_symlink() {
                (Node::Symlink(fs::read_link(&path).unwrap().to_string_lossy().into_owned()), 1)
            } else {
                (Node::File(fs::read(&path).unwrap()), md.nlink() as usize)
            };
            out.insert(rel, describe(&entry.0, entry.1));
        }
    }
    out
}

fn errno_of<T>(r: std::io::Result<T>) -> R<()> {
    r.map(|_| ()).map_err(|e| e.raw_os_error().unwrap_or(-1))
}

const NAMES: [&str; 4] = ["a", "b", "c", "d"];

fn random_path(rng: &mut StdRng) -> String {
    let depth = rng.random_range(1..=3);
    (0..depth).map(|_| NAMES[rng.random_range(0..NAMES.len())]).collect::<Vec<_>>().join("/")
}

fn run_sequence(seed: u64, ops: usize, verify_reads: bool) {
    let mut m = if verify_reads { Mount::with_args(&["--verify-reads"]) } else { Mount::new() };
    let mut model = Model::new();
    let mut rng = StdRng::seed_from_u64(seed);
    for step in 0..ops {
        let p = random_path(&mut rng);
        let full = m.path(&p);
        let (desc, want, got) = match rng.random_range(0..100) {
            0..=19 => {
                let len = [0, 1, 100, 70_000, 200_000][rng.random_range(0..5)];
                let data = pattern(len, rng.random());
                let got = errno_of(
                    OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o644)
                        .open(&full)
                        .and_then(|f| f.write_all_at(&data, 0)),
                );
                ("create", model.create(&p, &data), got)
            }
            20..=34 => {
                let off = rng.random_range(0..150_000);
                let data = pattern(rng.random_range(1..80_000), rng.random());
                let got = errno_of(
                    OpenOptions::new().write(true).open(&full).and_then(|f| f.write_all_at(&data, off as u64)),
                );
                ("write", model.write(&p, off, &data), got)
            }
            35..=41 => {
                let len = rng.random_range(0..250_000);
                let got = errno_of(OpenOptions::new().write(true).open(&full).and_then(|f| f.set_len(len as u64)));
                ("truncate", model.truncate(&p, len), got)
            }
            42..=56 => ("mkdir", model.mkdir(&p), errno_of(fs::create_dir(&full))),
            57..=63 => ("rmdir", model.rmdir(&p), errno_of(fs::remove_dir(&full))),
            64..=72 => ("unlink", model.unlink(&p), errno_of(fs::remove_file(&full))),
            73..=87 => {
                let to = random_path(&mut rng);
                let d = format!("rename {p} -> {to}");
                let got = errno_of(fs::rename(&full, m.path(&to)));
                return_if_mismatch(seed, step, &d, model.rename(&p, &to), got);
                continue;
            }
            88..=93 => {
                let to = random_path(&mut rng);
                let d = format!("link {p} -> {to}");
                let got = errno_of(fs::hard_link(&full, m.path(&to)));
                return_if_mismatch(seed, step, &d, model.link(&p, &to), got);
                continue;
            }
            94..=97 => {
                let target = format!("t{}", rng.random_range(0..4));
                ("symlink", model.symlink(&target, &p), errno_of(std::os::unix::fs::symlink(&target, &full)))
            }
            _ => {
                m.umount();
                m.mount();
                drop_caches();
                continue;
            }
        };
        return_if_mismatch(seed, step, &format!("{desc} {p}"), want, got);
        if step % 50 == 49 {
            assert_eq!(real_tree(&m.mnt), model.tree(), "seed {seed} step {step}: trees differ");
        }
    }
    assert_eq!(real_tree(&m.mnt), model.tree(), "seed {seed}: trees differ at the end");
    m.umount();
    m.mount();
    drop_caches();
    assert_eq!(real_tree(&m.mnt), model.tree(), "seed {seed}: trees differ after remount");
}

fn return_if_mismatch(seed: u64, step: usize, what: &str, want: R<()>, got: R<()>) {
    assert_eq!(got, want, "seed {seed} step {step}: {what}: filesystem gave {got:?}, model expects {want:?}");
}

#[test]
fn random_operations_match_the_model() {
    let seeds: Vec<u64> = match std::env::var("REFMODEL_SEED") {
        Ok(s) => vec![s.parse().expect("REFMODEL_SEED is a number")],
        Err(_) => vec![1, 2, 3, 4],
    };
    for seed in seeds {
        run_sequence(seed, 400, false);
    }
}

#[test]
fn random_operations_match_the_model_on_the_daemon_read_path() {
    for seed in [101, 102] {
        run_sequence(seed, 300, true);
    }
}
