//! Import: objects under a bucket prefix appear as files without copying.
//!
//! `converged import URL DIR` sets `user.converged.import` on the
//! directory; the first lookup or readdir lists one level of keys and
//! records each object as a backed file (size, mtime, ETag, no chunk on any
//! SSD) and each common prefix as a directory listed the same way later.
//! Keys that are not valid POSIX names are skipped and reported; bytes are
//! fetched by the read path, never here.

use converged_metadata::types::*;
use converged_metadata::{ImportEntry, MetaError};

use super::backfill::key_of;
use crate::core::Core;
use crate::error::{FsError, FsResult};
use crate::objects::Location;

/// Entries per metadata transaction: etcd allows 128 operations, an entry takes three.
const ENTRIES_PER_TXN: usize = 32;

/// Why a key (one path component of it) cannot be a file name here, if it cannot.
pub fn invalid_name(component: &str) -> Option<&'static str> {
    if component.is_empty() {
        Some("empty path component")
    } else if component == "." || component == ".." {
        Some("`.` or `..` component")
    } else if component.len() > NAME_MAX {
        Some("component longer than 255 bytes")
    } else if component.contains('\0') {
        Some("NUL byte")
    } else {
        None
    }
}

/// Why a whole key below an import prefix cannot become a path, if it cannot.
pub fn invalid_key(rel: &str) -> Option<&'static str> {
    let rel = rel.strip_suffix('/').unwrap_or(rel);
    rel.split('/').find_map(invalid_name)
}

impl Core {
    /// `setxattr user.converged.import URL` on a directory: check the URL and
    /// that the store answers, then record it (listed on first access).
    pub(crate) fn start_import(&self, dir: Ino, value: &[u8], mode: XattrMode) -> FsResult<()> {
        let t = self.tiering().ok_or(FsError::NotSupported("import needs a mount with --object-store"))?;
        if !self.namespace().getattr(dir)?.is_dir() {
            return Err(MetaError::NotDir.into());
        }
        let url = std::str::from_utf8(value).map_err(|_| FsError::Invalid("import URL is not UTF-8"))?.trim();
        let loc = Location::parse(url).map_err(|e| {
            tracing::warn!(error = %e, "import refused");
            FsError::Invalid("import URL is not a valid object store location")
        })?;
        t.objects.probe(&loc)?;
        self.namespace().setxattr(dir, IMPORT_XATTR, loc.url().as_bytes(), mode)?;
        tracing::info!(dir, source = %loc.url(), "import recorded; listed on first access");
        Ok(())
    }

    /// List an imported directory that has not been listed yet. Returns
    /// whether it did (so a lookup that missed may look again).
    pub(crate) fn materialize(&self, dir: Ino) -> FsResult<bool> {
        let Some(t) = self.tiering() else { return Ok(false) };
        let pending = |c: &Core| match c.namespace().getxattr(dir, IMPORT_XATTR) {
            Ok(v) => Ok(Some(v)),
            Err(MetaError::NoAttr | MetaError::NotFound | MetaError::NotDir) => Ok(None),
            Err(e) => Err(FsError::from(e)),
        };
        if pending(self)?.is_none() {
            return Ok(false);
        }
        // One listing per directory at a time; the others wait for it.
        let lock = t.fetching.entry((dir, u32::MAX)).or_default().clone();
        let _one = lock.lock();
        let Some(url) = pending(self)? else { return Ok(true) };
        let url = String::from_utf8_lossy(&url).into_owned();
        let loc = Location::parse(&url)?;
        let prefix = if loc.prefix.is_empty() { String::new() } else { format!("{}/", loc.prefix) };
        let listing = t.objects.list_level(&loc.base, &prefix)?;
        let home = t.objects.home();
        // Objects already at this directory's own key in the mount's store
        // are the files' own objects, not a foreign source.
        let native_prefix = match key_of(self, dir)? {
            Some(p) if loc.base == home.base => Some(home.key(&p)),
            _ => None,
        };
        let dir_inode = self.namespace().getattr(dir)?;
        let mut entries = Vec::new();
        let mut names = std::collections::HashSet::new();
        let mut skipped = 0usize;
        let mut skip = |key: &str, why: &str| {
            skipped += 1;
            tracing::warn!(key, why, "import: skipped a key that is not a valid POSIX name");
        };
        for (key, size, mtime, etag) in &listing.objects {
            let name = key.strip_prefix(&prefix).unwrap_or(key);
            if name.is_empty() {
                // The directory marker object (`prefix/`) some tools write.
                continue;
            }
            if let Some(why) = invalid_name(name) {
                skip(key, why);
                continue;
            }
            if !names.insert(name.to_string()) {
                skip(key, "duplicate name");
                continue;
            }
            let native = native_prefix.as_deref().is_some_and(|p| loc.prefix == p);
            let (key, source) = match (native, &home.prefix) {
                (true, hp) if hp.is_empty() => (key.clone(), None),
                (true, hp) => (key.strip_prefix(&format!("{hp}/")).unwrap_or(key).to_string(), None),
                (false, _) => (key.clone(), Some(loc.base.clone())),
            };
            entries.push(ImportEntry::File {
                name: name.as_bytes().to_vec(),
                size: *size,
                mtime: Timespec { sec: *mtime, nsec: 0 },
                key,
                etag: etag.clone(),
                source,
            });
        }
        for p in &listing.prefixes {
            let name = p.strip_prefix(&prefix).unwrap_or(p).trim_end_matches('/');
            if let Some(why) = invalid_name(name) {
                skip(p, why);
                continue;
            }
            if !names.insert(name.to_string()) {
                skip(p, "a file has the same name");
                continue;
            }
            let url = format!("{}/{}", loc.base, p.trim_end_matches('/'));
            entries.push(ImportEntry::Dir { name: name.as_bytes().to_vec(), url });
        }
        let mut made = 0;
        for batch in entries.chunks(ENTRIES_PER_TXN) {
            made += self.namespace().import_entries(dir, batch, dir_inode.uid, dir_inode.gid)?;
        }
        match self.namespace().removexattr(dir, IMPORT_XATTR) {
            Ok(()) | Err(MetaError::NoAttr) => {}
            Err(e) => return Err(e.into()),
        }
        tracing::info!(dir, source = %url, entries = made, skipped, "imported one directory level");
        Ok(true)
    }

    /// At lookup and before a read-only open of an imported file with
    /// chunks still to fetch: if its object changed in the bucket (new
    /// ETag), take the new size and bytes instead of mixing old and new.
    /// Once a second per file at most. Returns whether it refreshed.
    pub(crate) fn check_import(&self, ino: Ino) -> FsResult<bool> {
        let Some(t) = self.tiering() else { return Ok(false) };
        let Some(rec) = self.namespace().tier(ino)? else { return Ok(false) };
        let Some(source) = rec.source.as_deref() else { return Ok(false) };
        if rec.state != TierState::Backed {
            return Ok(false);
        }
        let now = Timespec::now().sec;
        if t.checked.get(&ino).is_some_and(|at| *at >= now - 1) {
            return Ok(false);
        }
        let inode = self.namespace().getattr(ino)?;
        let cs = inode.chunk_size.max(1) as u64;
        let chunks = self.namespace().chunks(ino)?;
        let all_here = chunks.len() as u64 == inode.size.div_ceil(cs) && chunks.iter().all(|(_, r)| self.is_local(r));
        if all_here {
            return Ok(false);
        }
        let (size, mtime, etag) = t.objects.head(Some(source), &rec.key)?;
        t.checked.insert(ino, now);
        if etag == rec.etag && size == inode.size {
            return Ok(false);
        }
        tracing::warn!(ino, key = %rec.key, old = ?rec.etag, new = ?etag, "imported object changed in its bucket; refreshing");
        self.namespace().refresh_import(ino, size, Timespec { sec: mtime, nsec: 0 }, etag)?;
        self.chunk_store().open_backing(ino)?.set_len(0).map_err(|e| FsError::io("drop stale imported bytes", e))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_are_not_posix_names() {
        assert_eq!(invalid_key("a/b/c.bin"), None);
        assert_eq!(invalid_key("dir/"), None);
        assert!(invalid_key("a//b").is_some());
        assert!(invalid_key("a/./b").is_some());
        assert!(invalid_key("../x").is_some());
        assert!(invalid_key(&"x".repeat(256)).is_some());
        assert_eq!(invalid_key(&"x".repeat(255)), None);
    }
}
