//! Journal lines written by this process's own worker (the flow lister), in the format of
//! `ax worker --example --journal` (one `write` per line, appended to the same file).

use ax_core::time::now_ms;
use ax_sdk::worker::Task;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

#[derive(Clone)]
pub struct Journal(Arc<Mutex<std::fs::File>>);

impl Journal {
    pub fn open(path: &Path) -> Journal {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("the journal opens");
        Journal(Arc::new(Mutex::new(file)))
    }

    fn line(&self, value: serde_json::Value) {
        let mut text = value.to_string();
        text.push('\n');
        let _ = self.0.lock().unwrap().write_all(text.as_bytes());
    }

    /// Journals a handler start; the returned run journals its end (`stopped` if dropped
    /// before [`Run::end`]: the worker stopped the handler).
    pub fn start(&self, task: &Task, token: u64, worker: &str) -> Run {
        self.line(serde_json::json!({
            "event": "start", "id": task.id, "attempt": task.attempt, "token": token,
            "worker": worker, "name": task.name, "at_ms": now_ms(),
        }));
        Run {
            journal: self.clone(),
            id: task.id.clone(),
            attempt: task.attempt,
            token,
            done: false,
        }
    }
}

pub struct Run {
    journal: Journal,
    id: String,
    attempt: u32,
    token: u64,
    done: bool,
}

impl Run {
    /// Journals the end: `ok`, or `err:<class>`.
    pub fn end(&mut self, result: Result<(), &str>) {
        self.done = true;
        let outcome = match result {
            Ok(()) => "ok".to_string(),
            Err(class) => format!("err:{class}"),
        };
        self.write(&outcome);
    }

    fn write(&self, outcome: &str) {
        self.journal.line(serde_json::json!({
            "event": "end", "id": self.id, "token": self.token, "attempt": self.attempt,
            "outcome": outcome, "at_ms": now_ms(),
        }));
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.done {
            self.write("stopped");
        }
    }
}
