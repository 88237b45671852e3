//! Exponential retry backoff with jitter.
//!
//! The delay before retry `n` (n = 1 after the first failed attempt) is
//! `min(max, base × 2^(n-1))`, then shortened by a random fraction in `[0, jitter)`, so a
//! delay never exceeds `max` and a herd of tasks failing together spreads out.

use crate::wire::protocol::{BackoffRequest, WireError};
use rand::Rng;
use std::time::Duration;

/// Retry backoff policy of a task.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay before the first retry (default 1 s).
    pub base: Duration,
    /// Upper bound (default 10 min).
    pub max: Duration,
    /// Fraction in 0..=1 by which each delay is randomly shortened (default 0.2).
    pub jitter: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(600),
            jitter: 0.2,
        }
    }
}

/// Longest base or max a task may ask for: 7 days.
pub const MAX_BACKOFF_MS: i64 = 7 * 24 * 3600 * 1000;

impl Backoff {
    /// Validates the request's options, defaulting what is absent.
    pub fn from_request(req: BackoffRequest) -> Result<Backoff, WireError> {
        let d = Backoff::default();
        let ms = |field: &str, v: Option<i64>, default: Duration| match v {
            None => Ok(default),
            Some(v) if (1..=MAX_BACKOFF_MS).contains(&v) => Ok(Duration::from_millis(v as u64)),
            Some(v) => Err(WireError::field(
                field,
                format!("{v} is outside 1..={MAX_BACKOFF_MS} ms"),
            )),
        };
        let base = ms("backoff.base_ms", req.base_ms, d.base)?;
        let max = ms("backoff.max_ms", req.max_ms, d.max.max(base))?;
        if max < base {
            return Err(WireError::field("backoff.max_ms", "is below base_ms"));
        }
        let jitter = req.jitter.unwrap_or(d.jitter);
        if !(0.0..=1.0).contains(&jitter) {
            return Err(WireError::field("backoff.jitter", "must be within 0..=1"));
        }
        Ok(Backoff { base, max, jitter })
    }

    /// The un-jittered delay before retry `n` (1-based).
    pub fn nominal(&self, retry: u32) -> Duration {
        let factor = 2u32.saturating_pow(retry.saturating_sub(1).min(31));
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The jittered delay before retry `n` (1-based).
    pub fn delay(&self, retry: u32) -> Duration {
        let nominal = self.nominal(retry);
        if self.jitter <= 0.0 {
            return nominal;
        }
        let cut = rand::rng().random_range(0.0..self.jitter);
        nominal.mul_f64(1.0 - cut)
    }

    /// `base_ms,max_ms,jitter` as carried in the `Ax-Backoff` header.
    pub fn to_header(&self) -> String {
        format!(
            "{},{},{}",
            self.base.as_millis(),
            self.max.as_millis(),
            self.jitter
        )
    }

    /// Parses the `Ax-Backoff` header.
    pub fn from_header(text: &str) -> Option<Backoff> {
        let mut parts = text.split(',');
        let base = Duration::from_millis(parts.next()?.trim().parse().ok()?);
        let max = Duration::from_millis(parts.next()?.trim().parse().ok()?);
        let jitter: f64 = parts.next()?.trim().parse().ok()?;
        if parts.next().is_some() || !(0.0..=1.0).contains(&jitter) {
            return None;
        }
        Some(Backoff { base, max, jitter })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_max() {
        let b = Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_millis(1000),
            jitter: 0.0,
        };
        let got: Vec<u128> = (1..=6).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.nominal(200), Duration::from_millis(1000));
    }

    #[test]
    fn jitter_only_shortens_within_fraction() {
        let b = Backoff {
            base: Duration::from_millis(1000),
            max: Duration::from_secs(60),
            jitter: 0.2,
        };
        for _ in 0..1000 {
            let d = b.delay(1).as_millis();
            assert!((800..=1000).contains(&d), "{d}");
        }
    }

    #[test]
    fn header_round_trip_and_validation() {
        let b = Backoff::default();
        assert_eq!(Backoff::from_header(&b.to_header()), Some(b));
        assert_eq!(Backoff::from_header("1,2"), None);
        assert_eq!(Backoff::from_header("1,2,3"), None);
        let bad = BackoffRequest {
            base_ms: Some(10_000),
            max_ms: Some(10),
            jitter: None,
        };
        assert_eq!(
            Backoff::from_request(bad).unwrap_err().field.as_deref(),
            Some("backoff.max_ms")
        );
    }
}
