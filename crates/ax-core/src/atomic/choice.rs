//! Group commit or single publishes: chosen from what the broker answers.
//!
//! An atomic batch costs nats-server more CPU than the same messages published one by one
//! (it stages them and checks each at the commit), and saves one stored write, one fsync
//! under `sync_interval: always`, for every message after the first. Which of the two is
//! faster depends on the broker's settings and its disk, which a client cannot read; so
//! [`Chooser`] measures, in windows of [`WINDOW`], each way's answers a second and their
//! mean latency (publish → answer), and compares a window with the latest one of the
//! other way:
//!
//! - one way answers sooner (mean below [`MARGIN`] of the other's) and no less often (at
//!   least [`MARGIN`] of the other's rate): it is faster. That covers a saturated stream
//!   (the faster way answers more and sooner) and a load that is bounded elsewhere (the
//!   same rate; the faster way answers sooner);
//! - both within the margins: a tie, the choice stays;
//! - one answers both more often and later: the load changed between the windows (more
//!   work offered queues longer), which says nothing of the ways: the two are measured
//!   again, one window each, until a comparison decides.
//!
//! Once decided, every [`EXPLOIT`] windows one window of the other way measures it again.

use std::time::{Duration, Instant};

/// How a message goes to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Way {
    /// In the next atomic batch of its lane.
    Grouped = 0,
    /// A publish of its own.
    Single = 1,
}

impl Way {
    fn other(self) -> Way {
        match self {
            Way::Grouped => Way::Single,
            Way::Single => Way::Grouped,
        }
    }
}

/// A window measures one way for at least this long.
pub(super) const WINDOW: Duration = Duration::from_millis(250);
/// A window decides only with this many answers: below it either way answers as fast.
pub(super) const MIN_SAMPLES: u32 = 64;
/// A window that gathers too few answers in this many times [`WINDOW`] starts again.
const GIVE_UP: u32 = 8;
/// Windows of the chosen way between two of the other.
pub(super) const EXPLOIT: u32 = 20;
/// What "sooner" and "no less often" allow (see the module's doc).
const MARGIN: f64 = 0.9;

/// What one window measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Measure {
    /// Mean latency, publish → answer.
    pub mean: Duration,
    /// Answers a second.
    pub rate: f64,
}

impl Measure {
    /// Whether `self` answers sooner than `other` (beyond the margin).
    fn sooner(&self, other: &Measure) -> bool {
        self.mean.as_secs_f64() < other.mean.as_secs_f64() * MARGIN
    }

    /// Whether one of the two answers sooner and the other more often: the load changed.
    fn unclear(&self, other: &Measure) -> bool {
        let oftener = |a: &Measure, b: &Measure| a.rate * MARGIN > b.rate;
        (self.sooner(other) && oftener(other, self)) || (other.sooner(self) && oftener(self, other))
    }
}

/// The measured choice of one [`super::Grouped`].
#[derive(Debug)]
pub(super) struct Chooser {
    state: std::sync::Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The way being measured now.
    way: Way,
    /// The way found faster (grouping until a comparison decides).
    best: Way,
    /// Comparing: each window is compared with the other way's latest, until one decides.
    comparing: bool,
    start: Instant,
    total: Duration,
    count: u32,
    /// Each way's latest window.
    last: [Option<Measure>; 2],
    /// Windows of `best` left before one of the other way.
    until_other: u32,
}

impl Chooser {
    /// Starts grouping, and measures single publishes after the first window.
    pub(super) fn new(now: Instant) -> Chooser {
        Chooser {
            state: std::sync::Mutex::new(State {
                way: Way::Grouped,
                best: Way::Grouped,
                comparing: true,
                start: now,
                total: Duration::ZERO,
                count: 0,
                last: [None, None],
                until_other: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The way to send the next message.
    pub(super) fn way(&self) -> Way {
        self.lock().way
    }

    /// Counts one answer: `latency` of a message sent `way`, answered at `now`. Answers
    /// the new choice and both ways' latest windows when a window changed it.
    pub(super) fn record(
        &self,
        way: Way,
        latency: Duration,
        now: Instant,
    ) -> Option<(Way, [Option<Measure>; 2])> {
        let mut s = self.lock();
        if way != s.way {
            return None; // sent before the last switch
        }
        s.total += latency;
        s.count += 1;
        let elapsed = now.saturating_duration_since(s.start);
        if elapsed < WINDOW {
            return None;
        }
        if s.count < MIN_SAMPLES {
            if elapsed >= WINDOW * GIVE_UP {
                s.restart(now);
            }
            return None;
        }
        let this = Measure {
            mean: s.total / s.count,
            rate: f64::from(s.count) / elapsed.as_secs_f64(),
        };
        s.last[way as usize] = Some(this);
        s.restart(now);
        let before = s.best;
        if !s.comparing {
            s.until_other = s.until_other.saturating_sub(1);
            if s.until_other == 0 {
                s.way = way.other();
                s.comparing = true;
            }
            return None;
        }
        match s.last[way.other() as usize] {
            Some(other) if this.unclear(&other) => s.way = way.other(),
            None => s.way = way.other(),
            Some(other) => {
                // Not unclear: the one that answers sooner answers no less often.
                if this.sooner(&other) {
                    s.best = way;
                } else if other.sooner(&this) {
                    s.best = way.other();
                }
                s.way = s.best;
                s.comparing = false;
                s.until_other = EXPLOIT;
            }
        }
        (s.best != before).then_some((s.best, s.last))
    }
}

impl State {
    fn restart(&mut self, now: Instant) {
        self.start = now;
        self.total = Duration::ZERO;
        self.count = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds one window of `way`: `n` answers (at least [`MIN_SAMPLES`]) spread over
    /// [`WINDOW`], each `ms` milliseconds after its publish; answers the way to send next.
    fn window(c: &Chooser, now: &mut Instant, way: Way, ms: u64, n: u32) -> Way {
        let step = WINDOW / n + Duration::from_nanos(1);
        for _ in 0..n {
            *now += step;
            c.record(way, Duration::from_millis(ms), *now);
        }
        c.way()
    }

    #[test]
    fn the_way_the_broker_answers_faster_is_chosen_and_measured_again() {
        let mut now = Instant::now();
        // A broker that fsyncs each write, saturated: groups answer sooner and more.
        let c = Chooser::new(now);
        assert_eq!(c.way(), Way::Grouped);
        assert_eq!(window(&c, &mut now, Way::Grouped, 2, 1000), Way::Single);
        assert_eq!(window(&c, &mut now, Way::Single, 8, 400), Way::Grouped);
        for _ in 1..EXPLOIT {
            assert_eq!(window(&c, &mut now, Way::Grouped, 2, 1000), Way::Grouped);
        }
        // After EXPLOIT windows, one of the other way: still slower, so back.
        assert_eq!(window(&c, &mut now, Way::Grouped, 2, 1000), Way::Single);
        assert_eq!(window(&c, &mut now, Way::Single, 8, 400), Way::Grouped);

        // A broker that does not fsync: single publishes answer sooner and more.
        let c = Chooser::new(now);
        assert_eq!(window(&c, &mut now, Way::Grouped, 3, 2000), Way::Single);
        assert_eq!(window(&c, &mut now, Way::Single, 2, 3000), Way::Single);
        for _ in 1..EXPLOIT {
            assert_eq!(window(&c, &mut now, Way::Single, 2, 3000), Way::Single);
        }
        assert_eq!(window(&c, &mut now, Way::Single, 2, 3000), Way::Grouped);
        // The broker changed (its disk got slow, singles queue behind fsyncs): the choice
        // follows.
        assert_eq!(window(&c, &mut now, Way::Grouped, 1, 3000), Way::Grouped);

        // The load is bounded elsewhere (the same rate both ways): sooner decides.
        let c = Chooser::new(now);
        window(&c, &mut now, Way::Grouped, 5, 500);
        assert_eq!(window(&c, &mut now, Way::Single, 2, 500), Way::Single);
    }

    #[test]
    fn a_load_that_changes_between_windows_decides_nothing() {
        let mut now = Instant::now();
        // Grouped measured while the load was light, single publishes under a heavy
        // load (more answers, each later): unclear, both are measured again.
        let c = Chooser::new(now);
        window(&c, &mut now, Way::Grouped, 1, 100);
        assert_eq!(window(&c, &mut now, Way::Single, 50, 2000), Way::Grouped);
        // Under the same heavy load grouping answers sooner and more: it is chosen.
        assert_eq!(window(&c, &mut now, Way::Grouped, 20, 4000), Way::Grouped);
        for _ in 1..EXPLOIT {
            assert_eq!(window(&c, &mut now, Way::Grouped, 20, 4000), Way::Grouped);
        }
        assert_eq!(window(&c, &mut now, Way::Grouped, 20, 4000), Way::Single);
    }

    #[test]
    fn close_means_keep_the_choice_and_few_answers_decide_nothing() {
        let mut now = Instant::now();
        let c = Chooser::new(now);
        window(&c, &mut now, Way::Grouped, 100, 500);
        // 5 % sooner is within the margin: grouping stays.
        assert_eq!(window(&c, &mut now, Way::Single, 95, 500), Way::Grouped);
        // A light load (a few answers a second) never ends a window.
        let c = Chooser::new(now);
        for _ in 0..MIN_SAMPLES - 1 {
            now += WINDOW;
            assert_eq!(c.record(Way::Grouped, Duration::from_millis(1), now), None);
        }
        assert_eq!(c.way(), Way::Grouped);
        // Answers of the way before a switch are not counted for the new one.
        let c = Chooser::new(now);
        window(&c, &mut now, Way::Grouped, 1, 100);
        for _ in 0..MIN_SAMPLES * 2 {
            now += WINDOW;
            c.record(Way::Grouped, Duration::from_secs(1), now);
        }
        assert_eq!(c.way(), Way::Single);
    }
}
