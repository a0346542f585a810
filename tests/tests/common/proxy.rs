//! A TCP forwarder on 127.0.0.1 in front of a server, which a test can cut
//! (every connection reset, new ones refused) and restore: a network
//! partition between converged and its object store, while the store
//! itself keeps what it holds. Or stall: connections stay open and bytes
//! are held, in both directions, until it is restored (a network that
//! drops packets without a reset, where a request hangs until its
//! deadline).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    stalled: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// Forward connections to `target` (`host:port`).
    pub fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let stalled = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (c, cs, st) = (cut.clone(), conns.clone(), stalled.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if c.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else { continue };
                for s in [&client, &server] {
                    if let Ok(s) = s.try_clone() {
                        cs.lock().unwrap().push(s);
                    }
                }
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), st.clone());
                pipe(server, client, st.clone());
            }
        });
        Proxy { addr, cut, stalled, conns }
    }

    /// Where it listens (`host:port`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The partition: every open connection is reset, new ones are closed at once.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// The hang: connections stay open, new ones are taken, and no byte
    /// crosses in either direction until [`Proxy::restore`].
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }

    /// Ends a cut or a stall (what a stall held goes on its way).
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
        self.stalled.store(false, Ordering::SeqCst);
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, stalled: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    while stalled.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
