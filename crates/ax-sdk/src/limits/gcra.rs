//! The token bucket as GCRA (generic cell rate algorithm): one number per bucket, the
//! theoretical arrival time (TAT), updated by compare-and-set. A start is allowed when
//! `TAT − now ≤ (burst − 1) × interval`; it moves the TAT one interval on. So over any
//! window of length `w` at most `burst + rate × w` starts pass, whoever takes them.
//!
//! The arithmetic never wraps: for the rates and bursts a limit may have
//! ([`MIN_RATE`](super::model::MIN_RATE)..=[`MAX_RATE`](super::model::MAX_RATE), burst
//! 1..=[`MAX_BURST`](super::model::MAX_BURST)) every TAT stays far below `u64::MAX`, and
//! for any stored TAT (a value written by hand, a clock far ahead) a take that cannot be
//! recorded is refused rather than granted.

use std::time::Duration;

/// The interval (µs) no rate's interval exceeds: above `10⁶ / MIN_RATE` (11.6 days), so
/// it is never reached by a valid rate; only a rate outside the range is clamped to it.
pub const MAX_INTERVAL_US: u64 = 1 << 40;

/// The longest a delivery over a rate is handed back for (its Nak delay): a longer wait is
/// checked again after this. Far below what the broker takes (an `i64` of nanoseconds).
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

/// The interval between tokens (µs) for `rate` starts per second: `10⁶ / rate` rounded
/// **up** to a whole µs, so the rate is never exceeded (at high rates a little below it:
/// 99,999/s gets 11 µs, 90,909/s), at least 1 µs, at most [`MAX_INTERVAL_US`] (a rate
/// that is not a positive finite number gets that too).
pub fn interval_us(rate: f64) -> u64 {
    let exact = (1_000_000.0 / rate).ceil();
    if exact.is_nan() || rate <= 0.0 || exact >= MAX_INTERVAL_US as f64 {
        MAX_INTERVAL_US
    } else {
        (exact as u64).max(1)
    }
}

/// The outcome of one take: the new TAT to store, or how long to wait (µs, at least 1).
pub fn take(tat_us: Option<u64>, now_us: u64, interval_us: u64, burst: u32) -> Result<u64, u64> {
    take_up_to(tat_us, now_us, interval_us, burst, 1).map(|(_, tat)| tat)
}

/// Takes up to `want` tokens at once (a worker's batch): how many it got and the new TAT,
/// or how long to wait for one (µs, at least 1). Taking `k` is allowed when the `k`-th
/// would be: the TAT moves `k` intervals on. Saturating everywhere: a TAT that cannot move
/// on without passing `u64::MAX` grants nothing (wait `u64::MAX`).
pub fn take_up_to(
    tat_us: Option<u64>,
    now_us: u64,
    interval_us: u64,
    burst: u32,
    want: u32,
) -> Result<(u32, u64), u64> {
    let interval = interval_us.max(1);
    let tat = tat_us.unwrap_or(now_us).max(now_us);
    let tolerance = interval.saturating_mul(u64::from(burst.max(1)) - 1);
    let ahead = tat - now_us; // tat ≥ now
    if ahead > tolerance {
        return Err(ahead - tolerance);
    }
    // The k-th token is due when ahead + (k − 1) × interval ≤ tolerance; and the TAT
    // must be able to move k intervals on.
    let available = ((tolerance - ahead) / interval).saturating_add(1);
    let room = (u64::MAX - tat) / interval;
    let got = available.min(u64::from(want.max(1))).min(room);
    if got == 0 {
        return Err(u64::MAX);
    }
    Ok((got as u32, tat + interval * got))
}

/// Books the next token even when it is not due yet, if it is due within `horizon_us`
/// (a reservation: the worker holds the delivery and starts it exactly then): the token's
/// due time and the new TAT (one interval on); or how long until a token is due (µs, at
/// least 1) when that is beyond the horizon. Due times of reservations and takes together
/// keep the GCRA bound: each token is due `interval` after the one before, or at once
/// within the burst. Saturating as [`take_up_to`]: a TAT that cannot move on grants nothing.
pub fn reserve(
    tat_us: Option<u64>,
    now_us: u64,
    interval_us: u64,
    burst: u32,
    horizon_us: u64,
) -> Result<(u64, u64), u64> {
    let interval = interval_us.max(1);
    let tat = tat_us.unwrap_or(now_us).max(now_us);
    let tolerance = interval.saturating_mul(u64::from(burst.max(1)) - 1);
    let wait = (tat - now_us).saturating_sub(tolerance);
    if wait > horizon_us {
        return Err(wait);
    }
    match tat.checked_add(interval) {
        Some(next) => Ok((now_us + wait, next)),
        None => Err(u64::MAX),
    }
}

/// The Nak delay of a delivery that must wait `wait_us` (from [`take_up_to`]) plus a
/// random `spread_us`: never zero, at most [`MAX_WAIT`].
pub fn wait_delay(wait_us: u64, spread_us: u64) -> Duration {
    let max = MAX_WAIT.as_micros() as u64;
    Duration::from_micros(wait_us.saturating_add(spread_us).clamp(1, max))
}

/// Tokens left at `now` (for the gauge): `burst − (TAT − now) / interval`, ≥ 0.
pub fn tokens(tat_us: u64, now_us: u64, interval_us: u64, burst: u32) -> f64 {
    let ahead = tat_us.saturating_sub(now_us) as f64;
    (f64::from(burst) - ahead / interval_us.max(1) as f64).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_one_per_interval() {
        let (interval, burst) = (50_000, 3); // 20/s, burst 3
        let mut tat = None;
        let now = 1_000_000;
        for _ in 0..3 {
            tat = Some(take(tat, now, interval, burst).expect("within the burst"));
        }
        let wait = take(tat, now, interval, burst).unwrap_err();
        assert_eq!(wait, interval, "the next token is one interval away");
        assert!(take(tat, now + wait, interval, burst).is_ok());
        // Over any window: at most burst + rate × window starts.
        let mut tat = None;
        let mut passed = 0;
        for t in (0..1_000_000).step_by(1_000) {
            if let Ok(next) = take(tat, t, interval, burst) {
                tat = Some(next);
                passed += 1;
            }
        }
        assert!(passed <= 3 + 20, "{passed}");
        assert!(passed >= 20, "{passed}");
        assert_eq!(tokens(1_000_000, 1_000_000, interval, burst), 3.0);
        // A batch takes what the burst allows, no more.
        assert_eq!(
            take_up_to(None, now, interval, burst, 10),
            Ok((3, now + 3 * interval))
        );
        assert_eq!(
            take_up_to(None, now, interval, burst, 2),
            Ok((2, now + 2 * interval))
        );
        let full = Some(now + 3 * interval);
        assert_eq!(take_up_to(full, now, interval, burst, 5), Err(interval));
        assert_eq!(
            take_up_to(full, now + interval, interval, burst, 5),
            Ok((1, now + 4 * interval))
        );
    }

    use crate::limits::model::{MAX_BURST, MAX_RATE, MIN_RATE};
    use proptest::prelude::*;

    /// A rate anywhere in the accepted range (log-uniform), or one of its edges and rates
    /// whose interval is not a whole µs.
    fn rate() -> impl Strategy<Value = f64> {
        prop_oneof![
            (MIN_RATE.log10()..=MAX_RATE.log10())
                .prop_map(|e| 10f64.powf(e).clamp(MIN_RATE, MAX_RATE)),
            prop::sample::select(vec![
                MIN_RATE, MAX_RATE, 99_999.0, 70_155.8, 30_000.0, 7.0, 3.0, 1.0, 0.3, 1.5e-6
            ]),
        ]
    }

    /// A burst anywhere in the accepted range, small ones often (they bind sooner).
    fn burst() -> impl Strategy<Value = u32> {
        prop_oneof![1u32..=8, 1u32..=MAX_BURST, Just(MAX_BURST)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        /// Over the whole accepted range of rate and burst, from any stored TAT, on a
        /// simulated clock: never more than `burst + rate × w` tokens in any window `w`,
        /// the TAT moves exactly `got` intervals on (no wrap, no saturation), a wait is
        /// never zero and is exact (the token is due then, not a µs sooner), and its Nak
        /// delay is between 1 µs and an hour.
        #[test]
        fn never_more_than_burst_plus_rate_times_window(
            rate in rate(), burst in burst(),
            stored in prop_oneof![Just(None), any::<u64>().prop_map(Some), (0u64..1 << 56).prop_map(Some)],
            start in 0u64..1 << 55,
            steps in prop::collection::vec((0.0f64..3.0, 0u64..200, any::<bool>(), 1u32..=64), 1..150),
            spread in any::<u64>(),
        ) {
            let interval = interval_us(rate);
            let (mut tat, mut now) = (stored, start);
            let mut grants: Vec<(u64, u64)> = Vec::new();
            for (frac, small, by_interval, want) in steps {
                now += if by_interval { (interval as f64 * frac) as u64 } else { small };
                match take_up_to(tat, now, interval, burst, want) {
                    Ok((got, next)) => {
                        prop_assert!(got >= 1 && got <= want);
                        let from = tat.unwrap_or(now).max(now);
                        prop_assert_eq!(Some(next), from.checked_add(interval * u64::from(got)));
                        tat = Some(next);
                        grants.push((now, u64::from(got)));
                    }
                    Err(wait) => {
                        prop_assert!(wait >= 1, "a zero wait while over the limit");
                        let delay = wait_delay(wait, spread % (interval * 4 + 1));
                        prop_assert!(delay >= Duration::from_micros(1) && delay <= MAX_WAIT);
                        let recordable = tat.and_then(|t| t.checked_add(interval)).is_some();
                        if let Some(due) = now.checked_add(wait).filter(|_| wait < u64::MAX && recordable) {
                            prop_assert!(take_up_to(tat, due, interval, burst, 1).is_ok(), "not due after the wait");
                            prop_assert!(take_up_to(tat, due - 1, interval, burst, 1).is_err(), "due before the wait");
                        }
                    }
                }
            }
            for (i, first) in grants.iter().enumerate() {
                let mut n = 0u64;
                for g in &grants[i..] {
                    n += g.1;
                    let w = (g.0 - first.0) as f64 / 1e6;
                    prop_assert!(
                        n as f64 <= f64::from(burst) + rate * w + 1e-6,
                        "{} tokens in {} s at {}/s, burst {}", n, w, rate, burst
                    );
                }
            }
        }

        /// Reservations (a denied delivery booking the next token within a horizon)
        /// mixed with takes: the *due times* of all tokens — when handlers may start —
        /// never exceed `burst + rate × w` in any window `w`; a reservation is never due
        /// before `now` nor past the horizon; a refusal says exactly when one would fit.
        #[test]
        fn reservations_keep_the_bound_on_due_times(
            rate in rate(), burst in burst(),
            start in 0u64..1 << 55,
            steps in prop::collection::vec((0.0f64..2.0, any::<bool>(), 1u32..=8, 0u64..3_000_000), 1..150),
        ) {
            let interval = interval_us(rate);
            let (mut tat, mut now) = (None, start);
            let mut due: Vec<u64> = Vec::new();
            for (frac, reserving, want, horizon) in steps {
                now += (interval as f64 * frac) as u64;
                if reserving {
                    match reserve(tat, now, interval, burst, horizon) {
                        Ok((at, next)) => {
                            prop_assert!(at >= now && at - now <= horizon);
                            prop_assert_eq!(Some(next), tat.unwrap_or(now).max(now).checked_add(interval));
                            tat = Some(next);
                            due.push(at);
                        }
                        Err(wait) => {
                            prop_assert!(wait > horizon);
                            prop_assert!(reserve(tat, now, interval, burst, wait).is_ok());
                        }
                    }
                } else if let Ok((got, next)) = take_up_to(tat, now, interval, burst, want) {
                    tat = Some(next);
                    due.extend(std::iter::repeat_n(now, got as usize));
                }
            }
            due.sort_unstable();
            for (i, first) in due.iter().enumerate() {
                for (n, at) in due[i..].iter().enumerate() {
                    let w = (at - first) as f64 / 1e6;
                    prop_assert!(
                        (n + 1) as f64 <= f64::from(burst) + rate * w + 1e-6,
                        "{} due in {} s at {}/s, burst {}", n + 1, w, rate, burst
                    );
                }
            }
        }

        /// Whatever the inputs, even outside the accepted range: no overflow (a debug build
        /// panics on one), never a zero wait, and a grant is recorded exactly.
        #[test]
        fn any_input_saturates(
            tat in any::<Option<u64>>(), now in any::<u64>(), interval in any::<u64>(),
            burst in any::<u32>(), want in any::<u32>(), rate in any::<f64>(),
        ) {
            let i = interval_us(rate);
            prop_assert!((1..=MAX_INTERVAL_US).contains(&i));
            match take_up_to(tat, now, interval, burst, want) {
                Ok((got, next)) => {
                    let from = tat.unwrap_or(now).max(now);
                    prop_assert_eq!(Some(next), from.checked_add(interval.max(1) * u64::from(got)));
                    prop_assert!(got >= 1);
                }
                Err(wait) => prop_assert!(wait >= 1),
            }
            prop_assert!(tokens(tat.unwrap_or(0), now, interval, burst) >= 0.0);
        }

        /// The interval never lets the rate be exceeded, and stays within the bounds.
        #[test]
        fn the_interval_is_never_shorter_than_the_rate_allows(rate in rate()) {
            let i = interval_us(rate);
            prop_assert!(i as f64 * rate >= 1e6 * (1.0 - 1e-12), "{} µs at {}/s", i, rate);
            prop_assert!(i < MAX_INTERVAL_US);
        }
    }

    #[test]
    fn rates_outside_the_range_and_long_waits_are_clamped() {
        for bad in [
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            0.0,
            -5.0,
            1e-20,
            1e-11,
        ] {
            let i = interval_us(bad);
            assert!((1..=MAX_INTERVAL_US).contains(&i), "{bad}: {i}");
        }
        // What broke: at 1e-20/s the interval saturated and the TAT wrapped,
        // so every take passed; at 1e-11/s the wait overflowed the broker's delay.
        let now = 1_700_000_000_000_000;
        let tat = take(None, now, interval_us(1e-20), 1).unwrap();
        assert!(take(Some(tat), now + 1_000_000, interval_us(1e-20), 1).is_err());
        assert_eq!(take(Some(u64::MAX), now, 1, 1), Err(u64::MAX - now));
        assert_eq!(take(Some(u64::MAX - 1), u64::MAX - 1, 10, 5), Err(u64::MAX));
        assert_eq!(wait_delay(u64::MAX, u64::MAX), MAX_WAIT);
        assert_eq!(wait_delay(0, 0), Duration::from_micros(1));
    }
}
