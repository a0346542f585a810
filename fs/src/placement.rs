//! Placement: which nodes hold the replicas of a chunk. The primary copy is
//! always on the writing node; the others are chosen by weighted rendezvous
//! (highest random weight) hashing over the live nodes, spread across
//! failure domains first.
//!
//! Rendezvous hashing gives every (chunk, node) pair a score; the highest
//! scores win. A node joining or leaving only moves the chunks it wins or
//! held, and weighting the score by free space sends proportionally more
//! chunks to emptier disks. Pure functions: no I/O, no clock.

/// A node that may receive a replica.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub id: String,
    /// Relative weight (free bytes of its data disk); at least 1.
    pub weight: f64,
    /// Its failure domain: nodes in one domain may fail together.
    pub domain: String,
}

/// 64-bit mix (splitmix64's finalizer): spreads nearby inputs apart.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// FNV-1a of a node id: stable across processes and versions (unlike std's hasher).
fn hash_id(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// The weighted rendezvous score of `node` for chunk `index` of `ino`:
/// `-weight / ln(u)` with `u` uniform in (0, 1) from the hash, so that a
/// node's chance to win is proportional to its weight.
fn score(ino: u64, index: u32, c: &Candidate) -> f64 {
    let h = mix(mix(ino ^ hash_id(&c.id)).wrapping_add(index as u64));
    let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -c.weight.max(1.0) / u.ln()
}

/// Every candidate, best first, for chunk `index` of `ino`: those in a
/// failure domain not yet used (the primary's counts as used) come first,
/// each domain once; then the rest by score. Callers take as many as they
/// need and fall back along the list when a node does not answer.
pub fn rank(ino: u64, index: u32, primary_domain: &str, candidates: &[Candidate]) -> Vec<Candidate> {
    let mut scored: Vec<(f64, &Candidate)> = candidates.iter().map(|c| (score(ino, index, c), c)).collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
    let mut used = vec![primary_domain.to_string()];
    let mut spread = Vec::new();
    let mut rest = Vec::new();
    for (_, c) in scored {
        if used.contains(&c.domain) {
            rest.push(c.clone());
        } else {
            used.push(c.domain.clone());
            spread.push(c.clone());
        }
    }
    spread.extend(rest);
    spread
}

/// The nodes that should hold chunk `index` of `ino` once balanced: the
/// first `want` of the ranking with no primary, over `candidates` weighted
/// by capacity (not free space, which moves as chunks do). Every node that
/// sees the same candidates computes the same set, and a node joining
/// takes only the chunks it wins.
pub fn ideal(ino: u64, index: u32, want: usize, candidates: &[Candidate]) -> Vec<String> {
    rank(ino, index, "", candidates).into_iter().take(want).map(|c| c.id).collect()
}

/// Rebalance's candidates: live nodes that take copies (no admin state),
/// weighted by the capacity of their data disks, in their failure domains
/// (the value of the `failure_domain` label, or the node alone).
pub fn balance_candidates(
    live: &[converged_metadata::membership::NodeInfo],
    admin: &std::collections::BTreeMap<String, converged_metadata::NodeAdmin>,
    failure_domain: &str,
) -> Vec<Candidate> {
    live.iter()
        .filter(|n| !admin.contains_key(&n.id) && !n.addr.is_empty())
        .map(|n| Candidate {
            id: n.id.clone(),
            weight: n.capacity.max(1) as f64,
            domain: n.labels.get(failure_domain).cloned().unwrap_or_else(|| format!("node:{}", n.id)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, weight: f64, domain: &str) -> Candidate {
        Candidate { id: id.into(), weight, domain: domain.into() }
    }

    #[test]
    fn ranking_is_deterministic_and_covers_every_candidate() {
        let c = vec![node("a", 1e9, "a"), node("b", 1e9, "b"), node("c", 1e9, "c")];
        let r1 = rank(42, 3, "self", &c);
        assert_eq!(r1, rank(42, 3, "self", &c));
        let mut ids: Vec<_> = r1.iter().map(|n| n.id.clone()).collect();
        ids.sort();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    #[test]
    fn distinct_failure_domains_come_first() {
        // Two racks besides the writer's: the first two picks are in r2 and r3
        // whatever the hash says, and never in the writer's rack r1.
        let c = vec![node("a", 1e9, "r1"), node("b", 1e9, "r2"), node("c", 1e9, "r2"), node("d", 1e9, "r3")];
        for ino in 0..200 {
            let r = rank(ino, 0, "r1", &c);
            let mut first_two: Vec<_> = r[..2].iter().map(|n| n.domain.as_str()).collect();
            first_two.sort();
            assert_eq!(first_two, ["r2", "r3"], "ino {ino}: {r:?}");
        }
    }

    #[test]
    fn weights_share_chunks_in_proportion() {
        let c = vec![node("small", 1e9, "x"), node("big", 3e9, "y")];
        let big = (0..20_000).filter(|i| rank(*i, 0, "self", &c)[0].id == "big").count();
        // Expect 3/4 of the first picks on the node with three times the space.
        assert!((14_000..16_000).contains(&big), "big won {big} of 20000");
    }

    #[test]
    fn a_node_leaving_moves_only_its_own_chunks() {
        let all = vec![node("a", 1e9, "a"), node("b", 1e9, "b"), node("c", 1e9, "c"), node("d", 1e9, "d")];
        let without_d: Vec<_> = all.iter().filter(|n| n.id != "d").cloned().collect();
        for ino in 0..2_000 {
            let before = &rank(ino, 0, "self", &all)[0];
            let after = &rank(ino, 0, "self", &without_d)[0];
            if before.id != "d" {
                assert_eq!(before.id, after.id, "ino {ino} moved although its node stayed");
            }
        }
    }
}
