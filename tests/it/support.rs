//! The test environment lives in `ax-testkit` (feature `env`), shared with the campaign.

pub use ax_testkit::env::*;
