//! The gate's decision over one read of a rate bucket, pure: time, the bucket and whether
//! the worker may hold the delivery come in as values; the gate (`gate.rs`) does the I/O
//! around it (read the bucket, take a hold permit, write the new TAT, draw the spread).

use super::gcra;
use std::time::Duration;

/// How long tokens a worker took in a batch stay usable (unused ones are dropped: never
/// more starts than allowed, at most this much later than their token).
pub(crate) const BATCH_LIFETIME: Duration = Duration::from_millis(2);

/// Most tokens one read of a bucket takes for a worker's batch.
pub(crate) const MAX_BATCH_TOKENS: u32 = 64;

/// Tokens one read takes at `rate` per second: what the rate gives in
/// [`BATCH_LIFETIME`], at least 1, at most [`MAX_BATCH_TOKENS`].
pub(crate) fn batch_size(rate: f64) -> u32 {
    let want = (rate * BATCH_LIFETIME.as_secs_f64()).ceil();
    if want.is_nan() || want < 1.0 {
        1
    } else {
        (want as u32).clamp(1, MAX_BATCH_TOKENS)
    }
}

/// One read of a rate bucket, at `now_us` (µs since the epoch, the lead included).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BucketRead {
    /// The stored TAT (`None`: a fresh bucket).
    pub(crate) tat: Option<u64>,
    pub(crate) now_us: u64,
    /// The interval of the rate in force.
    pub(crate) interval_us: u64,
    pub(crate) burst: u32,
    /// Tokens wanted at once ([`batch_size`]).
    pub(crate) want: u32,
    /// How far ahead a token may be reserved for a held delivery.
    pub(crate) horizon_us: u64,
}

/// Whether the delivery may wait in the worker for a reserved token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// It holds a hold permit already (an earlier limit reserved for it).
    Held,
    /// It holds none; the worker may have one free.
    MayTake,
    /// It holds none and the worker has none free.
    No,
}

/// What the delivery does after one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenStep {
    /// Store `next_tat` (compare-and-set) and take `got` tokens, the first due at `due_us`
    /// (`now_us` when free now; later when reserved, and then `got` is 1).
    Take {
        got: u32,
        next_tat: u64,
        due_us: u64,
    },
    /// A token is due within the horizon: take a hold permit and decide again with
    /// [`Hold::Held`] (or [`Hold::No`] if none was free).
    TakeHold,
    /// Hand the delivery back after `after_us` plus a random spread of up to
    /// `spread_up_to_us` (so a backlog does not come back at one instant): it returns
    /// while the token is within the horizon, so it can be reserved then.
    Back { after_us: u64, spread_up_to_us: u64 },
}

/// The decision for one read: tokens free now are taken (up to `want`); else a token due
/// within the horizon is reserved for a delivery that holds (or may take) a hold permit;
/// else the delivery goes back until the token is within half the horizon, spread over up
/// to half the horizon (never longer than the wait itself).
pub(crate) fn token_step(read: &BucketRead, hold: Hold) -> TokenStep {
    let BucketRead {
        tat,
        now_us,
        interval_us,
        burst,
        want,
        horizon_us,
    } = *read;
    let wait = match gcra::take_up_to(tat, now_us, interval_us, burst, want) {
        Ok((got, next_tat)) => {
            return TokenStep::Take {
                got,
                next_tat,
                due_us: now_us,
            }
        }
        Err(wait) => wait,
    };
    match hold {
        Hold::MayTake if wait <= horizon_us => return TokenStep::TakeHold,
        Hold::Held => {
            if let Ok((due_us, next_tat)) =
                gcra::reserve(tat, now_us, interval_us, burst, horizon_us)
            {
                return TokenStep::Take {
                    got: 1,
                    next_tat,
                    due_us,
                };
            }
        }
        Hold::MayTake | Hold::No => {}
    }
    let half = horizon_us / 2;
    TokenStep::Back {
        after_us: wait.saturating_sub(half),
        spread_up_to_us: half.min(wait),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000;

    /// 10 per second (one token each 100 ms), burst 1, a 1 s horizon.
    fn read(tat: Option<u64>, want: u32) -> BucketRead {
        BucketRead {
            tat,
            now_us: 100 * SEC,
            interval_us: SEC / 10,
            burst: 1,
            want,
            horizon_us: SEC,
        }
    }

    #[test]
    fn a_fresh_bucket_gives_what_its_burst_allows_now() {
        let mut r = read(None, 8);
        assert_eq!(
            token_step(&r, Hold::No),
            TokenStep::Take {
                got: 1,
                next_tat: 100 * SEC + SEC / 10,
                due_us: 100 * SEC
            }
        );
        r.burst = 5;
        let TokenStep::Take { got, due_us, .. } = token_step(&r, Hold::No) else {
            panic!("free tokens are taken")
        };
        assert_eq!((got, due_us), (5, r.now_us), "the burst, not the 8 wanted");
    }

    #[test]
    fn a_token_due_within_the_horizon_is_reserved_only_for_a_held_delivery() {
        // The next token is due in 300 ms.
        let r = read(Some(100 * SEC + 300_000), 4);
        assert_eq!(token_step(&r, Hold::MayTake), TokenStep::TakeHold);
        assert_eq!(
            token_step(&r, Hold::Held),
            TokenStep::Take {
                got: 1,
                next_tat: 100 * SEC + 400_000,
                due_us: 100 * SEC + 300_000
            },
            "one token, due when the bucket allows it"
        );
        assert_eq!(
            token_step(&r, Hold::No),
            TokenStep::Back {
                after_us: 0,
                spread_up_to_us: 300_000
            },
            "no hold free: back at once, spread over no more than the wait"
        );
    }

    #[test]
    fn a_token_beyond_the_horizon_sends_the_delivery_back_until_it_is_within_reach() {
        // The next token is due in 5 s: nothing is reserved, whatever the hold.
        let r = read(Some(105 * SEC), 1);
        let back = TokenStep::Back {
            after_us: 5 * SEC - SEC / 2,
            spread_up_to_us: SEC / 2,
        };
        for hold in [Hold::Held, Hold::MayTake, Hold::No] {
            assert_eq!(token_step(&r, hold), back, "{hold:?}");
        }
    }

    #[test]
    fn the_batch_follows_the_rate_within_its_bounds() {
        assert_eq!(batch_size(1.0), 1);
        assert_eq!(batch_size(1_000.0), 2);
        assert_eq!(batch_size(100_000.0), MAX_BATCH_TOKENS);
        assert_eq!(batch_size(f64::NAN), 1);
        assert_eq!(batch_size(0.0), 1);
    }
}
