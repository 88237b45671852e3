//! Metric label values a worker takes from task data, kept to a bounded set: task names
//! come from producers and error classes from handler code, so neither may create an
//! unbounded number of Prometheus series.

use std::collections::HashSet;
use std::sync::Mutex;

/// Most distinct values per label; later ones are counted under `_other`.
pub(crate) const MAX_VALUES: usize = 100;

#[derive(Debug, Default)]
pub(crate) struct Labels {
    tasks: Mutex<HashSet<String>>,
    classes: Mutex<HashSet<String>>,
    /// Unserved task names already warned about (bounded like the labels).
    unserved: Mutex<HashSet<String>>,
}

fn bounded(seen: &Mutex<HashSet<String>>, value: &str) -> String {
    let mut seen = seen.lock().expect("not poisoned");
    if seen.contains(value) {
        return value.to_string();
    }
    if seen.len() >= MAX_VALUES {
        return "_other".to_string();
    }
    seen.insert(value.to_string());
    value.to_string()
}

fn well_formed(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 64
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.:-".contains(&b))
}

impl Labels {
    /// The `task` label for a task name.
    pub(crate) fn task(&self, name: &str) -> String {
        if !well_formed(name) {
            return "_invalid".to_string();
        }
        bounded(&self.tasks, name)
    }

    /// True the first time `name` is seen unserved (to warn once per name, for at most
    /// [`MAX_VALUES`] names).
    pub(crate) fn first_unserved(&self, name: &str) -> bool {
        let mut seen = self.unserved.lock().expect("not poisoned");
        seen.len() < MAX_VALUES && seen.insert(name.to_string())
    }

    /// The `class` label for an error class.
    pub(crate) fn class(&self, class: &str) -> String {
        if !well_formed(class) {
            return "_invalid".to_string();
        }
        bounded(&self.classes, class)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_bounded_and_well_formed() {
        let labels = Labels::default();
        for i in 0..MAX_VALUES {
            assert_eq!(labels.task(&format!("t{i}")), format!("t{i}"));
        }
        assert_eq!(labels.task("one-too-many"), "_other");
        assert_eq!(labels.task("t7"), "t7", "known values keep their label");
        assert_eq!(labels.class("bad class\n"), "_invalid");
        assert_eq!(labels.class("io"), "io");
    }
}
