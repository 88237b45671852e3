//! The token bucket as GCRA (generic cell rate algorithm): one number per bucket, the
//! theoretical arrival time (TAT), updated by compare-and-set. A start is allowed when
//! `TAT − now ≤ (burst − 1) × interval`; it moves the TAT one interval on. So over any
//! window of length `w` at most `burst + rate × w` starts pass, whoever takes them.

/// The outcome of one take: the new TAT to store, or how long to wait (µs).
pub fn take(tat_us: Option<u64>, now_us: u64, interval_us: u64, burst: u32) -> Result<u64, u64> {
    let tat = tat_us.unwrap_or(now_us).max(now_us);
    let tolerance = interval_us.saturating_mul(u64::from(burst.max(1)) - 1);
    let ahead = tat - now_us;
    if ahead > tolerance {
        Err(ahead - tolerance)
    } else {
        Ok(tat + interval_us)
    }
}

/// Takes up to `want` tokens at once (a worker's batch): how many it got and the new TAT,
/// or how long to wait for one (µs). Taking `k` is allowed when the `k`-th would be: the
/// TAT moves `k` intervals on.
pub fn take_up_to(
    tat_us: Option<u64>,
    now_us: u64,
    interval_us: u64,
    burst: u32,
    want: u32,
) -> Result<(u32, u64), u64> {
    let tat = tat_us.unwrap_or(now_us).max(now_us);
    let tolerance = interval_us.saturating_mul(u64::from(burst.max(1)) - 1);
    let ahead = tat - now_us;
    if ahead > tolerance {
        return Err(ahead - tolerance);
    }
    let available = (tolerance - ahead) / interval_us.max(1) + 1;
    let got = available.min(u64::from(want.max(1))) as u32;
    Ok((got, tat + interval_us * u64::from(got)))
}

/// Tokens left at `now` (for the gauge): `burst − ceil((TAT − now) / interval)`, ≥ 0.
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
}
