//! Forwarding a rank's stdout and stderr to the launcher's, line by line.
//!
//! One thread per pipe reads whole lines and writes each one, prefix
//! included, with a single `write_all` under the lock of the launcher's
//! stream: two ranks' lines may alternate but never mix inside a line.
//! Reading goes on until end of file, which comes when every process holding
//! the pipe (the rank and whatever it started) has exited, so nothing a rank
//! wrote just before exiting is lost.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// The longest line kept whole. A longer one (a progress bar redrawn with
/// `\r`, a huge log record) is cut here and its pieces forwarded as lines of
/// their own, so a rank cannot make the launcher buffer without bound.
const MAX_LINE: usize = 1 << 20;

/// The launcher's stream a pipe is forwarded to.
#[derive(Clone, Copy)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Starts a thread forwarding `pipe` to `stream`, each line led by `prefix`.
pub fn forward(pipe: impl Read + Send + 'static, stream: Stream, prefix: Vec<u8>, name: String) -> io::Result<JoinHandle<()>> {
    thread::Builder::new().name(name).spawn(move || {
        let reader = BufReader::with_capacity(64 * 1024, pipe);
        // When the launcher's own stream is gone (a closed pipe), the rank's
        // output is still read and dropped: a rank must never block on a full
        // pipe because nobody reads it.
        let mut open = true;
        pump(reader, &prefix, MAX_LINE, |line| {
            if open {
                open = write_line(stream, line).is_ok();
            }
        });
    })
}

fn write_line(stream: Stream, line: &[u8]) -> io::Result<()> {
    match stream {
        Stream::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(line)?;
            out.flush()
        }
        Stream::Stderr => io::stderr().lock().write_all(line),
    }
}

/// Reads `reader` to its end and hands `emit` each line with `prefix` before
/// it and a newline after it, also when the last line had none.
pub fn pump(mut reader: impl BufRead, prefix: &[u8], max_line: usize, mut emit: impl FnMut(&[u8])) {
    let mut line = Vec::with_capacity(prefix.len() + 256);
    loop {
        line.clear();
        line.extend_from_slice(prefix);
        // A read error on a pipe means the rank's end is unusable; what was
        // read so far is still forwarded, and the next read ends the loop.
        let complete = read_line(&mut reader, &mut line, max_line).unwrap_or(false);
        if line.len() == prefix.len() {
            return;
        }
        if !complete {
            line.push(b'\n');
        }
        emit(&line);
    }
}

/// Appends bytes up to and including the next newline, or up to `max`
/// bytes, or to the end of input; true when it stopped at a newline.
fn read_line(reader: &mut impl BufRead, line: &mut Vec<u8>, max: usize) -> io::Result<bool> {
    let mut taken = 0;
    loop {
        let buf = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            return Ok(false);
        }
        let room = max - taken;
        // One byte past the room: a line of exactly `max` bytes keeps its newline.
        let window = &buf[..buf.len().min(room + 1)];
        match window.iter().position(|&b| b == b'\n') {
            Some(i) => {
                line.extend_from_slice(&window[..=i]);
                reader.consume(i + 1);
                return Ok(true);
            }
            None => {
                let n = window.len().min(room);
                line.extend_from_slice(&window[..n]);
                reader.consume(n);
                taken += n;
                if taken == max {
                    return Ok(false);
                }
            }
        }
    }
}

/// Waits until every thread in `threads` has finished, or until `deadline`;
/// joins those that finished and gives back the others. A rank that left a
/// process holding its pipe (one that moved to another session, out of the
/// launcher's reach) must not keep the launcher from reporting and exiting.
pub fn join_until(threads: Vec<JoinHandle<()>>, deadline: Instant) -> Vec<JoinHandle<()>> {
    while Instant::now() < deadline && !threads.iter().all(|t| t.is_finished()) {
        thread::sleep(Duration::from_millis(5));
    }
    let (done, running): (Vec<_>, Vec<_>) = threads.into_iter().partition(|t| t.is_finished());
    for t in done {
        // A forwarding thread only panics if writing panicked; its output is
        // lost either way, and the job's result does not depend on it.
        let _ = t.join();
    }
    running
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], prefix: &str, max: usize) -> Vec<String> {
        let mut out = Vec::new();
        pump(input, prefix.as_bytes(), max, |l| out.push(String::from_utf8_lossy(l).into_owned()));
        out
    }

    #[test]
    fn every_line_is_prefixed_and_the_last_one_is_ended() {
        assert_eq!(lines(b"a\nbc\n\nd", "[rank 1] ", MAX_LINE), ["[rank 1] a\n", "[rank 1] bc\n", "[rank 1] \n", "[rank 1] d\n"]);
        assert_eq!(lines(b"", "[rank 1] ", MAX_LINE), Vec::<String>::new());
        assert_eq!(lines(b"x\n", "", MAX_LINE), ["x\n"]);
    }

    #[test]
    fn long_lines_are_cut_not_buffered_without_bound() {
        assert_eq!(lines(b"abcdefg\nhi\n", "> ", 3), ["> abc\n", "> def\n", "> g\n", "> hi\n"]);
        assert_eq!(lines(b"abc\n", "> ", 3), ["> abc\n"]);
    }

    #[test]
    fn lines_split_across_reads_are_joined() {
        // A reader that hands out one byte at a time, as a pipe may.
        struct Trickle<'a>(&'a [u8]);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                let n = self.0.len().min(1).min(buf.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut out = Vec::new();
        pump(BufReader::with_capacity(1, Trickle(b"hello\nworld")), b"# ", MAX_LINE, |l| out.push(l.to_vec()));
        assert_eq!(out, [b"# hello\n".to_vec(), b"# world\n".to_vec()]);
    }
}
