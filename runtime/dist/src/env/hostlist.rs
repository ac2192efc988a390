//! Slurm's compressed lists: host lists (`node[01-04,07],gpu-a[1-2]`) and
//! task counts per node (`4(x2),3`).
//!
//! Slurm hands a step its nodes as one compressed string
//! (`SLURM_JOB_NODELIST`, `SLURM_STEP_NODELIST`) and its tasks per node as
//! another (`SLURM_TASKS_PER_NODE`). The syntax, as Slurm writes it:
//!
//! - a host list is a comma-separated list of items; a comma inside
//!   brackets separates ranges, not items;
//! - an item is literal text with any number of bracket groups; each group
//!   is a comma-separated list of numbers and ranges `lo-hi`; an item with
//!   several groups stands for every combination, the leftmost group varying
//!   slowest (`r[1-2]n[1-2]` is `r1n1,r1n2,r2n1,r2n2`);
//! - a range keeps the zero padding of its lower bound (`[08-10]` is `08,09,10`;
//!   `[8-10]` is `8,9,10`);
//! - a task count list is a comma-separated list of `N` or `N(xM)` (`N`
//!   repeated `M` times).
//!
//! Both parsers check the whole string and return a [`HostlistError`] that
//! says where it stops making sense; neither allocates more than the
//! expanded result, which is bounded by [`MAX_HOSTS`].

use std::fmt;

/// The most hosts (or per-node task counts) a list may expand to: a
/// larger expansion is an error, not an allocation.
pub const MAX_HOSTS: usize = 1 << 20;

/// The most digits a number in a host range or task count may have.
const MAX_DIGITS: usize = 18;

/// A host list or task count list that does not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostlistError {
    /// The byte offset in the input where the problem is.
    pub at: usize,
    /// What is wrong there.
    pub reason: String,
}

impl fmt::Display for HostlistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (at byte {})", self.reason, self.at)
    }
}

impl std::error::Error for HostlistError {}

fn fail<T>(at: usize, reason: impl Into<String>) -> Result<T, HostlistError> {
    Err(HostlistError { at, reason: reason.into() })
}

/// One piece of an item: literal text or a bracket group.
#[derive(Debug)]
enum Piece<'a> {
    Text(&'a str),
    Group(Vec<Range>),
}

/// `lo..=hi`, printed with at least `width` digits.
#[derive(Debug, Clone, Copy)]
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    fn len(&self) -> u64 {
        self.hi - self.lo + 1
    }
}

/// Parses a host list into items, each a sequence of pieces.
fn parse(list: &str) -> Result<Vec<Vec<Piece<'_>>>, HostlistError> {
    if list.is_empty() {
        return fail(0, "the host list is empty");
    }
    let bytes = list.as_bytes();
    let mut items = Vec::new();
    let mut pieces = Vec::new();
    let mut i = 0;
    let mut text_start = 0;
    while i <= bytes.len() {
        let c = bytes.get(i).copied();
        match c {
            None | Some(b',') => {
                if text_start < i {
                    pieces.push(Piece::Text(&list[text_start..i]));
                }
                if pieces.is_empty() {
                    return fail(i, "an empty host name (two commas in a row, or a comma at an end)");
                }
                items.push(std::mem::take(&mut pieces));
                i += 1;
                text_start = i;
            }
            Some(b'[') => {
                if text_start < i {
                    pieces.push(Piece::Text(&list[text_start..i]));
                }
                let close = match list[i + 1..].find(']') {
                    Some(off) => i + 1 + off,
                    None => return fail(i, "`[` without a closing `]`"),
                };
                pieces.push(Piece::Group(parse_group(list, i + 1, close)?));
                i = close + 1;
                text_start = i;
            }
            Some(b']') => return fail(i, "`]` without an opening `[`"),
            Some(c) if c.is_ascii_whitespace() || c.is_ascii_control() => return fail(i, "whitespace or a control character in a host name"),
            Some(_) => i += 1,
        }
    }
    Ok(items)
}

/// Parses the ranges between `[` (exclusive, at `start`) and `]` (at `end`).
fn parse_group(list: &str, start: usize, end: usize) -> Result<Vec<Range>, HostlistError> {
    let mut ranges = Vec::new();
    let mut at = start;
    for part in list[start..end].split(',') {
        let range = match part.split_once('-') {
            Some((lo, hi)) => {
                let (l, width) = number(lo, at)?;
                let (h, _) = number(hi, at + lo.len() + 1)?;
                if h < l {
                    return fail(at, format!("the range `{part}` runs backwards; write it low-high"));
                }
                Range { lo: l, hi: h, width }
            }
            None => {
                let (n, width) = number(part, at)?;
                Range { lo: n, hi: n, width }
            }
        };
        ranges.push(range);
        at += part.len() + 1;
    }
    Ok(ranges)
}

/// A decimal number and its printed width (zero padding is kept).
fn number(s: &str, at: usize) -> Result<(u64, usize), HostlistError> {
    if s.is_empty() {
        return fail(at, "an empty number in a bracket range");
    }
    if let Some(off) = s.find(|c: char| !c.is_ascii_digit()) {
        return fail(at + off, format!("`{s}` is not a number (a bracket holds numbers and ranges such as `[01-04,07]`)"));
    }
    if s.len() > MAX_DIGITS {
        return fail(at, format!("the number `{s}` has more than {MAX_DIGITS} digits"));
    }
    // Digits only, at most 18 of them: always fits in a u64.
    Ok((s.parse().unwrap_or(0), s.len()))
}

/// How many hosts an item stands for, or an error when it exceeds [`MAX_HOSTS`].
fn item_len(item: &[Piece<'_>]) -> Option<u64> {
    let mut n: u64 = 1;
    for piece in item {
        if let Piece::Group(ranges) = piece {
            let mut g: u64 = 0;
            for r in ranges {
                g = g.checked_add(r.len())?;
            }
            n = n.checked_mul(g)?;
        }
    }
    Some(n)
}

/// Every host a Slurm host list names, in order.
///
/// ```
/// use tessera::dist::env::hostlist;
///
/// let hosts = hostlist::expand("node[01-03,07],gpu-a[1-2],login").unwrap();
/// assert_eq!(hosts, ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2", "login"]);
/// assert!(hostlist::expand("node[3-1]").is_err());
/// ```
pub fn expand(list: &str) -> Result<Vec<String>, HostlistError> {
    let items = parse(list)?;
    let mut total: u64 = 0;
    for item in &items {
        total = total.saturating_add(item_len(item).unwrap_or(u64::MAX));
    }
    if total > MAX_HOSTS as u64 {
        return fail(0, format!("the host list names more than {MAX_HOSTS} hosts"));
    }
    let mut hosts = Vec::with_capacity(total as usize);
    for item in &items {
        let mut names = vec![String::new()];
        for piece in item {
            match piece {
                Piece::Text(t) => names.iter_mut().for_each(|n| n.push_str(t)),
                Piece::Group(ranges) => {
                    let mut next = Vec::with_capacity(names.len());
                    for prefix in &names {
                        for r in ranges {
                            for k in r.lo..=r.hi {
                                next.push(format!("{prefix}{k:0w$}", w = r.width));
                            }
                        }
                    }
                    names = next;
                }
            }
        }
        hosts.extend(names);
    }
    Ok(hosts)
}

/// The first host a Slurm host list names (the host of task 0 of a step),
/// after checking the whole list; nothing is expanded.
///
/// ```
/// use tessera::dist::env::hostlist;
///
/// assert_eq!(hostlist::first("gpu[007-100]x[2-3],cpu1").unwrap(), "gpu007x2");
/// ```
pub fn first(list: &str) -> Result<String, HostlistError> {
    let items = parse(list)?;
    let mut name = String::new();
    // `parse` never returns an empty list, nor an empty group.
    for piece in &items[0] {
        match piece {
            Piece::Text(t) => name.push_str(t),
            Piece::Group(ranges) => name.push_str(&format!("{:0w$}", ranges[0].lo, w = ranges[0].width)),
        }
    }
    Ok(name)
}

/// The task count of every node of a Slurm task list such as
/// `SLURM_TASKS_PER_NODE`: `4(x2),3` is `[4, 4, 3]`.
///
/// ```
/// use tessera::dist::env::hostlist;
///
/// assert_eq!(hostlist::tasks_per_node("4(x2),3").unwrap(), [4, 4, 3]);
/// assert!(hostlist::tasks_per_node("4(2)").is_err());
/// ```
pub fn tasks_per_node(list: &str) -> Result<Vec<usize>, HostlistError> {
    if list.is_empty() {
        return fail(0, "the task count list is empty");
    }
    let mut counts = Vec::new();
    let mut at = 0;
    for part in list.split(',') {
        let (count, repeat) = match part.split_once('(') {
            None => (number(part, at)?.0, 1),
            Some((n, rest)) => {
                let Some(reps) = rest.strip_prefix('x').and_then(|r| r.strip_suffix(')')) else {
                    return fail(at + n.len(), format!("`{part}` is not of the form `N(xM)` (N tasks on each of M nodes)"));
                };
                let reps = number(reps, at + n.len() + 2)?.0;
                if reps == 0 {
                    return fail(at + n.len() + 2, format!("`{part}` repeats a count zero times"));
                }
                (number(n, at)?.0, reps)
            }
        };
        if counts.len() as u64 + repeat > MAX_HOSTS as u64 {
            return fail(at, format!("the task count list covers more than {MAX_HOSTS} nodes"));
        }
        counts.extend(std::iter::repeat_n(count as usize, repeat as usize));
        at += part.len() + 1;
    }
    Ok(counts)
}
