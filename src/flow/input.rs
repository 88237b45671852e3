//! The payload of a step's task: the run's input, the parents' outputs by step name, the
//! item of a fan-out, and the template's own payload (docs/PROTOCOL.md §6).
//!
//! ```json
//! {"flow": "thumbnails", "run": "…", "step": "report",
//!  "input": {…},                      // the run's input
//!  "parents": {"resize": [o0, o1]},   // outputs of succeeded parents (a fan-out: a list, in item order)
//!  "errors": {"cleanup": {"state": "failed", "class": "…", "message": "…"}},
//!  "item": …, "index": 3,             // a fan-out step: its item and the item's index
//!  "args": …}                         // the step template's `payload`
//! ```

use crate::output::TaskOutput;
use crate::state::ErrorInfo;
use serde_json::{json, Map, Value};

/// A parent's outcome as a step sees it.
#[derive(Debug, Clone)]
pub(crate) enum Parent {
    /// It succeeded with this output (`null` for none).
    Output(Value),
    /// It failed, was skipped or cancelled.
    Ended {
        state: &'static str,
        error: Option<ErrorInfo>,
    },
}

/// A task output as JSON: the value itself, or `{content_type, base64}` for bytes.
pub(crate) fn output_value(out: Option<TaskOutput>) -> Value {
    let Some(out) = out else { return Value::Null };
    if out.is_json {
        if let Ok(v) = serde_json::from_slice(&out.bytes) {
            return v;
        }
    }
    use base64::Engine as _;
    json!({"content_type": "application/octet-stream",
           "base64": base64::engine::general_purpose::STANDARD.encode(&out.bytes)})
}

/// What every task of one step shares.
pub(crate) struct StepInput<'a> {
    pub(crate) flow: &'a str,
    pub(crate) run: &'a str,
    pub(crate) step: &'a str,
    pub(crate) input: &'a Value,
    pub(crate) parents: Vec<(&'a str, Parent)>,
    pub(crate) args: Option<&'a Value>,
}

impl StepInput<'_> {
    /// The payload of one task: `item` is `(index, value)` for a fan-out step.
    pub(crate) fn payload(&self, item: Option<(u32, &Value)>) -> Value {
        let mut body = Map::new();
        body.insert("flow".into(), json!(self.flow));
        body.insert("run".into(), json!(self.run));
        body.insert("step".into(), json!(self.step));
        body.insert("input".into(), self.input.clone());
        let mut outputs = Map::new();
        let mut errors = Map::new();
        for (name, parent) in &self.parents {
            match parent {
                Parent::Output(v) => {
                    outputs.insert(name.to_string(), v.clone());
                }
                Parent::Ended { state, error } => {
                    let mut e = json!({ "state": state });
                    if let Some(error) = error {
                        e["class"] = json!(error.class);
                        e["message"] = json!(error.message);
                    }
                    errors.insert(name.to_string(), e);
                }
            }
        }
        body.insert("parents".into(), Value::Object(outputs));
        if !errors.is_empty() {
            body.insert("errors".into(), Value::Object(errors));
        }
        if let Some((index, value)) = item {
            body.insert("item".into(), value.clone());
            body.insert("index".into(), json!(index));
        }
        if let Some(args) = self.args {
            body.insert("args".into(), args.clone());
        }
        Value::Object(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_names_parents_errors_and_items() {
        let input = json!({"order": 7});
        let args = json!({"size": 64});
        let step = StepInput {
            flow: "f",
            run: "R",
            step: "s",
            input: &input,
            parents: vec![
                ("a", Parent::Output(json!([1, 2]))),
                (
                    "b",
                    Parent::Ended {
                        state: "failed",
                        error: Some(ErrorInfo {
                            detail: None,
                            class: "boom".into(),
                            message: "m".into(),
                        }),
                    },
                ),
            ],
            args: Some(&args),
        };
        let p = step.payload(Some((3, &json!("x"))));
        assert_eq!(p["input"]["order"], 7);
        assert_eq!(p["parents"]["a"], json!([1, 2]));
        assert_eq!(p["errors"]["b"]["class"], "boom");
        assert_eq!(
            (p["item"].clone(), p["index"].clone()),
            (json!("x"), json!(3))
        );
        assert_eq!(p["args"]["size"], 64);
        let bytes = output_value(Some(TaskOutput {
            bytes: vec![0u8, 1].into(),
            is_json: false,
        }));
        assert_eq!(bytes["base64"], "AAE=");
        assert_eq!(output_value(None), Value::Null);
    }
}
