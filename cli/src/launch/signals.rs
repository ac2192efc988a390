//! The launcher's own signals, turned into messages for its supervising loop.
//!
//! The stop signals and `SIGCHLD` are blocked in every thread and taken by
//! one thread with `sigwait`, so no code runs inside a signal handler and the
//! loop reacts to a child's exit at once instead of at its next poll. A
//! signal mask is inherited across fork and exec, so the ranks unblock
//! everything before exec (see `process::spawn`).

use std::io;
use std::sync::mpsc::Sender;
use std::thread;

/// What the signal thread reports.
pub enum Event {
    /// The launcher was asked to stop (`SIGINT`, `SIGTERM`, `SIGHUP`, `SIGQUIT`).
    Stop(libc::c_int),
    /// A child of the launcher exited (`SIGCHLD`): time to reap.
    ChildExited,
}

/// The signals that stop the job; each is forwarded to the ranks as it came.
const STOP: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// Blocks the launcher's signals in the calling thread (and so in every
/// thread it starts later) and starts the thread that reports them to
/// `events`. Must run before any other thread exists: a thread started
/// earlier would keep the default actions and die on the first Ctrl-C.
pub fn watch(events: Sender<Event>) -> io::Result<()> {
    let set = signal_set(STOP.iter().copied().chain([libc::SIGCHLD]))?;
    // SAFETY: `set` is an initialised signal set and the old mask is not
    // asked for (null), as pthread_sigmask allows.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    thread::Builder::new().name("signals".into()).spawn(move || loop {
        let mut signal: libc::c_int = 0;
        // SAFETY: `set` is initialised and holds only blocked signals;
        // sigwait writes the signal taken into `signal`.
        let rc = unsafe { libc::sigwait(&set, &mut signal) };
        if rc != 0 {
            // Only an invalid set makes sigwait fail; the loop then falls
            // back to polling at the monitor interval.
            return;
        }
        let event = if signal == libc::SIGCHLD { Event::ChildExited } else { Event::Stop(signal) };
        if events.send(event).is_err() {
            return;
        }
    })?;
    Ok(())
}

/// A signal set holding `signals`.
pub fn signal_set(signals: impl IntoIterator<Item = libc::c_int>) -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before any
    // use and sigaddset only sets bits of valid signal numbers.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        if libc::sigemptyset(&mut set) != 0 {
            return Err(io::Error::last_os_error());
        }
        for s in signals {
            if libc::sigaddset(&mut set, s) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(set)
    }
}

/// A signal's usual name (`SIGTERM`), or its number when it has none here.
pub fn name(signal: libc::c_int) -> String {
    const NAMES: &[(libc::c_int, &str)] = &[
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGTRAP, "SIGTRAP"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGCHLD, "SIGCHLD"),
        (libc::SIGCONT, "SIGCONT"),
        (libc::SIGSTOP, "SIGSTOP"),
        (libc::SIGTSTP, "SIGTSTP"),
        (libc::SIGTTIN, "SIGTTIN"),
        (libc::SIGTTOU, "SIGTTOU"),
        (libc::SIGURG, "SIGURG"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGXFSZ, "SIGXFSZ"),
        (libc::SIGVTALRM, "SIGVTALRM"),
        (libc::SIGPROF, "SIGPROF"),
        (libc::SIGWINCH, "SIGWINCH"),
        (libc::SIGIO, "SIGIO"),
        (libc::SIGSYS, "SIGSYS"),
    ];
    NAMES.iter().find(|(s, _)| *s == signal).map_or_else(|| format!("signal {signal}"), |(_, n)| (*n).to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn names() {
        assert_eq!(super::name(libc::SIGTERM), "SIGTERM");
        assert_eq!(super::name(libc::SIGKILL), "SIGKILL");
        assert_eq!(super::name(1000), "signal 1000");
    }
}
