//! The task index: every task record's searchable fields, kept in memory by each server
//! from the task-state feed (`KV_AX_TASKS`, last value per key, then every change) and
//! rebuilt from it on start. It is a cache of the bucket (the broker is the truth): a lost index is
//! read again, nothing is written from it.
//!
//! Each filterable field has postings (value → set of `(updated_at_ms, slot)`), so a
//! query walks the smallest posting among its filters, newest first, and checks the
//! other filters on each entry: finding the 12 dead tasks of one error class among a
//! million records reads 12 entries, not a million.

use ax_core::state::TaskState;
use ax_sdk::ops::{TaskQuery, TaskRow};
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::sync::Arc;

/// A searchable field with postings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Field {
    Queue,
    Name,
    Class,
    Trigger,
    Run,
}

/// A task as the index holds it.
#[derive(Debug, Clone)]
struct Entry {
    id: Arc<str>,
    state: TaskState,
    /// Symbols of queue, name, error class, trigger, flow run (0 = none).
    syms: [u32; 5],
    /// The idempotency key (unique per task in practice: looked up by key, not posted).
    idem: Option<Box<str>>,
    /// Symbol of the last error as `class: message`, lowercased, its first [`ERR_TEXT`]
    /// bytes (0 = no error); `error_text` searches it on the entries it walks (it is not
    /// posted). Interned, so tasks that failed alike share one copy; and it sits in what
    /// was padding: an entry is no larger for it (see `an_entry_is_88_bytes`).
    err: u32,
    created_ms: u64,
    updated_ms: u64,
    attempt: u32,
    revision: u64,
}

/// The fields of a stored record the index reads (the rest of the JSON is skipped).
///
/// Text is borrowed from the record where it can be and copied where it cannot: a JSON
/// writer may escape any character (`\"`, `\n`, `\u00e9`), and an escaped string
/// cannot be borrowed.
#[derive(Debug, Deserialize)]
pub(crate) struct Indexed<'a> {
    #[serde(borrow)]
    queue: Cow<'a, str>,
    #[serde(borrow)]
    name: Cow<'a, str>,
    state: TaskState,
    #[serde(default)]
    attempt: u32,
    created_at_ms: u64,
    updated_at_ms: u64,
    #[serde(default, borrow)]
    last_error: Option<IndexedError<'a>>,
    #[serde(default, borrow)]
    trigger: Option<Text<'a>>,
    #[serde(default)]
    idempotency_key: Option<String>,
    #[serde(default)]
    run_at_ms: Option<u64>,
    #[serde(default)]
    started_at_ms: Option<u64>,
    #[serde(default)]
    finished_at_ms: Option<u64>,
}

impl<'a> Indexed<'a> {
    /// What the index keeps of a delayed task whose submit stored no record: the
    /// `scheduled` record its message stands for (docs/PROTOCOL.md §3, "Unrecorded tasks").
    pub(crate) fn scheduled(meta: &'a ax_core::task::TaskMeta) -> Indexed<'a> {
        Indexed {
            queue: Cow::Borrowed(&meta.queue),
            name: Cow::Borrowed(&meta.name),
            state: TaskState::Scheduled,
            attempt: 0,
            created_at_ms: meta.created_at_ms,
            updated_at_ms: meta.created_at_ms,
            last_error: None,
            trigger: None,
            idempotency_key: None,
            run_at_ms: meta.run_at_ms,
            started_at_ms: None,
            finished_at_ms: None,
        }
    }
}

/// A string field that borrows when it can (serde borrows `Cow<str>` itself, not
/// inside an `Option`).
#[derive(Debug, Deserialize)]
#[serde(transparent)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

#[derive(Debug, Deserialize)]
struct IndexedError<'a> {
    #[serde(borrow)]
    class: Cow<'a, str>,
    #[serde(default, borrow)]
    message: Option<Text<'a>>,
}

/// Most bytes of an error kept for `error_text`.
const ERR_TEXT: usize = 256;

/// `class: message`, lowercased, cut at a character boundary.
fn error_text(e: &IndexedError<'_>) -> String {
    let mut t = format!(
        "{}: {}",
        e.class,
        e.message.as_ref().map_or("", |m| m.0.as_ref())
    )
    .to_lowercase();
    if t.len() > ERR_TEXT {
        let mut end = ERR_TEXT;
        while !t.is_char_boundary(end) {
            end -= 1;
        }
        t.truncate(end);
    }
    t
}

/// Where a page of results continues: the last row's `(updated_at_ms, id)`.
pub(crate) type Cursor = (u64, String);

type Posting = BTreeSet<(u64, u32)>;

/// The index. Not synchronized: the server holds it behind a lock.
#[derive(Default)]
pub(crate) struct Index {
    entries: Vec<Option<Entry>>,
    free: Vec<u32>,
    by_id: HashMap<Arc<str>, u32>,
    /// Interned strings by symbol; symbol 0 is "none". Each live entry holds one reference
    /// to each symbol it uses: a symbol no entry uses any more (a finished flow run, an
    /// error class no task has now) is removed and its slot reused, so the table holds
    /// what the live entries use, not every string ever seen.
    names: Vec<Symbol>,
    symbols: HashMap<Arc<str>, u32>,
    /// Symbol slots free for reuse.
    free_syms: Vec<u32>,
    postings: HashMap<(Field, u32), Posting>,
    states: [Posting; 7],
    /// Per queue symbol: tasks by state.
    counts: HashMap<u32, [u64; 7]>,
    /// Idempotency key → its tasks.
    keys: HashMap<Box<str>, Slots>,
    /// Error classes some task has now: their postings together hold every task with an
    /// error once (what `error_text` walks).
    classes: HashSet<u32>,
    /// Per-minute series of the last hour, per queue (the console's charts).
    pub(crate) series: super::series::Series,
}

const FIELDS: [Field; 5] = [
    Field::Queue,
    Field::Name,
    Field::Class,
    Field::Trigger,
    Field::Run,
];

/// One interned string and how many references live entries hold to it.
#[derive(Debug, Default)]
struct Symbol {
    /// `None` while the slot is free.
    text: Option<Arc<str>>,
    refs: u32,
}

/// Postings read newest first from below a key: one as it is; more merged through a heap
/// (error classes may be many).
enum Walk<'a> {
    One(std::iter::Rev<std::collections::btree_set::Range<'a, (u64, u32)>>),
    Merged {
        iters: Vec<std::iter::Rev<std::collections::btree_set::Range<'a, (u64, u32)>>>,
        heads: BinaryHeap<((u64, u32), usize)>,
    },
}

impl<'a> Walk<'a> {
    fn new(postings: &[&'a Posting], before: (u64, u32)) -> Walk<'a> {
        let mut iters: Vec<_> = postings.iter().map(|p| p.range(..before).rev()).collect();
        if iters.len() == 1 {
            return Walk::One(iters.pop().expect("one"));
        }
        let heads = iters
            .iter_mut()
            .enumerate()
            .filter_map(|(i, it)| it.next().map(|k| (*k, i)))
            .collect();
        Walk::Merged { iters, heads }
    }
}

impl Iterator for Walk<'_> {
    type Item = (u64, u32);

    fn next(&mut self) -> Option<(u64, u32)> {
        match self {
            Walk::One(it) => it.next().copied(),
            Walk::Merged { iters, heads } => {
                let (key, i) = heads.pop()?;
                if let Some(next) = iters[i].next() {
                    heads.push((*next, i));
                }
                Some(key)
            }
        }
    }
}

/// The tasks with one idempotency key: nearly always one.
#[derive(Debug)]
enum Slots {
    One(u32),
    Many(Vec<u32>),
}

fn state_index(s: TaskState) -> usize {
    s as usize
}

/// The flow run of a step task id (`<queue>.fl.<run>.<step>.<epoch>.<item>`).
fn flow_run(id: &str) -> Option<&str> {
    let mut parts = id.splitn(4, '.');
    let (_, fl, run) = (parts.next()?, parts.next()?, parts.next()?);
    (fl == "fl" && parts.next().is_some()).then_some(run)
}

impl Index {
    /// The symbol of `s`, with one more reference to it (see [`Index::release`]).
    fn intern(&mut self, s: &str) -> u32 {
        if let Some(&sym) = self.symbols.get(s) {
            self.names[sym as usize].refs += 1;
            return sym;
        }
        if self.names.is_empty() {
            self.names.push(Symbol::default());
        }
        let arc: Arc<str> = Arc::from(s);
        let symbol = Symbol {
            text: Some(arc.clone()),
            refs: 1,
        };
        let sym = match self.free_syms.pop() {
            Some(sym) => {
                self.names[sym as usize] = symbol;
                sym
            }
            None => {
                self.names.push(symbol);
                (self.names.len() - 1) as u32
            }
        };
        self.symbols.insert(arc, sym);
        sym
    }

    /// Drops one reference to `sym` (0 is "none"); at the last, the string is forgotten
    /// (with the queue counts it keyed) and its slot is free for another.
    fn release(&mut self, sym: u32) {
        if sym == 0 {
            return;
        }
        let symbol = &mut self.names[sym as usize];
        symbol.refs -= 1;
        if symbol.refs > 0 {
            return;
        }
        if let Some(text) = symbol.text.take() {
            self.symbols.remove(&text);
        }
        self.counts.remove(&sym);
        self.free_syms.push(sym);
    }

    fn lookup(&self, s: &str) -> Option<u32> {
        self.symbols.get(s).copied()
    }

    fn name(&self, sym: u32) -> Option<String> {
        (sym != 0).then(|| {
            self.names[sym as usize]
                .text
                .as_deref()
                .unwrap_or_default()
                .to_string()
        })
    }

    /// Tasks indexed.
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Indexes a record (`revision` is its KV revision); an older revision than the one
    /// held is ignored.
    pub(crate) fn put(&mut self, id: &str, revision: u64, rec: &Indexed<'_>) {
        self.put_at(id, revision, rec, ax_core::time::now_ms());
    }

    /// [`Index::put`] at `now_ms` (the series counts only the last hour's changes).
    pub(crate) fn put_at(&mut self, id: &str, revision: u64, rec: &Indexed<'_>, now_ms: u64) {
        let held = self.by_id.get(id).copied();
        let mut before = None;
        if let Some(slot) = held {
            let old = self.entries[slot as usize].as_ref().expect("live slot");
            if old.revision >= revision {
                return;
            }
            before = Some((old.state, old.attempt));
        }
        // The new symbols are taken before the old ones are released, so a value the
        // task keeps (nearly all of them) is not freed and interned again.
        let syms = [
            self.intern(&rec.queue),
            self.intern(&rec.name),
            match &rec.last_error {
                Some(e) => self.intern(&e.class),
                None => 0,
            },
            rec.trigger.as_ref().map_or(0, |t| self.intern(&t.0)),
            flow_run(id).map_or(0, |r| self.intern(r)),
        ];
        let err = match &rec.last_error {
            Some(e) => self.intern(&error_text(e)),
            None => 0,
        };
        if let Some(slot) = held {
            self.unlink(slot);
        }
        let id: Arc<str> = match self.by_id.get_key_value(id) {
            Some((k, _)) => k.clone(),
            None => Arc::from(id),
        };
        let entry = Entry {
            id: id.clone(),
            state: rec.state,
            syms,
            idem: rec.idempotency_key.as_deref().map(Box::from),
            err,
            created_ms: rec.created_at_ms,
            updated_ms: rec.updated_at_ms,
            attempt: rec.attempt,
            revision,
        };
        let slot = match self.by_id.get(&id) {
            Some(&slot) => slot,
            None => {
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.entries.push(None);
                    (self.entries.len() - 1) as u32
                });
                self.by_id.insert(id, slot);
                slot
            }
        };
        self.entries[slot as usize] = Some(entry);
        self.link(slot);
        // Moved: a new state, or the same one again for another attempt (a `retrying`
        // whose `running` between was not seen).
        if before != Some((rec.state, rec.attempt)) {
            self.series.record(
                &super::series::Moved {
                    queue: &rec.queue,
                    state: rec.state,
                    attempt: rec.attempt,
                    created_at_ms: rec.created_at_ms,
                    updated_at_ms: rec.updated_at_ms,
                    run_at_ms: rec.run_at_ms,
                    started_at_ms: rec.started_at_ms,
                    finished_at_ms: rec.finished_at_ms,
                },
                now_ms,
            );
        }
    }

    /// Forgets a task (its record was deleted or purged).
    pub(crate) fn remove(&mut self, id: &str) {
        if let Some(slot) = self.by_id.remove(id) {
            self.unlink(slot);
            self.entries[slot as usize] = None;
            self.free.push(slot);
        }
    }

    /// Forgets a task if the revision held is older than `revision` (a newer record the
    /// index could not read: what it held no longer says what the task is).
    pub(crate) fn forget_older(&mut self, id: &str, revision: u64) {
        let older = self
            .by_id
            .get(id)
            .and_then(|&slot| self.entries[slot as usize].as_ref())
            .is_some_and(|e| e.revision < revision);
        if older {
            self.remove(id);
        }
    }

    fn link(&mut self, slot: u32) {
        let e = self.entries[slot as usize].as_ref().expect("live slot");
        let key = (e.updated_ms, slot);
        let (state, syms) = (e.state, e.syms);
        if let Some(k) = e.idem.clone() {
            match self.keys.get_mut(&k) {
                None => {
                    self.keys.insert(k, Slots::One(slot));
                }
                Some(Slots::One(other)) => {
                    let other = *other;
                    self.keys.insert(k, Slots::Many(vec![other, slot]));
                }
                Some(Slots::Many(v)) => v.push(slot),
            }
        }
        self.states[state_index(state)].insert(key);
        for (field, sym) in FIELDS.iter().zip(syms) {
            if sym != 0 && !matches!(field, Field::Queue) {
                self.postings.entry((*field, sym)).or_default().insert(key);
            }
        }
        if syms[2] != 0 {
            self.classes.insert(syms[2]);
        }
        self.postings
            .entry((Field::Queue, syms[0]))
            .or_default()
            .insert(key);
        self.counts.entry(syms[0]).or_default()[state_index(state)] += 1;
    }

    fn unlink(&mut self, slot: u32) {
        let e = self.entries[slot as usize].as_ref().expect("live slot");
        let key = (e.updated_ms, slot);
        let (state, syms, err) = (e.state, e.syms, e.err);
        if let Some(k) = &e.idem {
            let gone = match self.keys.get_mut(k) {
                Some(Slots::Many(v)) => {
                    v.retain(|&s| s != slot);
                    v.is_empty()
                }
                Some(Slots::One(_)) => true,
                None => false,
            };
            if gone {
                self.keys.remove(k);
            }
        }
        self.states[state_index(state)].remove(&key);
        for (field, sym) in FIELDS.iter().zip(syms) {
            if sym == 0 {
                continue;
            }
            if let Some(p) = self.postings.get_mut(&(*field, sym)) {
                p.remove(&key);
                if p.is_empty() {
                    self.postings.remove(&(*field, sym));
                    if *field == Field::Class {
                        self.classes.remove(&sym);
                    }
                }
            }
        }
        if let Some(c) = self.counts.get_mut(&syms[0]) {
            c[state_index(state)] -= 1;
        }
        for sym in syms {
            self.release(sym);
        }
        self.release(err);
    }

    /// The postings a query's filters name; `None` if a filter names a value no task has.
    fn candidates(&self, q: &TaskQuery) -> Option<Vec<&Posting>> {
        let mut out = Vec::new();
        if let Some(s) = q.state {
            out.push(&self.states[state_index(s)]);
        }
        let wanted = [
            (Field::Queue, &q.queue),
            (Field::Name, &q.name),
            (Field::Class, &q.error_class),
            (Field::Trigger, &q.trigger),
            (Field::Run, &q.flow_run),
        ];
        for (field, value) in wanted {
            if let Some(v) = value {
                let sym = self.lookup(v)?;
                out.push(self.postings.get(&(field, sym))?);
            }
        }
        Some(out)
    }

    /// True if `e` matches `q`; `syms` are the symbols of its field filters, `text` its
    /// `error_text` lowercased.
    fn matches(
        &self,
        e: &Entry,
        q: &TaskQuery,
        syms: &[Option<u32>; 5],
        text: Option<&str>,
    ) -> bool {
        q.state.is_none_or(|s| s == e.state)
            && q.idempotency_key
                .as_deref()
                .is_none_or(|k| e.idem.as_deref() == Some(k))
            && syms
                .iter()
                .zip(e.syms)
                .all(|(want, have)| want.is_none_or(|w| w == have))
            && q.id.as_deref().is_none_or(|id| *e.id == *id)
            && text.is_none_or(|t| {
                e.err != 0
                    && self.names[e.err as usize]
                        .text
                        .as_deref()
                        .is_some_and(|have| have.contains(t))
            })
            && q.from_ms.is_none_or(|t| e.updated_ms >= t)
            && q.to_ms.is_none_or(|t| e.updated_ms < t)
    }

    /// Up to `limit` tasks matching `q`, most recently changed first, after `cursor`; and
    /// how many match in all (counted up to `count_cap`, then `None`).
    pub(crate) fn find(
        &self,
        q: &TaskQuery,
        limit: usize,
        cursor: Option<&Cursor>,
        count_cap: usize,
    ) -> (Vec<TaskRow>, Option<usize>) {
        let Some(postings) = self.candidates(q) else {
            return (Vec::new(), Some(0));
        };
        let syms = [
            q.queue.as_deref().and_then(|v| self.lookup(v)),
            q.name.as_deref().and_then(|v| self.lookup(v)),
            q.error_class.as_deref().and_then(|v| self.lookup(v)),
            q.trigger.as_deref().and_then(|v| self.lookup(v)),
            q.flow_run.as_deref().and_then(|v| self.lookup(v)),
        ];
        let text = q.error_text.as_deref().map(str::to_lowercase);
        // An id or an idempotency key names its few tasks directly; else the smallest
        // posting a filter names, or, for `error_text`, the postings of every error class
        // (together they hold every task with an error once) if they are fewer; with
        // none of these, every state's posting merged (together they hold every task
        // once).
        let by_key: Posting;
        let smallest = postings.iter().min_by_key(|p| p.len()).copied();
        let walk: Vec<&Posting> = if let Some(id) = &q.id {
            by_key = self
                .by_id
                .get(id.as_str())
                .and_then(|&s| self.entries[s as usize].as_ref().map(|e| (e.updated_ms, s)))
                .into_iter()
                .collect();
            vec![&by_key]
        } else if let Some(k) = &q.idempotency_key {
            let slots: &[u32] = match self.keys.get(k.as_str()) {
                Some(Slots::One(s)) => std::slice::from_ref(s),
                Some(Slots::Many(v)) => v,
                None => &[],
            };
            by_key = slots
                .iter()
                .filter_map(|&s| self.entries[s as usize].as_ref().map(|e| (e.updated_ms, s)))
                .collect();
            vec![&by_key]
        } else {
            let failed: Vec<&Posting> = match text {
                Some(_) => self
                    .classes
                    .iter()
                    .filter_map(|&c| self.postings.get(&(Field::Class, c)))
                    .collect(),
                None => Vec::new(),
            };
            let failed_len: usize = failed.iter().map(|p| p.len()).sum();
            match smallest {
                Some(p) if text.is_none() || p.len() <= failed_len => vec![p],
                _ if text.is_some() => failed,
                _ => self.states.iter().collect(),
            }
        };
        let upper = q.to_ms.unwrap_or(u64::MAX);
        let lower = q.from_ms.unwrap_or(0);
        let before = match cursor {
            Some((t, id)) => (*t, self.by_id.get(id.as_str()).copied().unwrap_or(0)),
            None => (upper, 0),
        };
        let range = Walk::new(&walk, before);
        let mut rows = Vec::new();
        let mut count = 0usize;
        let mut capped = false;
        for (updated, slot) in range {
            if updated < lower {
                break;
            }
            let e = self.entries[slot as usize].as_ref().expect("live slot");
            if !self.matches(e, q, &syms, text.as_deref()) {
                continue;
            }
            count += 1;
            if rows.len() < limit {
                rows.push(self.row(e));
            } else if count >= count_cap {
                capped = true;
                break;
            }
        }
        (rows, (!capped).then_some(count))
    }

    /// Up to `limit` tasks matching `q` in any of `states`, state by state (newest first
    /// within each), and how many match in all (`None` past `count_cap` in one state).
    pub(crate) fn find_in_states(
        &self,
        q: &TaskQuery,
        states: &[TaskState],
        limit: usize,
        count_cap: usize,
    ) -> (Vec<TaskRow>, Option<usize>) {
        let mut rows = Vec::new();
        let mut total = Some(0);
        for &s in states {
            let q = TaskQuery {
                state: Some(s),
                ..q.clone()
            };
            let (found, n) = self.find(&q, limit - rows.len(), None, count_cap);
            rows.extend(found);
            total = total.zip(n).map(|(a, b)| a + b);
            if rows.len() >= limit {
                break;
            }
        }
        (rows, total)
    }

    fn row(&self, e: &Entry) -> TaskRow {
        TaskRow {
            id: e.id.to_string(),
            queue: self.name(e.syms[0]).unwrap_or_default(),
            name: self.name(e.syms[1]).unwrap_or_default(),
            state: e.state,
            attempt: e.attempt,
            error_class: self.name(e.syms[2]),
            trigger: self.name(e.syms[3]),
            created_at_ms: e.created_ms,
            updated_at_ms: e.updated_ms,
            revision: e.revision,
        }
    }

    /// Strings interned now (queue, name, class, trigger and flow-run values in use).
    #[cfg(test)]
    pub(crate) fn symbols_live(&self) -> usize {
        self.symbols.len()
    }

    /// Symbol slots allocated (live or free for reuse), "none" included.
    #[cfg(test)]
    pub(crate) fn symbol_slots(&self) -> usize {
        self.names.len()
    }

    /// The state of task `id` as indexed.
    #[cfg(test)]
    pub(crate) fn state_of(&self, id: &str) -> Option<TaskState> {
        let slot = *self.by_id.get(id)?;
        self.entries[slot as usize].as_ref().map(|e| e.state)
    }

    /// Per queue: tasks by state (`scheduled, pending, running, retrying, succeeded, dead,
    /// cancelled`).
    pub(crate) fn counts(&self) -> Vec<(String, [u64; 7])> {
        let mut out: Vec<_> = self
            .counts
            .iter()
            .filter(|(_, c)| c.iter().any(|&n| n > 0))
            .map(|(&q, c)| (self.name(q).unwrap_or_default(), *c))
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests;
