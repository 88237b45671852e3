//! The batching rule (docs/PROTOCOL.md §2, "Batching"), from the producers' log and the
//! workers' journals (each start of a batch's task journals the `item` of every element
//! of its list): an item answered with a batch's id is in that batch's list and in no
//! other; no list holds an item twice, an item never sent, or more than the batch size;
//! every attempt of a batch runs the same list. (That each batch runs is the tasks rule:
//! its id is accepted.)

use crate::checker::Invocation;
use std::collections::{BTreeMap, HashMap, HashSet};

/// Items per batch and the longest wait of the campaign's batched submits.
pub const BATCH_SIZE: usize = 4;
pub const BATCH_TIMEOUT_MS: u64 = 300;

/// One batched submit, as its producer saw it.
#[derive(Debug, Clone)]
pub struct Batched {
    /// The item (unique in the run).
    pub item: String,
    /// The batch id it was answered with; `None` if no attempt was answered (it may be
    /// stored, in some batch, or not at all).
    pub id: Option<String>,
}

/// The batching rule over every batched submit and the journal.
pub fn check_batches(sent: &[Batched], journal: &HashMap<String, Vec<Invocation>>) -> Vec<String> {
    let mut out = Vec::new();
    let sent_items: HashSet<&str> = sent.iter().map(|b| b.item.as_str()).collect();
    // The list each batch ran with (its attempts must agree).
    let mut lists: BTreeMap<&str, &Vec<String>> = BTreeMap::new();
    for (id, runs) in journal {
        for items in runs.iter().filter_map(|r| r.items.as_ref()) {
            match lists.get(id.as_str()) {
                Some(first) if *first != items => out.push(format!(
                    "batch {id}: attempts ran different lists {first:?} and {items:?}"
                )),
                Some(_) => {}
                None => {
                    lists.insert(id, items);
                }
            }
        }
    }
    let mut holder: HashMap<&str, &str> = HashMap::new();
    for (id, items) in &lists {
        if items.len() > BATCH_SIZE {
            out.push(format!(
                "batch {id}: {} items, more than its size {BATCH_SIZE}",
                items.len()
            ));
        }
        for item in items.iter() {
            if !sent_items.contains(item.as_str()) {
                out.push(format!("batch {id}: item {item} was never sent"));
            }
            if let Some(other) = holder.insert(item, id) {
                out.push(format!("item {item} held by batch {other} and batch {id}"));
            }
        }
    }
    for b in sent {
        let Some(id) = &b.id else { continue };
        match (holder.get(b.item.as_str()), lists.contains_key(id.as_str())) {
            (Some(held), _) if *held != id => out.push(format!(
                "item {} answered with batch {id} ran in batch {held}",
                b.item
            )),
            (None, true) => out.push(format!(
                "item {} answered with batch {id} is missing from its list",
                b.item
            )),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(items: &[&str]) -> Invocation {
        Invocation {
            attempt: 1,
            items: Some(items.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        }
    }

    fn sent(item: &str, id: Option<&str>) -> Batched {
        Batched {
            item: item.into(),
            id: id.map(String::from),
        }
    }

    #[test]
    fn each_item_in_the_list_of_its_answer_once() {
        let journal: HashMap<String, Vec<Invocation>> = [
            (
                "A".to_string(),
                vec![started(&["a", "b"]), started(&["a", "b"])],
            ),
            ("B".to_string(), vec![started(&["c", "u"])]),
        ]
        .into();
        let log = [
            sent("a", Some("A")),
            sent("b", Some("A")),
            sent("c", Some("B")),
            sent("u", None),
        ];
        assert_eq!(check_batches(&log, &journal), Vec::<String>::new());
        // Lost, held twice, answered elsewhere, never sent, too long, lists differing.
        let lost = [sent("z", Some("A"))];
        assert_eq!(
            check_batches(&[&log[..], &lost].concat(), &journal).len(),
            1
        );
        let mut twice = journal.clone();
        twice.insert("C".into(), vec![started(&["a"])]);
        assert_eq!(
            check_batches(&log, &twice).len(),
            2,
            "held twice, answered A"
        );
        let mut bogus = journal.clone();
        bogus.insert("D".into(), vec![started(&["x", "y", "x2", "x3", "x4"])]);
        assert_eq!(check_batches(&log, &bogus).len(), 6);
        let mut differ = journal;
        differ.get_mut("A").unwrap().push(started(&["a"]));
        assert_eq!(check_batches(&log, &differ).len(), 1);
    }
}
