//! Recurrence math: `next_after(t)` for each trigger kind.
//!
//! All times are ms since the Unix epoch. Cron expressions are evaluated in the trigger's
//! time zone with chrono-tz, so "08:00 Europe/Berlin" stays 08:00 local across DST changes;
//! a local time that does not exist (spring forward) is skipped that day, and one that
//! exists twice (fall back) fires once, at its first occurrence.

use super::model::{IntervalMode, Kind, TriggerDef};
use ax_core::protocol::WireError;
use chrono::TimeZone;
use std::str::FromStr;

/// Shortest interval.
pub const MIN_INTERVAL_MS: u64 = 1000;
/// Longest interval: 10 years.
pub const MAX_INTERVAL_MS: u64 = 10 * 365 * 24 * 3600 * 1000;

/// A parsed, validated recurrence.
#[derive(Debug, Clone)]
pub enum Recurrence {
    /// Cron schedule in a time zone.
    Cron {
        /// The expression with the seconds field first (parsed when needed, from a
        /// bounded cache shared by all triggers).
        expr: Box<str>,
        /// Zone.
        tz: chrono_tz::Tz,
    },
    /// `start + k × every` (start defaults to one period after the anchor).
    FixedRate {
        /// Period.
        every_ms: u64,
        /// First fire, if given.
        start_ms: Option<u64>,
    },
    /// `every` after the previous fire finished (the first: after the anchor).
    FixedDelay {
        /// Delay.
        every_ms: u64,
    },
    /// Once.
    Once {
        /// The time.
        at_ms: u64,
    },
    /// No times: fires come from messages.
    Event,
}

/// Most parsed cron schedules kept at once.
const SCHEDULE_CACHE: usize = 4096;

/// The parsed schedule of a (6- or 7-field) cron expression, from a bounded cache shared
/// by all triggers. A parsed `cron::Schedule` takes about 2 KiB (a set per field), so
/// triggers keep only their expression: 100,000 triggers with their own times would
/// otherwise hold ~200 MiB of identical-looking sets. Triggers sharing an expression share
/// its parse; a full cache is emptied and refilled with what is used next.
fn schedule(expr: &str) -> Result<std::sync::Arc<cron::Schedule>, cron::error::Error> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<Box<str>, Arc<cron::Schedule>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(s) = cache.lock().expect("not poisoned").get(expr) {
        return Ok(s.clone());
    }
    let parsed = Arc::new(cron::Schedule::from_str(expr)?);
    let mut cache = cache.lock().expect("not poisoned");
    if cache.len() >= SCHEDULE_CACHE {
        cache.clear();
    }
    cache.insert(expr.into(), parsed.clone());
    Ok(parsed)
}

fn rfc3339_ms(field: &str, text: &str) -> Result<u64, WireError> {
    ax_core::time::parse_rfc3339_ms(text).map_err(|e| WireError::field(field, e.to_string()))
}

/// A definition checked whole: its fields ([`TriggerDef::check_fields`]) and its
/// recurrence, parsed.
pub trait Validate {
    /// Checks every field; returns the parsed recurrence or a typed error naming the field.
    fn validate(&self) -> Result<Recurrence, WireError>;
}

impl Validate for TriggerDef {
    fn validate(&self) -> Result<Recurrence, WireError> {
        self.check_fields()?;
        Recurrence::parse(&self.kind)
    }
}

impl Recurrence {
    /// Validates a kind.
    pub fn parse(kind: &Kind) -> Result<Recurrence, WireError> {
        match kind {
            Kind::Cron { expr, tz } => {
                let fields = expr.split_whitespace().count();
                let full = match fields {
                    5 => format!("0 {expr}"),
                    6 | 7 => expr.clone(),
                    _ => {
                        return Err(WireError::field(
                            "expr",
                            format!("{expr:?}: expected 5 fields, or 6 with seconds first"),
                        ))
                    }
                };
                schedule(&full).map_err(|e| WireError::field("expr", format!("{expr:?}: {e}")))?;
                let tz = chrono_tz::Tz::from_str(tz)
                    .map_err(|_| WireError::field("tz", format!("unknown time zone {tz:?}")))?;
                Ok(Recurrence::Cron {
                    expr: full.into(),
                    tz,
                })
            }
            Kind::Interval {
                every_ms,
                mode,
                start_at,
            } => {
                if !(MIN_INTERVAL_MS..=MAX_INTERVAL_MS).contains(every_ms) {
                    return Err(WireError::field(
                        "every_ms",
                        format!("{every_ms} ms is outside {MIN_INTERVAL_MS}..={MAX_INTERVAL_MS} ms (1 s to 10 years)"),
                    ));
                }
                let start_ms = start_at
                    .as_deref()
                    .map(|t| rfc3339_ms("start_at", t))
                    .transpose()?;
                Ok(match mode {
                    IntervalMode::FixedRate => Recurrence::FixedRate {
                        every_ms: *every_ms,
                        start_ms,
                    },
                    IntervalMode::FixedDelay => Recurrence::FixedDelay {
                        every_ms: *every_ms,
                    },
                })
            }
            Kind::Once { at } => Ok(Recurrence::Once {
                at_ms: rfc3339_ms("at", at)?,
            }),
            Kind::Event { subject } => {
                let tokens_ok = !subject.is_empty()
                    && subject.len() <= 256
                    && subject.split('.').all(|t| {
                        !t.is_empty() && !t.chars().any(|c| c.is_whitespace() || c.is_control())
                    });
                if !tokens_ok || subject.starts_with("ax.") || subject.starts_with('$') {
                    return Err(WireError::field(
                        "subject",
                        format!("{subject:?} is not a valid subject outside ax.> and $…"),
                    ));
                }
                Ok(Recurrence::Event)
            }
        }
    }

    /// The first scheduled time strictly after `after_ms`. `anchor_ms` is when the trigger
    /// was created (fixed-rate without a start) or when its previous fire finished
    /// (fixed-delay). `None`: no more fires.
    pub fn next_after(&self, after_ms: u64, anchor_ms: u64) -> Option<u64> {
        match self {
            Recurrence::Cron { expr, tz } => {
                let after = tz.timestamp_millis_opt(after_ms as i64).single()?;
                schedule(expr)
                    .ok()?
                    .after(&after)
                    .next()
                    .map(|t| t.timestamp_millis() as u64)
            }
            Recurrence::FixedRate { every_ms, start_ms } => {
                let start = start_ms.unwrap_or(anchor_ms + every_ms);
                if after_ms < start {
                    return Some(start);
                }
                let k = (after_ms - start) / every_ms + 1;
                Some(start + k * every_ms)
            }
            Recurrence::FixedDelay { every_ms } => {
                let next = anchor_ms + every_ms;
                (next > after_ms).then_some(next)
            }
            Recurrence::Once { at_ms } => (*at_ms > after_ms).then_some(*at_ms),
            Recurrence::Event => None,
        }
    }

    /// True for fixed-delay (its next time depends on completions).
    pub fn is_fixed_delay(&self) -> bool {
        matches!(self, Recurrence::FixedDelay { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cron(expr: &str, tz: &str) -> Recurrence {
        Recurrence::parse(&Kind::Cron {
            expr: expr.into(),
            tz: tz.into(),
        })
        .unwrap()
    }

    fn ms(text: &str) -> u64 {
        rfc3339_ms("t", text).unwrap()
    }

    #[test]
    fn five_and_six_fields() {
        let every_minute = cron("* * * * *", "UTC");
        assert_eq!(
            every_minute.next_after(ms("2026-01-01T00:00:30Z"), 0),
            Some(ms("2026-01-01T00:01:00Z"))
        );
        let every_ten_s = cron("*/10 * * * * *", "UTC");
        assert_eq!(
            every_ten_s.next_after(ms("2026-01-01T00:00:30Z"), 0),
            Some(ms("2026-01-01T00:00:40Z"))
        );
    }

    #[test]
    fn invalid_definitions_name_the_field() {
        let bad = |kind: Kind| Recurrence::parse(&kind).unwrap_err().field.unwrap();
        assert_eq!(
            bad(Kind::Cron {
                expr: "61 * * * *".into(),
                tz: "UTC".into()
            }),
            "expr"
        );
        assert_eq!(
            bad(Kind::Cron {
                expr: "* * *".into(),
                tz: "UTC".into()
            }),
            "expr"
        );
        assert_eq!(
            bad(Kind::Cron {
                expr: "* * * * *".into(),
                tz: "Mars/Olympus".into()
            }),
            "tz"
        );
        assert_eq!(
            bad(Kind::Interval {
                every_ms: 999,
                mode: IntervalMode::FixedRate,
                start_at: None
            }),
            "every_ms"
        );
        assert_eq!(bad(Kind::Once { at: "soon".into() }), "at");
    }

    #[test]
    fn cron_keeps_local_time_across_dst() {
        // Europe/Berlin: 08:00 local is 07:00 UTC in winter and 06:00 UTC in summer.
        let daily = cron("0 8 * * *", "Europe/Berlin");
        assert_eq!(
            daily.next_after(ms("2026-03-28T12:00:00Z"), 0),
            Some(ms("2026-03-29T06:00:00Z"))
        );
        assert_eq!(
            daily.next_after(ms("2026-03-27T12:00:00Z"), 0),
            Some(ms("2026-03-28T07:00:00Z"))
        );
        // 02:30 does not exist on 2026-03-08 in New York (spring forward): skipped that day.
        let early = cron("30 2 * * *", "America/New_York");
        let next = early.next_after(ms("2026-03-07T08:00:00Z"), 0).unwrap();
        assert_eq!(next, ms("2026-03-09T06:30:00Z"));
        // 01:30 exists twice on 2026-11-01 (fall back): it fires once.
        let twice = cron("30 1 * * *", "America/New_York");
        let first = twice.next_after(ms("2026-11-01T04:00:00Z"), 0).unwrap();
        assert_eq!(first, ms("2026-11-01T05:30:00Z"));
        let second = twice.next_after(first, 0).unwrap();
        assert_eq!(second, ms("2026-11-02T06:30:00Z"));
    }

    #[test]
    fn fixed_rate_never_drifts() {
        let r = Recurrence::FixedRate {
            every_ms: 1000,
            start_ms: None,
        };
        // Anchored at creation (t = 500): 1500, 2500, ... whatever `after` is.
        assert_eq!(r.next_after(0, 500), Some(1500));
        assert_eq!(r.next_after(1500, 500), Some(2500));
        assert_eq!(r.next_after(2999, 500), Some(3500));
    }

    proptest! {
        #[test]
        fn fixed_rate_times_lie_on_the_grid(
            every in 1000u64..100_000, start in 0u64..10_000_000, after in 0u64..20_000_000
        ) {
            let r = Recurrence::FixedRate { every_ms: every, start_ms: Some(start) };
            let next = r.next_after(after, 0).unwrap();
            prop_assert!(next > after);
            prop_assert_eq!((next - start) % every, 0);
            prop_assert!(next == start || next - every <= after);
        }

        #[test]
        fn cron_next_is_the_first_match_after(
            minute in 0u32..60, step in 1u32..30, after_s in 1_700_000_000u64..1_900_000_000
        ) {
            let expr = format!("{minute}/{step} * * * *");
            let r = cron(&expr, "UTC");
            let schedule = cron::Schedule::from_str(&format!("0 {expr}")).unwrap();
            let after = after_s * 1000;
            let next = r.next_after(after, 0).unwrap();
            prop_assert!(next > after);
            let at = chrono::Utc.timestamp_millis_opt(next as i64).unwrap();
            prop_assert!(schedule.includes(at));
            // No matching minute in between.
            let mut t = (after / 60_000 + 1) * 60_000;
            while t < next {
                let dt = chrono::Utc.timestamp_millis_opt(t as i64).unwrap();
                prop_assert!(!schedule.includes(dt), "{} matches before {}", t, next);
                t += 60_000;
            }
        }
    }
}
