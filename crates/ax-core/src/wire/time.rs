//! Time on the wire: milliseconds since the Unix epoch, and RFC 3339 text read strictly.
//!
//! Every time ax reads as text (`run_at`, a trigger's `at` and `start_at`, CLI flags) goes
//! through [`parse_rfc3339_ms`]: a full date, `T`, a full time with optional fraction, and
//! `Z` or a numeric offset `±hh:mm`. The offset is honoured, so
//! `2026-11-29T20:03:54.25+01:00` (what Python's `datetime.isoformat()` writes) is
//! 19:03:54.250 UTC. A space for `T` or a missing offset is refused: either would make the
//! instant depend on guesses.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now (wall clock).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Microseconds since the Unix epoch (0 before it): the clock of the limits' token
/// buckets (GCRA theoretical arrival times).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Text that is not an RFC 3339 date-time with an offset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not an RFC 3339 time such as 2026-12-01T08:00:00Z or 2026-12-01T09:00:00.5+01:00: {problem}")]
pub struct TimeError {
    /// The text (cut to 64 characters).
    pub text: String,
    /// What is wrong.
    pub problem: &'static str,
}

/// Parses an RFC 3339 date-time (with `Z` or a `±hh:mm` offset) into ms since the epoch.
pub fn parse_rfc3339_ms(text: &str) -> Result<u64, TimeError> {
    let fail = |problem| TimeError {
        text: text.chars().take(64).collect(),
        problem,
    };
    let bytes = text.as_bytes();
    if bytes.len() < 20 {
        return Err(fail("too short"));
    }
    if !matches!(bytes[10], b'T' | b't') {
        return Err(fail("date and time must be separated by T"));
    }
    let at = chrono::DateTime::parse_from_rfc3339(text).map_err(|e| {
        fail(match e.kind() {
            chrono::format::ParseErrorKind::OutOfRange => "a field is out of range",
            chrono::format::ParseErrorKind::TooShort => "the offset (Z or ±hh:mm) is missing",
            _ => "malformed",
        })
    })?;
    let ms = at.timestamp_millis();
    u64::try_from(ms).map_err(|_| fail("before 1970"))
}

/// `ms` as RFC 3339 UTC with milliseconds, e.g. `2026-12-01T08:00:00.000Z`. Never panics:
/// years past 9999 are written with a sign (`+10000-…`), times beyond what chrono can
/// represent as its latest one.
pub fn format_rfc3339_ms(ms: u64) -> String {
    let at = i64::try_from(ms)
        .ok()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC);
    at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_795_979_034_000; // 2026-11-29T19:03:54Z

    #[test]
    fn offsets_zulu_and_fractions() {
        for (text, want) in [
            ("2026-11-29T19:03:54Z", T),
            ("2026-11-29t19:03:54z", T),
            ("2026-11-29T20:03:54+01:00", T),
            ("2026-11-29T20:03:54.25+01:00", T + 250),
            ("2026-11-29T20:03:54.250000+01:00", T + 250),
            ("2026-11-29T13:33:54-05:30", T),
            ("2026-11-30T09:03:54+14:00", T),
            ("2026-11-29T19:03:54.123456789Z", T + 123),
        ] {
            assert_eq!(parse_rfc3339_ms(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn loose_forms_are_refused() {
        for text in [
            "2026-11-29 19:03:54Z",
            "2026-11-29T19:03:54",
            "2026-11-29T19:03:54+0100",
            "2026-11-29T19:03Z",
            "2026-11-29",
            "2026-13-29T19:03:54Z",
            "2026-11-29T25:03:54Z",
            "1969-12-31T23:59:59Z",
            "tomorrow",
            "",
            "2026-11-29T19:03:54Z trailing",
        ] {
            assert!(parse_rfc3339_ms(text).is_err(), "{text} was accepted");
        }
    }

    #[test]
    fn format_round_trips() {
        let text = format_rfc3339_ms(T + 7);
        assert_eq!(text, "2026-11-29T19:03:54.007Z");
        assert_eq!(parse_rfc3339_ms(&text), Ok(T + 7));
        assert_eq!(format_rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn far_future_times_format_without_panicking() {
        // Found by the wire fuzz: a trigger whose next time lay past year 9999 made
        // `trigger list` panic while formatting it.
        assert!(format_rfc3339_ms(300_000_000_000_000).starts_with('+'));
        assert!(!format_rfc3339_ms(u64::MAX).is_empty());
    }
}
