//! POSIX ACLs, kept as the xattrs `system.posix_acl_access` and
//! `system.posix_acl_default` in the kernel's format. The kernel checks
//! them (the mount negotiates FUSE_POSIX_ACL); the namespace keeps them
//! consistent with the mode, as a local filesystem does: setting an access
//! ACL sets the mode's group class from its mask, chmod rewrites the ACL's
//! owner, mask and other entries, and a new node under a directory with a
//! default ACL inherits it (masked by the mode it was created with) instead
//! of the umask. Each of these happens in the transaction of its operation.

use crate::error::{MetaError, MetaResult};

pub const ACCESS: &[u8] = b"system.posix_acl_access";
pub const DEFAULT: &[u8] = b"system.posix_acl_default";

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

/// A POSIX ACL, its entries in the kernel's order (by tag, then id).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acl(Vec<Entry>);

impl Acl {
    /// Decode the xattr value, refusing what the kernel would (EINVAL).
    pub fn parse(b: &[u8]) -> MetaResult<Acl> {
        let bad = MetaError::Invalid("not a valid POSIX ACL");
        if b.len() < 4
            || !(b.len() - 4).is_multiple_of(8)
            || u32::from_le_bytes(b[..4].try_into().expect("4 bytes")) != VERSION
        {
            return Err(bad);
        }
        let entries: Vec<Entry> = b[4..]
            .chunks_exact(8)
            .map(|e| Entry {
                tag: u16::from_le_bytes([e[0], e[1]]),
                perm: u16::from_le_bytes([e[2], e[3]]),
                id: u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
            })
            .collect();
        let acl = Acl(entries);
        acl.valid().then_some(acl).ok_or(bad)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = VERSION.to_le_bytes().to_vec();
        for e in &self.0 {
            out.extend_from_slice(&e.tag.to_le_bytes());
            out.extend_from_slice(&e.perm.to_le_bytes());
            out.extend_from_slice(&e.id.to_le_bytes());
        }
        out
    }

    /// As the kernel's posix_acl_valid: one owner, owning group and other
    /// entry, named entries in order without repeats, and a mask whenever
    /// there are named entries.
    fn valid(&self) -> bool {
        let mut prev: Option<(u16, u32)> = None;
        for e in &self.0 {
            if e.perm & !7 != 0 || !matches!(e.tag, USER_OBJ | USER | GROUP_OBJ | GROUP | MASK | OTHER) {
                return false;
            }
            if let Some((tag, id)) = prev {
                let named = matches!(e.tag, USER | GROUP);
                if e.tag < tag || (e.tag == tag && (!named || e.id <= id)) {
                    return false;
                }
            }
            prev = Some((e.tag, e.id));
        }
        let count = |tag| self.0.iter().filter(|e| e.tag == tag).count();
        count(USER_OBJ) == 1
            && count(GROUP_OBJ) == 1
            && count(OTHER) == 1
            && (count(USER) + count(GROUP) == 0 || count(MASK) == 1)
    }

    fn perm_of(&self, tag: u16) -> Option<u16> {
        self.0.iter().find(|e| e.tag == tag).map(|e| e.perm)
    }

    fn set(&mut self, tag: u16, perm: u16) {
        if let Some(e) = self.0.iter_mut().find(|e| e.tag == tag) {
            e.perm = perm & 7;
        }
    }

    /// The rwx bits of the mode this ACL implies: owner, the mask (or the
    /// owning group without one), other.
    pub fn mode_bits(&self) -> u16 {
        let group = self.perm_of(MASK).or(self.perm_of(GROUP_OBJ)).unwrap_or(0);
        (self.perm_of(USER_OBJ).unwrap_or(0) << 6) | (group << 3) | self.perm_of(OTHER).unwrap_or(0)
    }

    /// Whether the mode says all there is (no named entries, no mask): then
    /// no ACL is stored.
    pub fn is_mode(&self) -> bool {
        self.0.iter().all(|e| matches!(e.tag, USER_OBJ | GROUP_OBJ | OTHER))
    }

    /// chmod: the owner, mask (or owning group) and other entries take the
    /// new mode's bits.
    pub fn chmod(&mut self, perm: u16) {
        self.set(USER_OBJ, perm >> 6);
        let group = if self.perm_of(MASK).is_some() { MASK } else { GROUP_OBJ };
        self.set(group, perm >> 3);
        self.set(OTHER, perm);
    }

    /// A new node's access ACL from its directory's default ACL and the mode
    /// it was created with (the kernel's posix_acl_create_masq): each class
    /// is the intersection of both. Returns the ACL (None when the mode
    /// says it all) and the new permission bits.
    pub fn inherit(&self, perm: u16) -> (Option<Acl>, u16) {
        let mut acl = self.clone();
        let mut mode = perm & 0o777;
        for e in acl.0.iter_mut() {
            match e.tag {
                USER_OBJ => {
                    e.perm &= (mode >> 6) & 7;
                    mode = (mode & !0o700) | (e.perm << 6);
                }
                OTHER => {
                    e.perm &= mode & 7;
                    mode = (mode & !0o007) | e.perm;
                }
                _ => {}
            }
        }
        let group = if acl.perm_of(MASK).is_some() { MASK } else { GROUP_OBJ };
        if let Some(e) = acl.0.iter_mut().find(|e| e.tag == group) {
            e.perm &= (mode >> 3) & 7;
            mode = (mode & !0o070) | (e.perm << 3);
        }
        let perm = (perm & !0o777) | mode;
        (if acl.is_mode() { None } else { Some(acl) }, perm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Acl {
        Acl(entries.iter().map(|&(tag, perm, id)| Entry { tag, perm, id }).collect())
    }

    #[test]
    fn round_trips_and_refuses_what_the_kernel_refuses() {
        let a = acl(&[(USER_OBJ, 7, 0), (USER, 5, 1000), (GROUP_OBJ, 5, 0), (MASK, 5, 0), (OTHER, 0, 0)]);
        assert_eq!(Acl::parse(&a.to_bytes()).unwrap(), a);
        let no_mask = acl(&[(USER_OBJ, 7, 0), (USER, 5, 1000), (GROUP_OBJ, 5, 0), (OTHER, 0, 0)]);
        assert!(Acl::parse(&no_mask.to_bytes()).is_err(), "named entries need a mask");
        let twice =
            acl(&[(USER_OBJ, 7, 0), (USER, 5, 9), (USER, 5, 9), (GROUP_OBJ, 5, 0), (MASK, 5, 0), (OTHER, 0, 0)]);
        assert!(Acl::parse(&twice.to_bytes()).is_err(), "a repeated user");
        assert!(Acl::parse(b"\x02\0\0\0\x01").is_err());
        assert!(Acl::parse(&[]).is_err());
    }

    #[test]
    fn mode_follows_the_mask_and_chmod_rewrites_it() {
        let mut a = acl(&[(USER_OBJ, 6, 0), (USER, 7, 1000), (GROUP_OBJ, 4, 0), (MASK, 5, 0), (OTHER, 4, 0)]);
        assert_eq!(a.mode_bits(), 0o654);
        assert!(!a.is_mode());
        a.chmod(0o700);
        assert_eq!(a.mode_bits(), 0o700);
        assert_eq!(a.perm_of(GROUP_OBJ), Some(4), "the owning group keeps its entry under a mask");
        assert!(acl(&[(USER_OBJ, 6, 0), (GROUP_OBJ, 4, 0), (OTHER, 4, 0)]).is_mode());
    }

    #[test]
    fn a_default_acl_is_inherited_masked_by_the_create_mode() {
        let d = acl(&[(USER_OBJ, 7, 0), (USER, 7, 1000), (GROUP_OBJ, 5, 0), (MASK, 7, 0), (OTHER, 5, 0)]);
        let (a, perm) = d.inherit(0o644);
        let a = a.unwrap();
        assert_eq!(perm, 0o644);
        assert_eq!(a.perm_of(MASK), Some(4));
        assert_eq!(a.perm_of(USER), Some(7), "named entries are kept; the mask limits them");
        let plain = acl(&[(USER_OBJ, 7, 0), (GROUP_OBJ, 5, 0), (OTHER, 0, 0)]);
        assert_eq!(plain.inherit(0o2777), (None, 0o2750));
    }
}
