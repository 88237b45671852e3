//! Integration tests: every test talks to a real nats-server started for it.
//! Run with `./dev test` (it installs the pinned nats-server when none is found).

mod apply;
mod batch;
mod browser;
mod budget;
mod chaos;
mod console;
mod console_guard;
mod decoders;
mod delay;
mod faults;
mod fields;
mod first_attempt;
mod flows;
mod follow;
mod kv_read;
mod limits;
mod limits_pace;
mod monitoring;
mod names;
mod ops;
mod outputs;
mod partitions;
mod procs;
mod registry;
mod retry;
mod security;
mod settings;
mod streams;
mod submit;
mod supervisor;
mod support;
mod triggers;
mod typed_kv;
mod wire;
mod worker;
