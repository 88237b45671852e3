//! The settings file and the settings' words, read by ax-sdk (`ax_sdk::settings::file`)
//! so that `runtime.yaml` means the same to the Python runtime as to `ax apply -f`.

use crate::errors;
use ax_sdk::settings::file::{read_tasks, TaskEntry};
use pyo3::prelude::*;

/// The `tasks:` section of a settings file (the parsed file as JSON text): a list of
/// `(queue, name, settings JSON)`, checked; an `InvalidInput` naming the bad field
/// (`tasks.<name>.<field>`). Empty if the file has no `tasks:`.
#[pyfunction]
pub fn read_settings_file(doc: &[u8]) -> PyResult<Vec<(String, String, String)>> {
    let doc: serde_json::Value = serde_json::from_slice(doc)
        .map_err(|e| errors::invalid(format!("the settings file: {e}")))?;
    let tasks = read_tasks(&doc).map_err(|e| errors::wire(&e))?;
    Ok(tasks
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            let json = serde_json::to_string(&t.settings).expect("serializes");
            (t.queue, t.name, json)
        })
        .collect())
}

/// One task's settings in the file's words (`retries`, `timeout`, ... as JSON text) as
/// stored settings JSON, checked; errors name `<at>.<field>`.
#[pyfunction]
pub fn settings_of(values: &[u8], at: &str) -> PyResult<String> {
    let entry: TaskEntry =
        serde_json::from_slice(values).map_err(|e| errors::invalid(format!("{at}: {e}")))?;
    let settings = entry.settings(at).map_err(|e| errors::wire(&e))?;
    Ok(serde_json::to_string(&settings).expect("serializes"))
}
