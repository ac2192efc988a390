//! `strftime` for the `strftime_now` function of chat templates.
//!
//! Templates such as Llama 3.1's and 3.2's write today's date into the
//! system prompt with `strftime_now("%d %b %Y")`; transformers answers with
//! Python's `datetime.now().strftime(format)`. This is the same formatting
//! for a UTC time (a server's local time zone says nothing about its users),
//! in the C locale, without a time-zone database or a date crate.

use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];

/// A UTC calendar time, to the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UtcTime {
    pub year: i64,
    /// 1..=12.
    pub month: u32,
    /// 1..=31.
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 is Monday, as Python's `weekday()`.
    pub weekday: u32,
    /// 1..=366.
    pub day_of_year: u32,
}

impl UtcTime {
    /// The calendar time of `t` (times before 1970 included).
    pub fn of(t: SystemTime) -> UtcTime {
        let secs = match t.duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
        };
        Self::from_unix(secs)
    }

    /// The calendar time `secs` seconds after 1970-01-01T00:00:00Z.
    pub fn from_unix(secs: i64) -> UtcTime {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        let first_of_year = days_from_civil(year, 1, 1);
        UtcTime {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            // 1970-01-01 was a Thursday (3 when Monday is 0).
            weekday: (days + 3).rem_euclid(7) as u32,
            day_of_year: (days - first_of_year + 1) as u32,
        }
    }

    /// `format` with this time put in, as C's `strftime` in the C locale
    /// (and glibc's `%-d` for no padding). A conversion it does not know is
    /// written as it stands.
    pub fn format(&self, format: &str) -> String {
        let mut out = String::with_capacity(format.len() + 16);
        let mut chars = format.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let unpadded = chars.next_if_eq(&'-').is_some();
            let Some(conv) = chars.next() else {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                break;
            };
            let num = |out: &mut String, n: i64, width: usize| {
                if unpadded {
                    out.push_str(&n.to_string());
                } else {
                    out.push_str(&format!("{n:0width$}"));
                }
            };
            let hour12 = match self.hour % 12 {
                0 => 12,
                h => h,
            };
            match conv {
                'a' => out.push_str(&DAYS[self.weekday as usize][..3]),
                'A' => out.push_str(DAYS[self.weekday as usize]),
                'b' | 'h' => out.push_str(&MONTHS[self.month as usize - 1][..3]),
                'B' => out.push_str(MONTHS[self.month as usize - 1]),
                'd' => num(&mut out, self.day.into(), 2),
                'e' => out.push_str(&if unpadded { self.day.to_string() } else { format!("{:2}", self.day) }),
                'm' => num(&mut out, self.month.into(), 2),
                'y' => num(&mut out, self.year.rem_euclid(100), 2),
                'Y' => out.push_str(&self.year.to_string()),
                'H' => num(&mut out, self.hour.into(), 2),
                'I' => num(&mut out, hour12.into(), 2),
                'M' => num(&mut out, self.minute.into(), 2),
                'S' => num(&mut out, self.second.into(), 2),
                'p' => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                'j' => num(&mut out, self.day_of_year.into(), 3),
                'u' => out.push_str(&(self.weekday + 1).to_string()),
                'w' => out.push_str(&((self.weekday + 1) % 7).to_string()),
                'F' => out.push_str(&self.format("%Y-%m-%d")),
                'D' | 'x' => out.push_str(&self.format("%m/%d/%y")),
                'T' | 'X' => out.push_str(&self.format("%H:%M:%S")),
                'R' => out.push_str(&self.format("%H:%M")),
                'c' => out.push_str(&self.format("%a %b %e %H:%M:%S %Y")),
                'Z' => out.push_str("UTC"),
                'z' => out.push_str("+0000"),
                'n' => out.push('\n'),
                't' => out.push('\t'),
                '%' => out.push('%'),
                other => {
                    out.push('%');
                    if unpadded {
                        out.push('-');
                    }
                    out.push(other);
                }
            }
        }
        out
    }
}

/// Year, month and day of `days` after 1970-01-01 in the proleptic Gregorian
/// calendar (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Days from 1970-01-01 to the given date (the inverse of [`civil_from_days`]).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_as_python_does() {
        // 2024-07-26T13:05:09Z, a Friday: the date Llama 3.1's template defaults to.
        let t = UtcTime::from_unix(1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9);
        assert_eq!(t.format("%d %b %Y"), "26 Jul 2024");
        assert_eq!(t.format("%B %d, %Y"), "July 26, 2024");
        assert_eq!(t.format("%A %a %j %u %w"), "Friday Fri 208 5 5");
        assert_eq!(t.format("%H:%M:%S %I %p %-I %-d %e %y %F %T %Z %z %%"), "13:05:09 01 PM 1 26 26 24 2024-07-26 13:05:09 UTC +0000 %");
        assert_eq!(t.format("%c"), "Fri Jul 26 13:05:09 2024");
        assert_eq!(t.format("%Q %-Q trailing %"), "%Q %-Q trailing %");
        assert_eq!(UtcTime::from_unix(0).format("%Y-%m-%d %H %A %j"), "1970-01-01 00 Thursday 001");
        assert_eq!(UtcTime::from_unix(-1).format("%Y-%m-%d %H:%M:%S %A %j"), "1969-12-31 23:59:59 Wednesday 365");
        assert_eq!(UtcTime::from_unix(951_782_400).format("%Y-%m-%d %j %e"), "2000-02-29 060 29");
    }

    #[test]
    fn calendar_round_trips_over_centuries() {
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
            let t = UtcTime::from_unix(days * 86_400);
            assert!((1..=366).contains(&t.day_of_year) && t.weekday < 7);
        }
    }
}
