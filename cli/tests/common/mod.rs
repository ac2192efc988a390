//! What the command-line tests share: `tessera serve` started on a free
//! port, and raw HTTP requests to it. (Each test file uses part of it.)
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// A `tessera serve` process and the address it printed.
pub struct Served {
    pub child: std::process::Child,
    pub addr: String,
    pub stderr: std::io::BufReader<std::process::ChildStderr>,
}

/// A test that fails must not leave its server running (holding the test
/// harness's output open).
impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `tessera serve --model dir args` on a free port of 127.0.0.1,
/// once it says where it listens.
pub fn serve(dir: &Path, args: &[&str]) -> Served {
    use std::io::BufRead as _;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["serve", "--port", "0", "--model"])
        .arg(dir)
        .args(args)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("http://") {
        line.clear();
        if stderr.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tessera serve ended before listening");
        }
    }
    let addr = line.split("http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    Served { child, addr, stderr }
}

/// One HTTP/1.1 request; returns the status and the raw body (chunks left in).
pub fn http(addr: &str, method: &str, path: &str, body: &str, key: Option<&str>) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    (head.split(' ').nth(1).unwrap().parse().unwrap(), body.to_string())
}
