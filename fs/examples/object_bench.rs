//! The object tier's own S3 client, timed on its own: the baseline the
//! object tier benchmark (`bench/object-tier.sh`) compares backfill and
//! first reads with. Same crate, same part size and parallelism.
//!
//!   object_bench put  URI KEY FILE [--s3-endpoint URL]   multipart upload of FILE
//!   object_bench get  URI KEY      [--s3-endpoint URL]   GET the whole object (one request)
//!   object_bench get-ranged URI KEY [--s3-endpoint URL]  64 MiB at a time, each as parallel 8 MiB ranges
//!
//! Prints `bytes seconds` on stdout.

use std::time::Instant;

use converged_fs::objects::{ObjectTier, StoreOptions};

fn main() -> anyhow::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut opts = StoreOptions::default();
    if let Some(i) = args.iter().position(|a| a == "--s3-endpoint") {
        opts.s3_endpoint = Some(args.get(i + 1).cloned().ok_or_else(|| anyhow::anyhow!("--s3-endpoint needs a URL"))?);
        args.drain(i..i + 2);
    }
    let (op, uri, key) = match args.as_slice() {
        [op, uri, key, ..] => (op.as_str(), uri.as_str(), key.as_str()),
        _ => anyhow::bail!("usage: object_bench put|get URI KEY [FILE] [--s3-endpoint URL]"),
    };
    let tier = ObjectTier::open(uri, opts)?;
    let full = tier.home().key(key);
    match op {
        "put" => {
            let path = args.get(3).ok_or_else(|| anyhow::anyhow!("put needs a FILE"))?;
            let file = std::fs::File::open(path)?;
            let size = file.metadata()?.len();
            let t = Instant::now();
            tier.upload(&full, &file, size, &|_, _| true)?;
            println!("{size} {:.3}", t.elapsed().as_secs_f64());
        }
        "get" => {
            let t = Instant::now();
            let data = tier.get_whole(&full)?;
            println!("{} {:.3}", data.len(), t.elapsed().as_secs_f64());
        }
        "get-ranged" => {
            let (size, _, _) = tier.head(None, &full)?;
            let t = Instant::now();
            let mut got = 0;
            // As the mount fetches an object: one 64 MiB chunk at a time, each in parallel ranges.
            for start in (0..size).step_by(64 << 20) {
                got += tier.get_range(None, &full, None, start, (start + (64 << 20)).min(size))?.len();
            }
            println!("{got} {:.3}", t.elapsed().as_secs_f64());
        }
        other => anyhow::bail!("unknown operation {other:?}"),
    }
    Ok(())
}
