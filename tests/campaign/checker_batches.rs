//! The batching rule (docs/PROTOCOL.md §2, "Batching"), from the producers' log and the
//! workers' journals (each start of a batch's task journals the `item` of every element
//! of its list): an item answered with a batch's id is in that batch's list and in no
//! other — unless it had no idempotency key and an earlier attempt of its submit went
//! unanswered (that attempt may have stored it too: the protocol's documented
//! duplicate); no list holds an item twice, an item never sent, or more than the batch
//! size; every attempt of a batch runs the same list. (That each batch runs is the tasks
//! rule: its id is accepted.)

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
    /// No attempt before the answered one went unanswered or was answered `unavailable`.
    pub clean: bool,
    /// Sent with an idempotency key (the item): held once however often it was sent.
    pub keyed: bool,
}

/// The batching rule over every batched submit and the journal.
pub fn check_batches(sent: &[Batched], journal: &HashMap<String, Vec<Invocation>>) -> Vec<String> {
    let mut out = Vec::new();
    let sent_items: HashSet<&str> = sent.iter().map(|b| b.item.as_str()).collect();
    let unclean: HashSet<&str> = sent
        .iter()
        .filter(|b| !b.clean && !b.keyed)
        .map(|b| b.item.as_str())
        .collect();
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
    let mut holders: HashMap<&str, Vec<&str>> = HashMap::new();
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
            let held = holders.entry(item).or_default();
            if let Some(other) = held.first().filter(|_| !unclean.contains(item.as_str())) {
                out.push(format!("item {item} held by batch {other} and batch {id}"));
            }
            held.push(id);
        }
    }
    for b in sent {
        let Some(id) = &b.id else { continue };
        let held = holders.get(b.item.as_str());
        match (held, lists.contains_key(id.as_str())) {
            (Some(held), _) if !held.contains(&id.as_str()) => out.push(format!(
                "item {} answered with batch {id} ran in batch {held:?}",
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
            clean: true,
            keyed: false,
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
        assert_eq!(check_batches(&log, &twice).len(), 1, "held twice");
        // Unless an unanswered attempt of its submit may have stored it before.
        let mut retried = log.to_vec();
        retried[0].clean = false;
        assert_eq!(check_batches(&retried, &twice), Vec::<String>::new());
        // Not if it had an idempotency key.
        retried[0].keyed = true;
        assert_eq!(
            check_batches(&retried, &twice).len(),
            1,
            "a keyed item held twice"
        );
        retried[0].keyed = false;
        let mut elsewhere = twice.clone();
        let a = elsewhere.get_mut("A").unwrap();
        a[0].items = Some(vec!["b".into()]);
        a[1].items = Some(vec!["b".into()]);
        assert_eq!(
            check_batches(&retried, &elsewhere).len(),
            1,
            "answered A, ran in C only"
        );
        let mut bogus = journal.clone();
        bogus.insert("D".into(), vec![started(&["x", "y", "x2", "x3", "x4"])]);
        assert_eq!(check_batches(&log, &bogus).len(), 6);
        let mut differ = journal;
        differ.get_mut("A").unwrap().push(started(&["a"]));
        assert_eq!(check_batches(&log, &differ).len(), 1);
    }
}
