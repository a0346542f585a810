//! The versioned wire format. Every stream starts with one request frame:
//! `b"CVG"`, a version byte, a big-endian u32 length, then the postcard
//! encoding of a [`Request`]; a write's payload follows the frame. The answer
//! is one response frame, then a read's payload. Decoding checks every
//! length against a limit and never panics on arbitrary bytes.

use serde::{Deserialize, Serialize};

use crate::ChunkRef;

pub const MAGIC: &[u8; 3] = b"CVG";
/// 2: requests name a chunk version ([`ChunkRef`]); replica writes carry a whole chunk.
pub const VERSION: u8 = 2;
/// Frames are small; payloads travel after them.
pub const MAX_FRAME: u32 = 64 << 10;
/// One request moves at most one chunk.
pub const MAX_PAYLOAD: u32 = 64 << 20;
pub const HEADER_LEN: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// `len` bytes of a chunk version, from `at` bytes into the chunk.
    Read {
        chunk: ChunkRef,
        at: u64,
        len: u32,
    },
    /// A whole chunk version: `len` payload bytes follow the frame.
    Write {
        chunk: ChunkRef,
        len: u32,
    },
    Delete {
        ino: u64,
    },
    Checksums {
        chunk: ChunkRef,
        at: u64,
        len: u64,
    },
    /// Fetch chunk `chunk` of `ino` onto the receiving node's SSD (from the
    /// object store or a peer) and record the copy: one node's share of a
    /// distributed stage.
    Stage {
        ino: u64,
        chunk: u32,
    },
    /// A whole chunk version, like `Write`, stored without waiting for
    /// stable storage: a [`Request::Sync`] of it must follow before anyone
    /// counts on the copy.
    WriteUnsynced {
        chunk: ChunkRef,
        len: u32,
    },
    /// Put chunk versions of `ino` this node received unsynced (in this
    /// daemon's lifetime) on stable storage; fails for any it cannot vouch for.
    Sync {
        ino: u64,
        versions: Vec<(u32, u64)>,
    },
    /// Commit what the receiving node acknowledged in directory `dir` and
    /// give up its delegation of it (`--nowsync`): the sender is about to
    /// read or change the directory's names.
    Recall {
        dir: u64,
    },
    /// A whole chunk version, as `Write` (`durable`) or `WriteUnsynced`,
    /// of a file the sender made in directory `dir`, which is delegated to
    /// it (`--nowsync`), and whose create it has not committed yet: the
    /// receiver checks that delegation instead of the file's records.
    WriteMade {
        chunk: ChunkRef,
        len: u32,
        durable: bool,
        dir: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    /// `len` payload bytes follow the frame.
    Data {
        len: u32,
    },
    Done,
    Checksums {
        crcs: Vec<u32>,
    },
    Error {
        errno: i32,
        msg: String,
    },
    /// A [`Request::Recall`] done: the metadata holds every change of the
    /// directory at or after this revision.
    Released {
        revision: i64,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("frame does not start with the converged magic")]
    BadMagic,
    #[error("wire version {0} is not supported (this node speaks {VERSION})")]
    Version(u8),
    #[error("frame of {0} bytes is larger than the {MAX_FRAME}-byte limit")]
    TooLarge(u32),
    #[error("payload of {0} bytes is larger than the {MAX_PAYLOAD}-byte limit")]
    PayloadTooLarge(u32),
    #[error("truncated frame")]
    Truncated,
    #[error("undecodable frame: {0}")]
    Decode(String),
}

fn encode<T: Serialize>(msg: &T) -> Vec<u8> {
    let body = postcard::to_allocvec(msg).expect("wire messages always serialize");
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

/// Check a frame header; returns the body length that follows.
pub fn parse_header(h: &[u8]) -> Result<u32, WireError> {
    if h.len() < HEADER_LEN {
        return Err(WireError::Truncated);
    }
    if &h[..3] != MAGIC {
        return Err(WireError::BadMagic);
    }
    if h[3] != VERSION {
        return Err(WireError::Version(h[3]));
    }
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    Ok(len)
}

fn decode_body<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, WireError> {
    postcard::from_bytes(body).map_err(|e| WireError::Decode(e.to_string()))
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }

    /// Decode a whole frame (header and body) and check its limits.
    pub fn decode(frame: &[u8]) -> Result<Self, WireError> {
        let len = parse_header(frame)? as usize;
        let body = frame.get(HEADER_LEN..HEADER_LEN + len).ok_or(WireError::Truncated)?;
        let req: Request = decode_body(body)?;
        req.check()?;
        Ok(req)
    }

    pub fn check(&self) -> Result<(), WireError> {
        match *self {
            Request::Read { len, .. }
            | Request::Write { len, .. }
            | Request::WriteUnsynced { len, .. }
            | Request::WriteMade { len, .. }
                if len > MAX_PAYLOAD =>
            {
                Err(WireError::PayloadTooLarge(len))
            }
            Request::Checksums { len, .. } if len > MAX_PAYLOAD as u64 => Err(WireError::PayloadTooLarge(u32::MAX)),
            _ => Ok(()),
        }
    }
}

impl Response {
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }

    pub fn decode(frame: &[u8]) -> Result<Self, WireError> {
        let len = parse_header(frame)? as usize;
        let body = frame.get(HEADER_LEN..HEADER_LEN + len).ok_or(WireError::Truncated)?;
        let resp: Response = decode_body(body)?;
        if let Response::Data { len } = resp {
            if len > MAX_PAYLOAD {
                return Err(WireError::PayloadTooLarge(len));
            }
        }
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn chunk() -> impl Strategy<Value = ChunkRef> {
        (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(ino, index, version, start)| ChunkRef {
            ino,
            index,
            version,
            start,
        })
    }

    fn request() -> impl Strategy<Value = Request> {
        prop_oneof![
            (chunk(), any::<u64>(), 0..=MAX_PAYLOAD).prop_map(|(chunk, at, len)| Request::Read { chunk, at, len }),
            (chunk(), 0..=MAX_PAYLOAD).prop_map(|(chunk, len)| Request::Write { chunk, len }),
            (chunk(), 0..=MAX_PAYLOAD).prop_map(|(chunk, len)| Request::WriteUnsynced { chunk, len }),
            (chunk(), 0..=MAX_PAYLOAD, any::<bool>(), any::<u64>())
                .prop_map(|(chunk, len, durable, dir)| Request::WriteMade { chunk, len, durable, dir }),
            (any::<u64>(), proptest::collection::vec(any::<(u32, u64)>(), 0..8))
                .prop_map(|(ino, versions)| Request::Sync { ino, versions }),
            any::<u64>().prop_map(|ino| Request::Delete { ino }),
            (any::<u64>(), any::<u32>()).prop_map(|(ino, chunk)| Request::Stage { ino, chunk }),
            (chunk(), any::<u64>(), 0..=MAX_PAYLOAD as u64).prop_map(|(chunk, at, len)| Request::Checksums {
                chunk,
                at,
                len
            }),
        ]
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Request::decode(&bytes);
            let _ = Response::decode(&bytes);
        }

        #[test]
        fn decoding_mangled_frames_never_panics(req in request(), flip in 0usize..64, val in any::<u8>(), cut in 0usize..64) {
            let mut frame = req.encode();
            let i = flip % frame.len();
            frame[i] = val;
            frame.truncate(frame.len().saturating_sub(cut % 8));
            let _ = Request::decode(&frame);
        }

        #[test]
        fn requests_round_trip(req in request()) {
            prop_assert_eq!(Request::decode(&req.encode()).unwrap(), req);
        }
    }

    #[test]
    fn limits_and_versions_are_enforced() {
        let mut f = Request::Delete { ino: 1 }.encode();
        f[3] = 9;
        assert_eq!(Request::decode(&f), Err(WireError::Version(9)));
        let mut f = Request::Delete { ino: 1 }.encode();
        f[0] = b'X';
        assert_eq!(Request::decode(&f), Err(WireError::BadMagic));
        let mut f = Request::Delete { ino: 1 }.encode();
        f[4..8].copy_from_slice(&(MAX_FRAME + 1).to_be_bytes());
        assert_eq!(Request::decode(&f), Err(WireError::TooLarge(MAX_FRAME + 1)));
        let chunk = ChunkRef { ino: 1, index: 0, version: 1, start: 0 };
        let f = Request::Read { chunk, at: 0, len: MAX_PAYLOAD + 1 }.encode();
        assert_eq!(Request::decode(&f), Err(WireError::PayloadTooLarge(MAX_PAYLOAD + 1)));
    }
}
