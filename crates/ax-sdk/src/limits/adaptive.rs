//! Adaptive rates (rates adapt to reported pressure): a limit
//! with `adaptive` lowers its rate multiplicatively when a handler reports pressure (its
//! error class is one of `on`: the downstream answered 429, a database is slow) and raises
//! it additively while calm, between `min` and the limit's `rate` — AIMD, as TCP does.
//!
//! The state is shared by every worker through the bucket's own value in
//! `AX_LIMIT_STATE`: `"<tat>"` for a plain bucket, `"<tat> <rate> <at>"` once lowered
//! (the rate it was lowered to, and when, in µs since the epoch). The rate in force at
//! `now` is `min(rate, lowered + increase × (now − at))`, computed by every reader: a
//! rise costs no write, a lowering is one compare-and-set, and the TAT and the rate
//! change together. A report lowers the rate only if its attempt started after the last
//! lowering (the refusals of one overload lower it once). Pure functions, unit-tested here; `gate` does the I/O.

use super::model::LimitDef;

/// A bucket's stored value.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BucketState {
    /// The GCRA theoretical arrival time (µs since the epoch).
    pub tat: Option<u64>,
    /// The rate it was last lowered to, and when (µs since the epoch).
    pub lowered: Option<(f64, u64)>,
}

impl BucketState {
    /// Reads a stored value (`"<tat>"` or `"<tat> <rate> <at>"`); anything else reads as
    /// empty (a fresh bucket).
    pub fn parse(value: &[u8]) -> BucketState {
        let text = std::str::from_utf8(value).unwrap_or_default();
        let mut parts = text.split(' ');
        let tat = parts.next().and_then(|t| t.parse::<u64>().ok());
        let lowered = match (parts.next(), parts.next()) {
            (Some(r), Some(at)) => r
                .parse::<f64>()
                .ok()
                .filter(|r| r.is_finite() && *r > 0.0)
                .zip(at.parse::<u64>().ok()),
            _ => None,
        };
        BucketState { tat, lowered }
    }

    /// The stored value.
    pub fn encode(&self, tat: u64) -> String {
        match self.lowered {
            Some((rate, at)) => format!("{tat} {rate} {at}"),
            None => tat.to_string(),
        }
    }

    /// The rate in force at `now_us`: the limit's rate, or — lowered — the lowered rate
    /// plus `increase` per second since, never above the limit's rate nor below `min`.
    pub fn rate(&self, def: &LimitDef, now_us: u64) -> f64 {
        let ceiling = def.rate.unwrap_or(1.0);
        match (&def.adaptive, self.lowered) {
            (Some(a), Some((lowered, at))) => {
                let since = now_us.saturating_sub(at) as f64 / 1e6;
                (lowered + a.increase(ceiling) * since).clamp(a.min.min(ceiling), ceiling)
            }
            _ => ceiling,
        }
    }

    /// The state after a report of pressure at `now_us` by an attempt that started at
    /// `started_us`, or `None` if the rate was lowered since that attempt started (it ran
    /// under the rate before: the refusals of one overload lower the rate once, as TCP
    /// lowers its window once per round trip) or the limit is not adaptive.
    pub fn pressured(&self, def: &LimitDef, now_us: u64, started_us: u64) -> Option<BucketState> {
        let a = def.adaptive.as_ref()?;
        if let Some((_, at)) = self.lowered {
            if started_us <= at {
                return None;
            }
        }
        let ceiling = def.rate.unwrap_or(1.0);
        let lowered = (self.rate(def, now_us) * a.decrease()).max(a.min.min(ceiling));
        Some(BucketState {
            tat: self.tat,
            lowered: Some((lowered, now_us)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn def() -> LimitDef {
        serde_json::from_value(json!({"name": "a", "queue": "q", "rate": 500.0,
            "adaptive": {"min": 5.0, "increase": 25.0, "decrease": 0.5, "on": ["http_429"]}}))
        .unwrap()
    }

    #[test]
    fn pressure_lowers_multiplicatively_once_per_cooldown_and_calm_raises_additively() {
        let d = def();
        let fresh = BucketState::parse(b"1000");
        assert_eq!(fresh.tat, Some(1000));
        assert_eq!(fresh.rate(&d, 0), 500.0);
        let low = fresh.pressured(&d, 10_000_000, 9_990_000).unwrap();
        assert_eq!(low.lowered, Some((250.0, 10_000_000)));
        assert!(
            low.pressured(&d, 10_500_000, 9_995_000).is_none(),
            "an attempt started before the lowering ran under the old rate"
        );
        let lower = low.pressured(&d, 11_000_000, 10_000_001).unwrap();
        // One second later the rate had risen by 25 before it was halved again.
        assert_eq!(lower.lowered, Some((137.5, 11_000_000)));
        assert_eq!(lower.rate(&d, 13_000_000), 187.5);
        assert_eq!(
            lower.rate(&d, 100_000_000),
            500.0,
            "never above the limit's rate"
        );
        // Pressure every second settles where a second's rise is halved away (25/s);
        // with almost no rise, at `min`, never below.
        const S: u64 = 1_000_000;
        let mut s = fresh;
        for i in 1..100u64 {
            s = s.pressured(&d, i * S, i * S - 1).unwrap_or(s);
            assert!(s.rate(&d, i * S) >= 5.0);
        }
        assert!((s.rate(&d, 99 * S) - 25.0).abs() < 1e-6);
        let mut slow = d.clone();
        slow.adaptive.as_mut().unwrap().increase = Some(0.000_001);
        let mut s = fresh;
        for i in 1..100u64 {
            s = s.pressured(&slow, i * S, i * S - 1).unwrap_or(s);
        }
        assert!((s.rate(&slow, 99 * S) - 5.0).abs() < 1e-3);
        // The value round-trips, and bad text reads as a fresh bucket.
        assert_eq!(
            BucketState::parse(lower.encode(7).as_bytes()).lowered,
            lower.lowered
        );
        assert_eq!(BucketState::parse(b"x y z"), BucketState::default());
        assert_eq!(BucketState::parse(b"5 NaN 3").lowered, None);
        // A limit that is not adaptive ignores a lowered state and is never lowered.
        let plain: LimitDef =
            serde_json::from_value(json!({"name": "p", "queue": "q", "rate": 9.0})).unwrap();
        assert_eq!(lower.rate(&plain, 11_000_000), 9.0);
        assert!(fresh.pressured(&plain, 1, 0).is_none());
    }
}
